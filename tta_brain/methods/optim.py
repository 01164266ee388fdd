"""The optimisers of a parameter selection: :func:`build_optimizer` (any factory; Adam/AdamW run
their ``foreach`` implementation) and, for ``param_collection: official`` / ``ebats``,
:class:`RepeatedAdam`, which applies a reference's parameter list with its repeated tensors
exactly (as torch's foreach or, ``ebats``, its per-tensor loop runs such a list)."""
from functools import partial
from typing import Callable, Optional

import torch

from tta_brain.gpu.guard import where_
from tta_brain.methods.params import Selection, param_groups

__all__ = ["build_optimizer", "RepeatedAdam", "official_optimizer"]


def build_optimizer(factory: Optional[Callable], selected, lr: float):
    """``factory(param_groups)`` (default AdamW, no weight decay); an Adam/AdamW built with
    ``foreach=None`` runs its ``foreach`` implementation (PyTorch's GPU default; on CPU the same
    numbers as the per-tensor loop, with less Python overhead). A selection with
    ``param_collection: official`` (or ``ebats``) gets that reference's list (:class:`RepeatedAdam`
    over the repeated CNN tensors, with the factory's class and hyperparameters)."""
    if not selected:
        return None
    if getattr(selected, "collection", "clean") in ("official", "ebats"):
        return official_optimizer(factory, selected, lr)
    opt = (factory or partial(torch.optim.AdamW, weight_decay=0.0))(param_groups(selected, lr))
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        for group in opt.param_groups:
            if (group.get("foreach") is None and not group.get("fused")
                    and not group.get("differentiable")):
                group["foreach"] = True
        if opt.defaults.get("foreach") is None and not opt.defaults.get("fused"):
            opt.defaults["foreach"] = True
    return opt


class RepeatedAdam(torch.optim.Adam):
    """Adam / AdamW over a parameter list in which a tensor may appear ``k`` times, computed
    exactly as ``torch.optim.Adam(W)(..., foreach=True)`` computes it on a list that really holds
    the repeats (``torch._multi_tensor_adam``, torch 2.11), without putting a tensor into torch's
    list twice. Each param group holds unique tensors and ``repeats`` (``k`` per tensor).

    torch keeps one state per tensor; its multi-tensor step applies each operation to the whole
    list in turn, so per step a tensor repeated ``k`` times gets: ``step += 1`` k times; (AdamW
    weight decay ``p *= 1 - lr wd`` k times); ``m = lerp(m, g, 1 - beta1)`` k times; ``v *= beta2``
    k times, then ``v += (1 - beta2) g^2`` k times; then ``k`` updates ``p -= lr / (1 - beta1^s) *
    m / (sqrt(v) / sqrt(1 - beta2^s) + eps)``, all with the final ``m``, ``v`` and ``s``. Here
    every operation is applied ``k`` times in sequence to the unique tensors (the same float
    operations in the same order: bit-identical to torch's foreach on CPU) and deterministic on
    every device, where torch's CUDA foreach kernels would update a repeated tensor from several
    thread blocks at once. torch's per-tensor loop (``foreach=False``, torch's CPU default) gives
    other numbers for a repeated tensor: k complete Adam steps one after the other. That is
    ``sequential=True`` (``param_collection: ebats``: the E-BATS reference runs its AdamW with
    ``foreach=False``): pass r = 1..max(k) is one complete Adam step of the tensors that appear
    at least r times (each tensor's own steps in order; torch's loop interleaves other tensors'
    steps between them, which changes nothing: a tensor's update reads only its own state).

    Only the official code's settings are supported: no amsgrad, maximize, capturable,
    differentiable or fused; a float lr.

    **On the device** (:meth:`to_device`, what the device step and its captured graphs run, as
    torch's fused, capturable AdamW for a clean list): the same operations with the step counts
    on the parameters' device (float32) and the bias corrections computed there from them (in
    float64, as the host computes them, then rounded to float32 as the kernels round the host's
    scalars), so a step reads nothing on the host; a step whose ``found_inf`` attribute (the
    device guard's flag, ``tta_brain.gpu.guard.guarded_update``) is 1 leaves parameters, moments
    and step counts unchanged. The same update as the host path to rounding.
    """

    def __init__(self, params, sequential: bool = False, **kwargs):
        for key in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
            if kwargs.get(key):
                raise ValueError(f"RepeatedAdam (param_collection: official, ebats) does not support "
                                 f"{key}=True")
        kwargs["foreach"] = True
        kwargs.pop("fused", None)
        super().__init__(params, **kwargs)
        self.sequential = bool(sequential)

    def add_param_group(self, param_group) -> None:
        """torch's, plus the group's ``repeats`` (1 per tensor where it gives none) checked: also
        for a group added after construction (torch's constructor adds its groups here)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        reps = group.setdefault("repeats", [1] * len(group["params"]))
        if len(reps) != len(group["params"]) or any(int(k) < 1 for k in reps):
            self.param_groups.pop()
            raise ValueError("RepeatedAdam: every param group needs one repeat count >= 1 "
                             "per tensor")
        if torch.is_tensor(group["lr"]):
            self.param_groups.pop()
            raise ValueError("RepeatedAdam: the lr must be a float")

    @property
    def on_device(self) -> bool:
        """Whether the steps run on the device (:meth:`to_device`)."""
        return all(g["capturable"] for g in self.param_groups)

    @torch.no_grad()
    def to_device(self) -> None:
        """Run the steps on the parameters' device from now on (see the class docstring): the
        step counts move there (float32), new states are created there; moments untouched."""
        for g in self.param_groups:
            g["capturable"] = True
            for p in g["params"]:
                st = self.state.get(p)
                step = st.get("step") if st else None
                if torch.is_tensor(step) and (step.device != p.device
                                              or step.dtype != torch.float32):
                    st["step"] = step.to(device=p.device, dtype=torch.float32)
        self.defaults["capturable"] = True

    def _kept(self, slot, tensors):
        """Scratch copies of ``tensors`` (group and device ``slot``'s parameters and moments) for a
        guarded device step: one flat buffer (their concatenation, which the restore selects
        from in one ``where``) and its views shaped like them, made once and kept, so a captured
        step writes the same memory on every replay; made anew only when the state tensors are
        replaced (which drops the captured steps too: their signature holds the state's
        addresses)."""
        store = self.__dict__.setdefault("_scratch", {})
        ptrs = tuple(t.data_ptr() for t in tensors)
        if slot not in store or store[slot][0] != ptrs:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                               device=tensors[0].device)
            views = [v.view(t.shape) for v, t in
                     zip(flat.split([t.numel() for t in tensors]), tensors)]
            store[slot] = (ptrs, (flat, views))
        return store[slot][1]

    def _segments(self, slot, params):
        """:func:`segment_index` of group and device ``slot``'s parameters, made once per list of
        sizes (the device update's gather reads it)."""
        store = self.__dict__.setdefault("_scratch", {})
        sizes = tuple(p.numel() for p in params)
        if store.get(("segments", slot), (None,))[0] != sizes:
            store[("segments", slot)] = (sizes, segment_index(params))
        return store[("segments", slot)][1]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for gi, group in enumerate(self.param_groups):
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
            if not params:
                continue
            rep = {id(p): int(k) for p, k in zip(group["params"], group["repeats"])}
            ks = [rep[id(p)] for p in params]
            grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype(
                [params, grads, exp_avgs, exp_avg_sqs, steps], with_indices=True)
            for key, ((d_params, d_grads, d_m, d_v, d_steps), indices) in grouped.items():
                d_ks = [ks[i] for i in indices]
                if group["capturable"]:
                    kept = (None if found_inf is None else
                            self._kept((gi, key), d_params + d_m + d_v))
                    segments = (lambda r, ps, key=key, gi=gi: self._segments((gi, key, r), ps))
                    _repeated_adam_device_update(d_params, d_grads, d_m, d_v, d_steps, d_ks,
                                                 group, segments, found_inf, kept,
                                                 self.sequential)
                elif self.sequential:
                    for lists in _times(d_ks)(d_params, d_grads, d_m, d_v, d_steps):
                        _repeated_adam_update(*lists, [1] * len(lists[0]), group)
                else:
                    _repeated_adam_update(d_params, d_grads, d_m, d_v, d_steps, d_ks, group)
        return loss


def segment_index(tensors) -> torch.Tensor:
    """Each element of the tensors' concatenation -> its tensor's index (int32, on their
    device), so one gather spreads per-tensor values over every element."""
    return torch.cat([torch.full((t.numel(),), i, dtype=torch.int32, device=t.device)
                      for i, t in enumerate(tensors)])


def _times(ks):
    """For r = 0..max(ks)-1, a function that keeps, of parallel lists, the entries whose tensor
    appears more than r times."""
    def times(*lists):
        for r in range(max(ks)):
            keep = [i for i, k in enumerate(ks) if k > r]
            yield [[lst[i] for i in keep] for lst in lists]
    return times


def _moments(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group) -> None:
    """The counts, the weight decay and the moments: each list operation ``k`` times in turn."""
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    times = _times(ks)
    one = torch.tensor(1.0, device="cpu")
    for (s,) in times(steps):
        if s[0].is_cpu:
            torch._foreach_add_(s, one, alpha=1.0)
        else:
            torch._foreach_add_(s, 1)
    if wd != 0:
        if group["decoupled_weight_decay"]:
            for (p,) in times(params):
                torch._foreach_mul_(p, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, params, alpha=wd)
    for m, g in times(exp_avgs, grads):
        torch._foreach_lerp_(m, g, 1 - beta1)
    for (v,) in times(exp_avg_sqs):
        torch._foreach_mul_(v, beta2)
    for v, g in times(exp_avg_sqs, grads):
        torch._foreach_addcmul_(v, g, g, 1 - beta2)


def _repeated_adam_update(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group):
    """``torch._multi_tensor_adam`` (non-capturable path) on the list in which tensor ``i``
    appears ``ks[i]`` times, one list operation at a time."""
    beta1, beta2 = group["betas"]
    lr, eps = group["lr"], group["eps"]
    times = _times(ks)
    _moments(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group)
    values = [float(s) for s in steps]
    step_size = [(lr / (1 - beta1 ** s)) * -1 for s in values]
    bias_correction2_sqrt = [(1 - beta2 ** s) ** 0.5 for s in values]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    for p, m, d, ss in times(params, exp_avgs, denom, step_size):
        torch._foreach_addcdiv_(p, m, d, ss)


def _repeated_adam_device_update(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group,
                                 segments, found_inf=None, kept=None, sequential=False):
    """:func:`_repeated_adam_update` with nothing read on the host (capturable): the counts are
    device tensors and the bias corrections are computed from them on the device, in float64
    and then rounded to float32 (as the host's Python floats are, by the kernels); with
    ``found_inf`` (a 0-d device tensor) 1, parameters, moments and counts are left as they were
    (the fused AdamW's skip, which the device guard relies on), restored from ``kept`` (a flat
    buffer and its views shaped like parameters and moments, in that order, kept across steps so
    a captured step writes the same memory) by one selection over all of them
    (:func:`~tta_brain.gpu.guard.where_`: a few kernels, not three a tensor). ``segments(r,
    tensors)``: :func:`segment_index` of ``tensors`` (kept by the optimiser; ``r``: the pass).
    ``sequential``: pass r of :class:`RepeatedAdam`'s sequential mode on the tensors that appear
    at least r times, the restore over all of them after the last."""
    state = [*params, *exp_avgs, *exp_avg_sqs]
    if found_inf is not None:
        kept_flat, kept_views = kept
        torch._foreach_copy_(kept_views, state)
    if sequential:
        for r, lists in enumerate(_times(ks)(params, grads, exp_avgs, exp_avg_sqs, steps)):
            _device_adam(*lists, [1] * len(lists[0]), group, segments(r, lists[0]))
    else:
        _device_adam(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group, segments(0, params))
    if found_inf is not None:
        where_(found_inf.reshape(()) != 0, state, kept_flat)
        torch._foreach_sub_(steps, torch._foreach_mul([found_inf.reshape(())] * len(ks), ks))


def _device_adam(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group, segments):
    """The counts, moments and updates of :func:`_repeated_adam_device_update`."""
    beta1, beta2 = group["betas"]
    lr, eps = group["lr"], group["eps"]
    times = _times(ks)
    _moments(params, grads, exp_avgs, exp_avg_sqs, steps, ks, group)
    counts = torch.stack(steps).to(torch.float64)
    step_size = ((lr / (1 - torch.pow(beta1, counts))) * -1).to(torch.float32)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, counts)).to(torch.float32)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    # each tensor's divisor spread over its elements: one multi-tensor division (the same
    # divisions as by one 0-d tensor a tensor, which take a kernel a tensor)
    spread = bias_correction2_sqrt.index_select(0, segments)    # segment_index(params)
    torch._foreach_div_(denom, [v.view_as(d) for v, d in
                                zip(spread.split([d.numel() for d in denom]), denom)])
    torch._foreach_add_(denom, eps)
    # the host's addcdiv p + s m / d with a device scalar s, in the order its kernel rounds:
    # (s m) / d on CPU, s (m / d) on CUDA (one increment, added k times as the host adds it)
    step_size = list(step_size.unbind())
    if params[0].is_cpu:
        increment = torch._foreach_mul(exp_avgs, step_size)
        torch._foreach_div_(increment, denom)
        for p, inc in times(params, increment):
            torch._foreach_add_(p, inc)
    else:
        quotient = torch._foreach_div(exp_avgs, denom)
        for p, q, ss in times(params, quotient, step_size):
            torch._foreach_addcmul_(p, q, ss)


def official_optimizer(factory, selected: Selection, lr: float) -> RepeatedAdam:
    """The optimiser of ``param_collection: official`` (and ``ebats``): ``factory`` (default
    AdamW, no weight decay) decides the class and hyperparameters; it must build an Adam or AdamW
    (the official code's optimiser), which is then run as :class:`RepeatedAdam` over the official
    list (``ebats``: its list, its steps one after the other)."""
    groups = param_groups(selected, lr)
    probe = (factory or partial(torch.optim.AdamW, weight_decay=0.0))(
        [{k: v for k, v in g.items() if k != "repeats"} for g in groups])
    if not isinstance(probe, torch.optim.Adam):
        raise ValueError(f"param_collection: {selected.collection} reproduces the reference "
                         f"code's Adam/AdamW; "
                         f"the optimizer factory built {type(probe).__name__}")
    defaults = dict(probe.defaults)
    defaults.setdefault("decoupled_weight_decay", isinstance(probe, torch.optim.AdamW))
    for g, pg in zip(groups, probe.param_groups):
        g["lr"] = pg["lr"]
    keep = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "capturable",
            "differentiable", "fused", "decoupled_weight_decay")
    return RepeatedAdam(groups, sequential=selected.collection == "ebats",
                        **{k: defaults[k] for k in keep if k in defaults})
