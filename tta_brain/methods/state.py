"""In-place snapshot / restore of parameter lists and optimiser state (no reallocation per step)."""
from typing import List, Sequence

import torch

__all__ = ["snapshot", "restore", "zero_optimizer_state", "copy_optimizer_state"]


def snapshot(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Detached copies of ``tensors`` (allocated once; refresh them with :func:`restore`)."""
    return [t.detach().clone() for t in tensors]


@torch.no_grad()
def restore(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """Copy ``src`` into ``dst`` element-wise, in place."""
    if len(dst) != len(src):
        raise ValueError(f"restore: {len(dst)} destination tensors but {len(src)} sources")
    torch._foreach_copy_(list(dst), list(src))


def _by_device(*lists):
    """Split parallel tensor lists into groups that share the first list's device and dtype."""
    groups = {}
    for ts in zip(*lists):
        key = (ts[0].device, ts[0].dtype)
        g = groups.setdefault(key, tuple([] for _ in lists))
        for lst, t in zip(g, ts):
            lst.append(t)
    return list(groups.values())


@torch.no_grad()
def zero_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Make ``opt`` behave like a freshly built optimiser (moments and step counts zeroed)."""
    tensors = [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    for (group,) in _by_device(tensors):
        torch._foreach_zero_(group)


@torch.no_grad()
def copy_optimizer_state(src: torch.optim.Optimizer, src_params, dst: torch.optim.Optimizer,
                         dst_params) -> None:
    """Copy the per-parameter state of ``src`` into ``dst`` (same shapes), in place.

    A source parameter without state (never stepped) zeroes the destination's state. Tensors
    that already exist in ``dst`` with the same shape, dtype and device are copied with one
    ``foreach`` copy per device (no allocation); others are cloned.
    """
    dsts, srcs, zeros = [], [], []
    for ps, pd in zip(src_params, dst_params):
        s, d = src.state[ps], dst.state[pd]
        if not s:
            zeros.extend(v for v in d.values() if torch.is_tensor(v))
            continue
        for k, v in s.items():
            if torch.is_tensor(v):
                dv = d.get(k)
                if (torch.is_tensor(dv) and dv.shape == v.shape and dv.dtype == v.dtype
                        and dv.device == v.device):
                    dsts.append(dv)
                    srcs.append(v)
                elif torch.is_tensor(dv) and dv.shape == v.shape:
                    dv.copy_(v)
                else:
                    d[k] = v.clone()
            else:
                d[k] = v
    for dg, sg in _by_device(dsts, srcs):
        torch._foreach_copy_(dg, sg)
    for (group,) in _by_device(zeros):
        torch._foreach_zero_(group)
