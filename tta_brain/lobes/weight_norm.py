"""Frozen weight norms computed once, not on every pass.

wav2vec 2.0-style models reparametrise their positional convolution with ``weight_norm``
(``torch.nn.utils.parametrizations``): every forward recomputes ``w = g * v / ||v||`` from the
stored ``g`` and ``v``, although no TTA method of the paper adapts that layer. On an H200 this was
11 kernels and 3.7 ms of GPU time per SUTA utterance (``docs/gpu/2026-11-27b_h200``).

:func:`cache_frozen_weight_norms` swaps each such parametrisation for :class:`CachedWeightNorm`,
which keeps its last result while ``g`` and ``v`` are unchanged and need no gradient. The result is
the same operation on the same tensors, so every logit, gradient and transcript is unchanged; the
state dict keeps its keys (``parametrizations.weight.original0/1``) and a method that adapts the
layer (``select: all``) gets the ordinary differentiable computation.
"""
from typing import Optional, Tuple

import torch
from torch import nn
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _WeightNorm

__all__ = ["CachedWeightNorm", "cache_frozen_weight_norms"]


def _key(weight_g: torch.Tensor, weight_v: torch.Tensor) -> Tuple:
    # an in-place change (load_state_dict, an optimiser, a restore) bumps a tensor's version; a
    # move to another device or dtype makes new tensors
    return (weight_g._version, weight_v._version, weight_g.data_ptr(), weight_v.data_ptr(),
            weight_v.device, weight_v.dtype)


def _constant(t: torch.Tensor) -> bool:
    # no gradient wanted, and not a torch.func wrapper (vmap's rows of a batched sweep's runs)
    return not t.requires_grad and not is_functorch_wrapped_tensor(t)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CachedWeightNorm(_WeightNorm):
    """``weight_norm``'s parametrisation, computed once while its inputs stay the same.

    The cache is refreshed eagerly when ``g`` or ``v`` change (in place, so a CUDA graph captured
    while it was valid reads the new values once an eager pass has run). It is bypassed when
    either needs a gradient (the layer adapts) or is a ``torch.func`` wrapper (a batched sweep's
    stacked rows) and under ``torch.compile``; inside a CUDA graph capture a valid cache is read,
    an invalid one is not refreshed (a value computed there exists only once the graph replays):
    the graph then computes the weight norm itself.
    """

    def __init__(self, dim: Optional[int] = 0) -> None:
        super().__init__(dim)
        self.__dict__["_cached"] = None      # kept out of the state dict and of .to()
        self.__dict__["_cache_key"] = None
        self.computed = 0                    # weight norms computed, cached or not (tests, checks)

    def forward(self, weight_g: torch.Tensor, weight_v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch._weight_norm(weight_v, weight_g, self.dim)
        if not (_constant(weight_g) and _constant(weight_v)):
            self.computed += 1
            return torch._weight_norm(weight_v, weight_g, self.dim)
        key = _key(weight_g, weight_v)
        if key != self._cache_key:
            if _capturing(weight_v.device):          # the graph computes it on every replay
                self.computed += 1
                return torch._weight_norm(weight_v, weight_g, self.dim)
            with torch.no_grad():
                value = torch._weight_norm(weight_v, weight_g, self.dim)
                cached = self._cached
                if (cached is not None and cached.shape == value.shape
                        and cached.device == value.device and cached.dtype == value.dtype):
                    cached.copy_(value)
                else:
                    self.__dict__["_cached"] = value
            self.computed += 1
            self.__dict__["_cache_key"] = key
        return self._cached


def cache_frozen_weight_norms(model: nn.Module) -> int:
    """Swap every ``weight_norm`` parametrisation in ``model`` for :class:`CachedWeightNorm`;
    returns how many. Models on the older hook-based ``weight_norm`` are left as they are."""
    n = 0
    for module in model.modules():
        if not parametrize.is_parametrized(module):
            continue
        for plist in module.parametrizations.values():
            for i, p in enumerate(plist):
                if type(p) is _WeightNorm:
                    plist[i] = CachedWeightNorm(p.dim)
                    n += 1
    return n
