"""The device-side guard of an adaptation step (no host sync): torch's fused, capturable
Adam/AdamW skips a step whose ``found_inf`` flag is 1, and :class:`StepFlags` adds the flags up per
utterance on the device, read once with the transcript.

The check itself is :meth:`tta_brain.lobes.runtime.Runtime.backward_guarded`: it sets the float
flag ``found_inf`` (the loss or a gradient is not finite) in the kernel that also unscales the
gradients (GradScaler's ``_amp_foreach_non_finite_check_and_unscale_``). The fused optimiser
(``fused=True, capturable=True``: its step counts live on the device) then leaves parameters,
moments and step counts unchanged (the fused step adds 1 to the counts and subtracts
``found_inf`` again). Per utterance the flags are added up on the device (skipped steps, of which
non-finite loss, of which a step whose ``after_backward`` hook ran) and read once, with the
transcript's labels (one device-to-host copy). Device-agnostic: the tests run it on CPU tensors.
"""
import warnings
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["StepFlags", "StepFilter", "DeviceHook", "device_optimizer_blocker",
           "to_device_optimizer", "is_device_optimizer", "guarded_update", "where_", "skipped"]

#: Slots of the per-utterance counters on the device.
SKIPPED, LOSS_NONFINITE, HOOKED = 0, 1, 2


class DeviceHook:
    """An ``after_backward`` hook whose device work can be captured with the step (DSUTA's slow
    gradient): ``device()`` reads the gradients and writes only tensors that stay in place
    (``tensors()``, whose addresses a captured graph is checked against), ``host()`` is its host
    bookkeeping, run after every step that ran ``device()`` (eager or replayed). Called as a plain
    hook it runs both (the host step)."""

    def __init__(self, device, host, tensors):
        self.device, self.host, self.tensors = device, host, tensors

    def __call__(self):
        self.device()
        self.host()


# ------------------------------------------------------------------------------ optimiser
def _repeated(opt) -> bool:
    """``param_collection: official``'s / ``ebats``' optimiser (``methods.optim.RepeatedAdam``), which runs
    on the device by its own ``to_device`` (not torch's fused kernels)."""
    return callable(getattr(opt, "to_device", None)) and hasattr(opt, "on_device")


def device_optimizer_blocker(opt) -> Optional[str]:
    """Why ``opt`` cannot be run as a fused, capturable Adam/AdamW, or as ``RepeatedAdam`` on the
    device (None: it can)."""
    if opt is None:
        return "no optimiser"
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) and not _repeated(opt):
        return f"the optimiser is {type(opt).__name__}, not torch's Adam/AdamW"
    for g in opt.param_groups:
        if g.get("differentiable"):
            return "a differentiable optimiser"
        if torch.is_tensor(g["lr"]) or any(torch.is_tensor(b) for b in g["betas"]):
            return "a tensor lr or betas"
        for p in g["params"]:
            if not torch.is_floating_point(p) or p.is_sparse:
                return "a parameter that is not a dense floating-point tensor"
    return None


def is_device_optimizer(opt) -> bool:
    if _repeated(opt):
        return opt.on_device
    return all(g.get("fused") and g.get("capturable") for g in opt.param_groups)


@torch.no_grad()
def to_device_optimizer(opt) -> None:
    """Run ``opt`` (torch's Adam/AdamW, see :func:`device_optimizer_blocker`) as its fused,
    capturable implementation, in place: the step counts move to the parameters' device (float32,
    as the fused kernels keep them); moments are untouched. The update is the same Adam/AdamW up
    to rounding (the CPU's ``foreach`` path computes the bias corrections on the host).
    ``RepeatedAdam`` runs its own device update instead (``RepeatedAdam.to_device``)."""
    if _repeated(opt):
        opt.to_device()
        return
    for g in opt.param_groups:
        g["fused"], g["foreach"], g["capturable"] = True, False, True
        for p in g["params"]:
            st = opt.state.get(p)
            step = st.get("step") if st else None
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                st["step"] = step.to(device=p.device, dtype=torch.float32)
    opt.defaults.update(fused=True, foreach=False, capturable=True)


def guarded_update(opt, found_inf: torch.Tensor) -> None:
    """``opt.step()`` skipped on the device when ``found_inf`` is 1 (the GradScaler protocol's
    ``found_inf`` attribute, which the fused kernels read). capturable=True is what a capture
    requires and the fused kernels do not depend on it, so torch's warning about running a
    capturable optimiser uncaptured does not apply to the eager steps."""
    opt.found_inf = found_inf
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNCAPTURED_WARNING)
            opt.step()
    finally:
        del opt.found_inf


_UNCAPTURED_WARNING = "This instance was constructed with capturable=True"


@torch.no_grad()
def where_(cond: torch.Tensor, tensors: Sequence[torch.Tensor], other=0.0) -> None:
    """In place, every ``tensors[i]`` becomes ``other``'s value where the 0-d bool tensor ``cond``
    is true and stays as it is where it is false, with a few kernels in all instead of one a
    tensor: one ``torch.where`` over the concatenation of the tensors of each device and dtype,
    one ``foreach`` copy back. ``other``: a number, or a 1-d tensor holding the values in the
    tensors' order (their concatenation: one device and dtype). Exact: a selection and copies.
    Device work only (no host read), so a captured step can run it (a guarded step's restore)."""
    if not tensors:
        return
    groups = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    if torch.is_tensor(other) and len(groups) > 1:
        raise ValueError("where_: a flat `other` needs tensors of one device and dtype")
    for ts in groups.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        if torch.is_tensor(other):
            torch.where(cond, other, flat, out=flat)
        else:
            flat.masked_fill_(cond, other)
        torch._foreach_copy_(ts, [v.view_as(t) for v, t in
                                  zip(flat.split([t.numel() for t in ts]), ts)])


# ------------------------------------------------------------------------------ flags
class StepFlags:
    """The device-side bookkeeping of the guarded steps (all tensors allocated once, outside any
    capture, so a captured step reads and writes the same memory on every replay).

    ``found``: 1.0 when the running step is skipped; ``acct``: per-utterance sums (skipped,
    of which non-finite loss, of which hooked); ``loss``: the last step's loss; ``inv_scale``:
    ``1 / loss scale``.
    """

    def __init__(self, device, scale: float = 1.0):
        f32 = dict(dtype=torch.float32, device=device)
        self.found = torch.zeros((), **f32)
        self.acct = torch.zeros(3, **f32)
        self.loss = torch.zeros((), **f32)
        self.inv_scale = torch.full((), 1.0 / scale, **f32)
        self.pending = False           # steps recorded since the last fetch (host-side)

    def tensors(self) -> List[torch.Tensor]:
        return [self.found, self.acct, self.loss, self.inv_scale]

    def note_loss(self, loss: torch.Tensor, keep: Optional[torch.Tensor] = None) -> None:
        """``keep``: 0.0 when the method's filter drops this step (``StepFilter``), which the
        host step would not have checked for finiteness, so it is not counted as non-finite."""
        loss = loss.detach()
        self.loss.copy_(loss)
        bad = torch.logical_not(torch.isfinite(loss))
        self.acct[LOSS_NONFINITE].add_(bad if keep is None else bad * keep)

    def note_step(self, hooked: bool, keep: Optional[torch.Tensor] = None) -> None:
        found = self.found if keep is None else self.found * keep
        self.acct[SKIPPED].add_(found)
        if hooked:
            self.acct[HOOKED].add_(found)

    def fetch(self, labels: Optional[torch.Tensor] = None, extra: Optional[torch.Tensor] = None):
        """(labels on the host or None, [skipped, non-finite loss, hooked], ``extra`` on the host
        as a list of floats or None) with ONE device-to-host copy; the counters are zeroed
        (asynchronously) for the next utterance. ``extra`` (a method's filter rows) travels as
        float64 in the same copy, the labels and counters with it (exact: small integers)."""
        parts = [] if labels is None else [labels.reshape(-1)]
        parts.append(self.acct)
        if extra is not None:
            parts.append(extra.reshape(-1))
        dtype = torch.int64 if extra is None else torch.float64
        packed = torch.cat([t.to(dtype) for t in parts]).cpu()
        n = 0 if labels is None else labels.numel()
        host = None if labels is None else packed[:n].view(labels.shape).to(torch.int64)
        counts = packed[n:n + len(self.acct)].to(torch.int64).tolist()
        rest = None if extra is None else packed[n + len(self.acct):].tolist()
        self.acct.zero_()
        self.pending = False
        return host, counts, rest


class StepFilter:
    """A method's filter of its own steps, decided on the device (EATA's sample filter): the
    method's loss calls :meth:`note` once per step with ``drop`` (a 0-d bool tensor: this step
    must not update) and ``values`` (floats that say why, for the record). Nothing is read on the
    host there, so the step can be captured.

    The host step reads the row at once (:meth:`take`) and skips the backward of a dropped step;
    the device step runs the backward, skips the update as it skips a non-finite one (``gate``
    merged into ``found_inf``), and reads the utterance's rows once, with the transcript
    (:meth:`packed` in :meth:`StepFlags.fetch`). Rows (float64): ``[drop, *values]``, one per
    step, at most ``steps`` an utterance (``at``, on the device, counts them).
    """

    def __init__(self, device, steps: int, width: int):
        self.gate = torch.zeros((), dtype=torch.float32, device=device)
        # float64: float32 values and a float64 one (SAR's loss EMA) travel exactly
        self.rows = torch.zeros(max(1, int(steps)), 1 + int(width), dtype=torch.float64,
                                device=device)
        self.at = torch.zeros((), dtype=torch.int64, device=device)

    def tensors(self) -> List[torch.Tensor]:
        return [self.gate, self.rows, self.at]

    def note(self, drop: torch.Tensor, values: torch.Tensor) -> None:
        self.gate.copy_(drop)
        row = torch.cat([drop.reshape(1).to(self.rows.dtype), values.reshape(-1).to(self.rows.dtype)])
        at = self.at.clamp(max=len(self.rows) - 1).reshape(1)
        self.rows.index_copy_(0, at, row[None])
        self.at.add_(1)

    def packed(self) -> torch.Tensor:
        """The count and the rows, one flat tensor for the transcript's copy."""
        return torch.cat([self.at.reshape(1).to(self.rows.dtype), self.rows.reshape(-1)])

    def unpack(self, values: List[float]) -> List[List[float]]:
        """The rows noted since the last read (from :meth:`packed` on the host); starts again."""
        self.at.zero_()
        n, w = min(int(values[0]), len(self.rows)), self.rows.shape[1]
        return [values[1 + i * w: 1 + (i + 1) * w] for i in range(n)]

    def take(self) -> List[List[float]]:
        """The host step's read: the rows noted since the last read (one host read)."""
        return self.unpack(self.packed().tolist())



def skipped(counts) -> Tuple[List[str], int]:
    """The reasons of an utterance's skipped steps (from the counters read once by ``predict``)
    and how many of them had run an ``after_backward`` hook."""
    n, bad_loss, hooked = (int(c) for c in counts)
    return ["non-finite loss"] * bad_loss + ["non-finite gradient"] * (n - bad_loss), hooked
