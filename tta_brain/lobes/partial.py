"""Partial forwards of the Hugging Face wav2vec 2.0 family (wav2vec2, HuBERT, data2vec-audio), for
methods that evaluate many candidates of one utterance (the backprop-free CMA-ES methods): the part
of the network before the candidates' insertion point runs once, the rest once for a batch of
candidates ``[P, ...]``.

The stages, in the models' own order (same operations as ``model(input_values)`` in eval mode, so
a full pass assembled from them gives the model's logits)::

    last_conv(x)        CNN layers 0 .. L-2, then the conv of layer L-1     [1, C, F]  (E-BATS inserts here)
    finish_cnn(c)       layer L-1's norm + activation                        [P, C, F]
    encoder_input(f)    projection, positional conv (+ layer norm)           [P, F, H]  (FOA inserts here)
    layers(h)           the transformer layers (+ final layer norm)          hidden states, last
    head(h)             the CTC head                                         [P, F, V]

``layers`` returns the hidden states as ``output_hidden_states=True`` would (the layers' inputs
and the last output: ``num_hidden_layers + 1`` tensors).
"""
from typing import List, Optional, Tuple

import torch
from torch import nn

__all__ = ["PartialForward"]


class PartialForward:
    """The stages of ``lobe.model`` (an ``HFCTCLobe``'s model); see the module docstring."""

    def __init__(self, lobe):
        if not lobe.supports_features:
            raise ValueError(f"{type(lobe.model).__name__}: a partial forward needs a wav2vec 2.0-style "
                             f"model (feature_extractor, feature_projection, encoder, lm_head)")
        self.lobe, self.model = lobe, lobe.model
        self.base = lobe.model.base_model
        self.encoder = self.base.encoder
        # the "stable layer norm" encoders (wav2vec2-large-lv60, HuBERT-large) normalise at the end
        self.stable = type(self.encoder).__name__.endswith("StableLayerNorm")
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

    def layers(self, h: torch.Tensor, skip: int = 0) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """The transformer layers on ``h [B, F, H]``; the hidden states (each layer's input and
        the last output, the first ``skip`` positions - prompts - dropped) and the last one."""
        states = []
        for layer in self.encoder.layers:
            states.append(h[:, skip:])
            h = layer(h, attention_mask=None)[0]
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
