"""Partial forwards of the Hugging Face wav2vec 2.0 family (wav2vec2, HuBERT, data2vec-audio,
WavLM, UniSpeech(-SAT): :data:`PARTIAL_ENCODERS`), for methods that evaluate many candidates of
one utterance (the backprop-free CMA-ES methods): the part of the network before the candidates'
insertion point runs once, the rest once for a batch of candidates ``[P, ...]``.

The stages, in the models' own order (same operations as ``model(input_values)`` in eval mode, so
a full pass assembled from them gives the model's logits)::

    last_conv(x)        CNN layers 0 .. L-2, then the conv of layer L-1     [1, C, F]  (E-BATS inserts here)
    finish_cnn(c)       layer L-1's norm + activation                        [P, C, F]
    encoder_input(f)    projection, positional conv (+ layer norm)           [P, F, H]  (FOA inserts here)
    layers(h)           the transformer layers (+ final layer norm)          hidden states, last
    head(h)             the CTC head                                         [P, F, V]

``layers`` returns the hidden states as ``output_hidden_states=True`` would (the layers' inputs
and the last output: ``num_hidden_layers + 1`` tensors).

**Padded passes** (:meth:`PartialForward.padded`, the length buckets of the captured steps,
``tta_brain.gpu``): one utterance zero-padded to a longer input, its valid length given as a
device tensor, gives the logits of the unpadded pass on the valid frames, exactly in arithmetic
(to floating-point rounding: the sums run over other lengths). The padded samples and frames are
kept out of everything the valid frames see: the GroupNorm of the first CNN layer (wav2vec2-base's
per-channel normalisation over time) takes its statistics over the valid frames only, the CNN's
other layers have no padding (a valid frame reads valid samples only), the projected frames past
the valid length are zeroed before the positional convolution (as the unpadded pass's zero
padding) and masked as attention keys. :func:`padding_blocker` says where that does not hold
(data2vec-audio's stacked positional convolutions, HuBERT's ``conv_pos_batch_norm``, adapters,
other encoders).
Nothing in a padded pass reads a value on the host, so it can be captured in a CUDA graph.
"""
import inspect
from typing import List, Optional, Tuple

import torch
from torch import nn

from tta_brain.lobes.families import FEATURE_MODELS

__all__ = ["PartialForward", "padding_blocker", "PADDABLE_ENCODERS", "PARTIAL_ENCODERS"]

#: encoders whose padded frames a padded pass masks exactly (see the module docstring)
PADDABLE_ENCODERS = ("Wav2Vec2Encoder", "Wav2Vec2EncoderStableLayerNorm", "HubertEncoder",
                     "HubertEncoderStableLayerNorm")


#: encoders whose layers the partial forward runs as the model does (tested: identical logits and
#: hidden states); a Conformer's relative position embeddings, say, are not threaded through
PARTIAL_ENCODERS = tuple(f"{family}Encoder{stable}" for family in
                         ("Wav2Vec2", "Hubert", "WavLM", "UniSpeech", "UniSpeechSat")
                         for stable in ("", "StableLayerNorm")) + ("Data2VecAudioEncoder",)


def padding_blocker(lobe) -> Optional[str]:
    """Why a padded pass of ``lobe``'s model would not give its unpadded logits (None: it does)."""
    model = lobe.model
    if not lobe.supports_features:
        return f"{type(model).__name__} is not a wav2vec 2.0-style model"
    base = model.base_model
    name = type(base.encoder).__name__
    if name not in PADDABLE_ENCODERS:
        return (f"its encoder ({name}) is not one whose padding is masked exactly "
                f"({', '.join(PADDABLE_ENCODERS)})")
    if getattr(base.encoder.pos_conv_embed, "batch_norm", None) is not None:
        return "its positional convolution normalises over padded frames (conv_pos_batch_norm)"
    if getattr(base, "adapter", None) is not None:
        return "it has an adapter (strided convolutions over padded frames)"
    for i, layer in enumerate(base.feature_extractor.conv_layers):
        norm = getattr(layer, "layer_norm", None)
        if isinstance(norm, nn.GroupNorm) and (i > 0 or norm.num_groups != norm.num_channels):
            return f"CNN layer {i} has a GroupNorm the padded pass does not mask"
        if norm is not None and not isinstance(norm, (nn.GroupNorm, nn.LayerNorm)):
            return f"CNN layer {i} normalises with {type(norm).__name__}"
    return None


def _masked_channel_norm(norm: nn.GroupNorm, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``norm`` (a GroupNorm with one group per channel) on ``h [B, C, L]`` with the statistics of
    the first ``valid [B]`` frames only."""
    mask = (torch.arange(h.shape[-1], device=h.device)[None] < valid[:, None]).to(h.dtype)[:, None]
    count = mask.sum(-1, keepdim=True)
    mean = (h * mask).sum(-1, keepdim=True) / count
    var = (((h - mean) * mask) ** 2).sum(-1, keepdim=True) / count
    out = (h - mean) * torch.rsqrt(var + norm.eps)
    return out * norm.weight[None, :, None] + norm.bias[None, :, None]


class PartialForward:
    """The stages of ``lobe.model`` (an ``HFCTCLobe``'s model); see the module docstring."""

    def __init__(self, lobe):
        if not lobe.supports_features:       # the reason, not a list of parts SEW also has
            base = type(getattr(lobe.model, "base_model", lobe.model)).__name__
            # (a Conformer's encoder is refused below: its layers need relative positions)
            ok = [m for m in FEATURE_MODELS if m != "Wav2Vec2ConformerModel"]
            raise ValueError(f"{type(lobe.model).__name__}: a partial forward needs a wav2vec "
                             f"2.0-style model whose forward after the CNN it reproduces (base "
                             f"model one of {', '.join(ok)}; this one's is {base})")
        encoder = type(lobe.model.base_model.encoder).__name__
        if encoder not in PARTIAL_ENCODERS:
            raise ValueError(f"{type(lobe.model).__name__}: its encoder ({encoder}) is not one the "
                             f"partial forward runs layer by layer ({', '.join(PARTIAL_ENCODERS)})")
        self.lobe, self.model = lobe, lobe.model
        self.base = lobe.model.base_model
        self.encoder = self.base.encoder
        # the "stable layer norm" encoders (wav2vec2-large-lv60, HuBERT-large) normalise at the end
        self.stable = type(self.encoder).__name__.endswith("StableLayerNorm")
        # WavLM: layer 0 computes a relative position bias that the later layers take in
        self.relative = any(hasattr(getattr(layer, "attention", None), "rel_attn_embed")
                            for layer in self.encoder.layers)
        self.indexed = self.relative and "index" in inspect.signature(
            self.encoder.layers[0].forward).parameters
        self.conv_layers = self.base.feature_extractor.conv_layers
        self.conv_channels = self.conv_layers[-1].conv.out_channels
        self.hidden_size = self.model.config.hidden_size

    # ----------------------------------------------------------------- CNN
    def last_conv(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised input ``[B, T]`` -> the last CNN layer's conv output (before its norm and
        activation) ``[B, C, F]``."""
        h = x[:, None]
        for layer in self.conv_layers[:-1]:
            h = layer(h)
        return self.conv_layers[-1].conv(h)

    def finish_cnn(self, conv_out: torch.Tensor) -> torch.Tensor:
        """The last CNN layer after its conv: norm (if any) and activation -> features ``[B, C, F]``."""
        layer = self.conv_layers[-1]
        h = conv_out
        norm = getattr(layer, "layer_norm", None)
        if isinstance(norm, nn.LayerNorm):          # normalises channels: [B, F, C]
            h = norm(h.transpose(-2, -1)).transpose(-2, -1)
        elif norm is not None:                      # GroupNorm on [B, C, F]
            h = norm(h)
        return layer.activation(h)

    # ----------------------------------------------------------------- transformer
    def encoder_input(self, features: torch.Tensor) -> torch.Tensor:
        """CNN features ``[B, C, F]`` -> the first transformer layer's input ``[B, F, H]``:
        projection, positional conv embedding, layer norm (not for stable-layer-norm encoders)."""
        out = self.base.feature_projection(features.transpose(1, 2))
        h = out[0] if isinstance(out, tuple) else out
        h = h + self.encoder.pos_conv_embed(h)
        if not self.stable:
            h = self.encoder.layer_norm(h)
        return self.encoder.dropout(h)

    def layers(self, h: torch.Tensor, skip: int = 0, attention_mask: Optional[torch.Tensor] = None
               ) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """The transformer layers on ``h [B, F, H]``; the hidden states (each layer's input and
        the last output, the first ``skip`` positions - prompts - dropped) and the last one.
        ``attention_mask``: additive ``[B, 1, F, F]`` (padded passes)."""
        states, position_bias = [], None
        for i, layer in enumerate(self.encoder.layers):
            states.append(h[:, skip:])
            if self.relative:
                h, position_bias = layer(h, attention_mask=attention_mask,
                                         position_bias=position_bias,
                                         **({"index": i} if self.indexed else {}))[:2]
            else:
                h = layer(h, attention_mask=attention_mask)[0]
        if self.stable:
            h = self.encoder.layer_norm(h)
        states.append(h[:, skip:])
        return states, h[:, skip:]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden state ``[B, F, H]`` -> float32 logits ``[B, F, V]`` (adapter, dropout,
        lm_head; under autocast the passes run in the autocast precision)."""
        if getattr(self.base, "adapter", None) is not None:
            hidden = self.base.adapter(hidden)
        return self.model.lm_head(self.model.dropout(hidden)).float()

    # ----------------------------------------------------------------- whole passes
    def prompted(self, h: torch.Tensor, prompts: Optional[torch.Tensor] = None):
        """From the first layer's input ``h [B, F, H]`` (or ``[1, F, H]`` with ``prompts
        [P, n, H]``: each prompt prepended to the same sequence) -> (logits, hidden states, last
        hidden state), the prompt positions dropped."""
        skip = 0
        if prompts is not None:
            skip = prompts.shape[1]
            h = torch.cat([prompts.to(h.dtype), h.expand(prompts.shape[0], -1, -1)], dim=1)
        states, last = self.layers(h, skip)
        return self.head(last), states, last

    def from_features(self, features: torch.Tensor):
        """CNN features ``[B, C, F]`` -> (logits, hidden states, last hidden state)."""
        return self.prompted(self.encoder_input(features))

    def hidden(self, x: torch.Tensor):
        """A full pass of normalised input ``[B, T]``: (logits, CNN features ``[B, C, F]``,
        hidden states, last hidden state)."""
        feats = self.finish_cnn(self.last_conv(x))
        logits, states, last = self.from_features(feats)
        return logits, feats, states, last

    # ----------------------------------------------------------------- padded passes
    def frames(self, samples: torch.Tensor) -> torch.Tensor:
        """Valid logit frames of inputs of ``samples`` valid samples (device tensor arithmetic)."""
        return self.model._get_feat_extract_output_lengths(samples)

    def padded(self, x: Optional[torch.Tensor], samples: torch.Tensor,
               features: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """A padded pass (module docstring; exact where :func:`padding_blocker` is None): the
        normalised input ``x [B, T]``, zero past ``samples [B]`` (long, on the device), or its CNN
        features ``[B, C, F]`` computed from the unpadded input and zero-padded -> (logits
        ``[B, F, V]``, valid frames ``[B]``). Logits past the valid frames are meaningless."""
        frames = self.frames(samples)
        if features is None:
            first = self.conv_layers[0]
            norm = getattr(first, "layer_norm", None)
            if isinstance(norm, nn.GroupNorm):       # statistics over the valid frames only
                k, s = first.conv.kernel_size[0], first.conv.stride[0]
                valid0 = torch.div(samples - k, s, rounding_mode="floor") + 1
                h = first.activation(_masked_channel_norm(norm, first.conv(x[:, None]), valid0))
            else:
                h = first(x[:, None])
            for layer in self.conv_layers[1:]:
                h = layer(h)
            features = h
        valid = torch.arange(features.shape[-1], device=features.device)[None] < frames[:, None]
        out = self.base.feature_projection(features.transpose(1, 2))
        h = out[0] if isinstance(out, tuple) else out
        h = h * valid[..., None].to(h.dtype)
        h = h + self.encoder.pos_conv_embed(h)
        if not self.stable:
            h = self.encoder.layer_norm(h)
        h = self.encoder.dropout(h)
        n = h.shape[1]
        keys = torch.zeros(valid.shape, dtype=h.dtype, device=h.device)
        keys = keys.masked_fill(~valid, torch.finfo(h.dtype).min)
        _, last = self.layers(h, attention_mask=keys[:, None, None, :].expand(-1, 1, n, n))
        return self.head(last), frames
