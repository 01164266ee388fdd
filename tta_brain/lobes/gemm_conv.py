"""The CNN feature encoder's convolutions as matrix products (the run option ``convolutions``).

wav2vec 2.0-style models open with a CNN of 1-D convolutions (wav2vec2-base: 7 layers, 512
channels, kernels 10/3/3/3/3/2/2, strides 5/2/2/2/2/2/2, no padding), and the paper's SUTA family
adapts it, so every adaptation step runs its forward, its input gradients and its weight
gradients. On an H200 (``docs/gpu/2026-11-27b_h200``, SUTA on length buckets, deterministic
kernels) cuDNN's convolution kernels took about half of the GPU's kernel time per utterance, and
in a batch of 8 runs the layout conversions around them 48 ms of its 466 ms per utterance.

``convolutions: gemm`` runs each of those convolutions as one matrix product instead: the input's
windows (``unfold``: a view, then one copy into ``[B, C * k, frames]``) times the weight as a
``[out, C * k]`` matrix, plus the bias. Autograd gives its input and weight gradients as two more
matrix products and ``unfold``'s backward (a gather: no atomics, deterministic). Under a batched
sweep's ``vmap`` the runs' weights make it one batched matrix product. It is the same sum in
another order, so logits and gradients equal cuDNN's and oneDNN's to rounding, not bit for bit.
On CUDA the products follow ``tf32`` as every matmul does (``torch``, the default: fp32; ``on``:
TF32), where cuDNN's convolutions run in TF32 under ``torch``.

Only the feature encoder's convolutions are taken (groups 1, no padding, no dilation): the
positional convolution (kernel 128, 16 groups) would need a window copy 128 times its input, and
a depthwise convolution (the Conformers') is not a matrix product. A model without such a CNN
(Wav2Vec2-BERT's filterbank input) is refused in one line (:func:`gemm_convolutions`).
"""
from typing import Dict, Optional

import torch
from torch import nn

from tta_brain.lobes.families import base_model

__all__ = ["conv1d_gemm", "GemmConv", "gemm_convolutions", "feature_encoder_convs",
           "CONVOLUTIONS"]

#: the run option's values: what each does
CONVOLUTIONS = {"native": "cuDNN / oneDNN convolutions (torch's conv1d)",
                "gemm": "the CNN's convolutions as matrix products (lobes/gemm_conv.py)"}


def conv1d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                stride: int = 1) -> torch.Tensor:
    """``torch.nn.functional.conv1d(x, weight, bias, stride)`` (no padding, dilation 1, one group)
    as one matrix product: ``x [B, C, T]`` (or ``[C, T]``), ``weight [O, C, k]`` ->
    ``[B, O, (T - k) // s + 1]``."""
    out_ch, in_ch, k = weight.shape
    windows = x.unfold(-1, k, stride)                   # [B, C, F, k], a view
    cols = windows.transpose(-1, -2).flatten(-3, -2)    # [B, C * k, F], one copy
    out = torch.matmul(weight.reshape(out_ch, in_ch * k), cols)       # [B, O, F]
    if bias is not None:
        out = out + bias.to(out.dtype)[:, None]
    return out


class GemmConv:
    """Mixed into an ``nn.Conv1d``'s class by :func:`gemm_convolutions`: its forward is
    :func:`conv1d_gemm`. Parameters, state-dict keys and the module's other behaviour are the
    convolution's own."""

    def _conv_forward(self, input, weight, bias):
        return conv1d_gemm(input, weight, bias, self.stride[0])


_CLASSES: Dict[type, type] = {}


def _gemm_class(cls: type) -> type:
    # one subclass per convolution class (nn.Conv1d, or a parametrised one), made once and named
    # in this module, so that a module holding one pickles (torch.save of the module)
    if cls not in _CLASSES:
        name = f"Gemm{cls.__name__}"
        made = _CLASSES[cls] = type(name, (GemmConv, cls), {"__module__": __name__,
                                                            "__qualname__": name})
        globals().setdefault(name, made)
    return _CLASSES[cls]


def _takes(conv: nn.Module) -> bool:
    return (isinstance(conv, nn.Conv1d) and not isinstance(conv, GemmConv)
            and conv.groups == 1 and tuple(conv.dilation) == (1,)
            and not isinstance(conv.padding, str) and tuple(conv.padding) == (0,))


def feature_encoder_convs(model: nn.Module):
    """The convolutions of ``model``'s CNN feature encoder (``feature_extractor.conv_layers``, the
    wav2vec 2.0 family's), in order; empty for a model without one."""
    layers = getattr(getattr(base_model(model), "feature_extractor", None), "conv_layers",
                     None) or []
    return [layer.conv for layer in layers if isinstance(getattr(layer, "conv", None), nn.Conv1d)]


def gemm_convolutions(model: nn.Module) -> int:
    """Run the CNN feature encoder's convolutions of ``model`` as matrix products (module
    docstring); returns how many. Raises ``ValueError`` (one line) when the model has none it can
    take."""
    convs = feature_encoder_convs(model)
    taken = [c for c in convs if _takes(c)]
    if not taken and not any(isinstance(c, GemmConv) for c in convs):
        why = ("it has no CNN feature encoder (its input is "
               f"{getattr(model, 'main_input_name', 'not a waveform')})" if not convs else
               "its CNN's convolutions are padded, grouped or dilated")
        raise ValueError(f"convolutions: gemm: {type(model).__name__} has no convolution it "
                         f"runs as a matrix product: {why}; use convolutions: native")
    for conv in taken:
        conv.__class__ = _gemm_class(type(conv))
    return len(taken)
