"""Adaptation steps on the device (CUDA; ``Runtime.cuda_device_steps``, ``Runtime.cuda_graphs``): the
finiteness guard without host syncs, and the steps replayed from a captured CUDA graph
(``tta_brain.gpu.graphs``).

With either option on, the skeleton's ``adapt_step`` of a method whose loss runs on the device
alone (the SUTA family: suta, csuta, dsuta; :func:`blocker`) goes through :class:`DeviceSteps`;
otherwise (the default, CPU, and the other methods everywhere) the host path runs as before.

* **No host sync inside a step.** The host path (CPU, and the other methods everywhere) reads the
  loss and the gradient norms on the host to skip a non-finite step. Here the check runs on the
  device: :meth:`tta_brain.lobes.runtime.Runtime.backward_guarded` sets a float flag ``found_inf`` (the
  loss or a gradient is not finite) in the kernel that also unscales the gradients (GradScaler's
  ``_amp_foreach_non_finite_check_and_unscale_``), and the optimiser is torch's *fused* Adam/AdamW
  (``fused=True, capturable=True``: its step counts live on the device), which skips the update
  when ``found_inf`` is 1: parameters, moments and step counts are left unchanged (the fused
  step adds 1 to the counts and subtracts ``found_inf`` again). Per utterance the flags are added
  up on the device (skipped steps, of which non-finite loss, of which a step whose
  ``after_backward`` hook ran: DSUTA's first-step gradient, zeroed before the hook on a skipped
  step) and read once, with the transcript's labels, by ``predict`` (one device-to-host copy).
Everything here is device-agnostic (tests run it on CPU tensors, with a fake graph backend).
"""
import logging
from contextlib import nullcontext
from typing import List, Optional, Tuple

import torch

from tta_brain.gpu.graphs import FIRST_WARMUP, CapturedStep, CudaGraphBackend, GraphCache

logger = logging.getLogger(__name__)

__all__ = ["DeviceSteps", "StepFlags", "device_optimizer_blocker", "to_device_optimizer",
           "is_device_optimizer", "blocker", "steps_for", "skipped"]

#: Slots of the per-utterance counters on the device.
SKIPPED, LOSS_NONFINITE, HOOKED = 0, 1, 2


# ------------------------------------------------------------------------------ optimiser
def device_optimizer_blocker(opt) -> Optional[str]:
    """Why ``opt`` cannot be run as a fused, capturable Adam/AdamW (None: it can)."""
    if opt is None:
        return "no optimiser"
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
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
    return all(g.get("fused") and g.get("capturable") for g in opt.param_groups)


@torch.no_grad()
def to_device_optimizer(opt) -> None:
    """Run ``opt`` (torch's Adam/AdamW, see :func:`device_optimizer_blocker`) as its fused,
    capturable implementation, in place: the step counts move to the parameters' device (float32,
    as the fused kernels keep them); moments are untouched. The update is the same Adam/AdamW up
    to rounding (the CPU's ``foreach`` path computes the bias corrections on the host)."""
    for g in opt.param_groups:
        g["fused"], g["foreach"], g["capturable"] = True, False, True
        for p in g["params"]:
            st = opt.state.get(p)
            step = st.get("step") if st else None
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                st["step"] = step.to(device=p.device, dtype=torch.float32)
    opt.defaults.update(fused=True, foreach=False, capturable=True)
    opt._step_supports_amp_scaling = True
    # capturable=True is what a capture requires; the fused kernels do not depend on it, so
    # torch's warning about running a capturable optimiser uncaptured does not apply
    opt._warned_capturable_if_run_uncaptured = True


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

    def note_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.loss.copy_(loss)
        self.acct[LOSS_NONFINITE].add_(torch.logical_not(torch.isfinite(loss)))

    def note_step(self, hooked: bool) -> None:
        self.acct[SKIPPED].add_(self.found)
        if hooked:
            self.acct[HOOKED].add_(self.found)

    def fetch(self, labels: Optional[torch.Tensor] = None):
        """(labels on the host or None, [skipped, non-finite loss, hooked]) with ONE device-to-host
        copy; the counters are zeroed (asynchronously) for the next utterance."""
        acct = self.acct.to(torch.int64)
        if labels is None:
            counts, host = acct.cpu().tolist(), None
        else:
            packed = torch.cat([labels.reshape(-1).to(torch.int64), acct]).cpu()
            n = labels.numel()
            host, counts = packed[:n].view(labels.shape), packed[n:].tolist()
        self.acct.zero_()
        self.pending = False
        return host, counts


# ------------------------------------------------------------------------------ the steps
class DeviceSteps:
    """A method's adaptation steps with the device-side guard, eager or captured.

    ``backend``: None (eager only), a :class:`CudaGraphBackend`, or a test double with
    ``side()``, ``capture(body, pool)`` (returning an object with ``replay``, ``pool``,
    ``release``).
    """

    def __init__(self, method, backend=None, capacity: int = 1, warmup: int = 1):
        self.m = method
        self.device = method.params[0].device
        self.flags = StepFlags(self.device, method.runtime.scale)
        self.backend = backend
        self.cache = GraphCache(capacity)
        self.warmup = max(1, int(warmup))
        self.captured_once = False
        self._x = None
        self._calls = self._eager = 0
        self._entry = None
        self.stats = {"eager": 0, "replays": 0}

    @property
    def graphs(self) -> bool:
        return self.backend is not None

    def disable_graphs(self, why: str) -> None:
        if self.backend is not None:
            logger.warning("%s: CUDA graphs off from now on (%s); the steps run eagerly",
                           self.m.name, why)
        self.release()
        self.backend = None

    def release(self) -> None:
        """Drop the captured graphs (their pool goes back to the allocator)."""
        self.cache.clear()
        self._entry = None

    # ------------------------------------------------------------------ one step
    def step(self, x: torch.Tensor, optimizer, loss_fn=None, after_backward=None):
        """One guarded step on ``x``; returns its loss as a device tensor (no sync)."""
        m = self.m
        if x is not self._x:                  # a new utterance (its steps share the input tensor)
            self._x, self._calls, self._eager, self._entry = x, 0, 0, None
        self._calls += 1
        self.flags.pending = True
        if (self.backend is None or loss_fn is not None or after_backward is not None
                or m.train_mode):
            return self._eager_step(x, optimizer, loss_fn, after_backward)
        feats = m.features.get(x)             # cached CNN features (None: off), outside the graph
        src = x if feats is None else feats
        entry = self._entry or self._cached(optimizer, src, feats is not None)
        if entry is None:
            remaining = m.steps - self._calls + 1
            if (self._eager < self.warmup or self.stats["eager"] < FIRST_WARMUP
                    or remaining < 2):
                return self._eager_step(x, optimizer, None, None)
            entry = self._capture(optimizer, src, feats is not None)
            if entry is None:                  # capture failed: graphs are off, eager step
                return self._eager_step(x, optimizer, None, None)
        self._entry = entry
        entry.load(src)
        entry.replay()
        m.counts["adapt_forward"] += 1
        m.counts["adapt_backward"] += 1
        self.stats["replays"] += 1
        return self.flags.loss.clone()

    def _eager_step(self, x, optimizer, loss_fn, after_backward):
        m = self.m
        self._eager += 1
        self.stats["eager"] += 1
        with (self.backend.side() if self.backend is not None else nullcontext()):
            loss = m.step_loss(x, optimizer, loss_fn)
            self._update(loss, optimizer, after_backward)
            m.counts["adapt_backward"] += 1
            return loss.detach()

    def _update(self, loss, optimizer, after_backward=None) -> None:
        """Guarded backward, the hook, the fused update: device work only (captured as is)."""
        m, f = self.m, self.flags
        f.note_loss(loss)
        grads = m.runtime.backward_guarded(loss, m.params, self.device, f.found, f.inv_scale)
        if after_backward is not None:
            if grads:                         # a skipped step hands the hook zero gradients
                bad = f.found.bool()
                for g in grads:
                    g.masked_fill_(bad, 0.0)
            after_backward()
        f.note_step(after_backward is not None)
        optimizer.found_inf = f.found
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf

    # ------------------------------------------------------------------ graphs
    def _key(self, optimizer, src, features):
        return (id(optimizer), features, tuple(src.shape), src.dtype)

    def signature(self, optimizer):
        """Addresses of everything a captured step reads or writes outside its scratch memory,
        and the hyperparameters baked into it."""
        sig = [self.m.net.training]
        for p in self.m.params:
            sig += [p.data_ptr(), p.grad.data_ptr() if p.grad is not None else 0]
        for g in optimizer.param_groups:
            sig.append(tuple((k, v) for k, v in sorted(g.items())
                             if k not in ("params", "repeats") and not torch.is_tensor(v)
                             and isinstance(v, (int, float, bool, str, tuple, type(None)))))
            for p in g["params"]:
                st = optimizer.state.get(p, {})
                sig += [(k, st[k].data_ptr() if torch.is_tensor(st[k]) else st[k])
                        for k in sorted(st)]
        sig += [t.data_ptr() for t in self.flags.tensors()]
        return tuple(sig)

    def _cached(self, optimizer, src, features):
        key = self._key(optimizer, src, features)
        entry = self.cache.get(key)
        if entry is not None and entry.signature != self.signature(optimizer):
            logger.info("%s: parameters, optimiser state or settings were replaced; the captured "
                        "steps are dropped", self.m.name)
            self.release()
            entry = None
        return entry

    def _capture(self, optimizer, src, features):
        m = self.m
        missing = [i for i, p in enumerate(m.params) if p.grad is None]
        key = self._key(optimizer, src, features)
        entry = CapturedStep(key, torch.empty_like(src), features, None)
        entry.load(src)

        def body():
            optimizer.zero_grad(set_to_none=False)
            if features:
                logits = m.lobe.logits(None, None, entry.static)
            else:
                logits = m.lobe.logits(entry.static)
            self._update(m.loss(logits), optimizer)

        try:
            entry.graph = self.backend.capture(body, self.cache.pool())
        except Exception as e:                 # noqa: BLE001 - any capture error: eager from now on
            self.disable_graphs(f"capture failed: {type(e).__name__}: {e}")
            return None
        if [i for i, p in enumerate(m.params) if p.grad is None] != missing:
            entry.release()                    # a gradient was allocated inside the capture
            self.disable_graphs("a gradient was first allocated during the capture")
            return None
        entry.signature = self.signature(optimizer)
        self.cache.put(key, entry)
        self.captured_once = True
        return entry


# ------------------------------------------------------------------------------ a method's steps
def blocker(m, skeleton) -> Optional[str]:
    """Why method ``m``'s steps cannot take the device path (None: they can): its loss and steps
    must be the ``skeleton`` class's (the SUTA family: suta, csuta, dsuta) or declared device-only
    (``device_loss``); SGEM, SDPL and AWMC compute their losses with host work (beam search,
    pseudo labels) and keep the eager host path."""
    cls, TTAMethod = type(m), skeleton
    if not m.params:
        return "nothing adapts"
    if m.device_loss is False:
        return "its loss needs host work"
    if m.device_loss is None and (
            cls.loss is not TTAMethod.loss or cls.before_step is not TTAMethod.before_step
            or cls.forward_and_adapt is not TTAMethod.forward_and_adapt):
        return "its loss or its steps need host work (only the SUTA family's run on the device)"
    return device_optimizer_blocker(m.optimizer) or next(
        (f"{why} ({attr})" for attr in m._device_optimizer_names()
         if (why := device_optimizer_blocker(getattr(m, attr)))), None)


def steps_for(m, optimizer) -> Optional[DeviceSteps]:
    """Method ``m``'s :class:`DeviceSteps` for a step with ``optimizer``, or None for the host
    path (``cuda_graphs`` off, CPU, a method with host work in its loss, another optimiser)."""
    steps = m.__dict__.get("_device_steps")
    if steps is None:
        steps = m.__dict__["_device_steps"] = _make(m) or False
    if steps is False or optimizer is not m.optimizer:
        return None
    for opt in [optimizer] + [getattr(m, a) for a in m._device_optimizer_names()]:
        if not is_device_optimizer(opt):          # first step, or a state loaded since
            to_device_optimizer(opt)
    return steps


def _make(m) -> Optional[DeviceSteps]:
    rt = m.runtime
    device = m.params[0].device if m.params else m.lobe.device
    forced = m.__dict__.get("_force_device_steps")          # tests: the device path on CPU
    if not rt.cuda_device_steps or (device.type != "cuda" and not forced):
        if rt.cuda_device_steps:
            logger.info("%s: cuda_device_steps / cuda_graphs have no effect on %s", m.name, device)
        return None
    why = m.device_step_blocker()
    if why:
        logger.warning("%s: cuda_device_steps / cuda_graphs do not apply: %s; the steps keep the "
                       "host check on %s", m.name, why, device)
        return None
    backend, double = None, m.__dict__.get("_graph_backend")    # double: tests on CPU
    no_graph = ("cuda_graphs is off" if not rt.cuda_graphs else
                f"precision {rt.precision} (fp32 only)" if rt.dtype is not None else
                "compile is on" if rt.compile else
                "train_mode" if m.train_mode else
                "not on CUDA" if device.type != "cuda" and double is None else None)
    if no_graph is None:
        backend = double or CudaGraphBackend(device)
    elif rt.cuda_graphs:
        logger.warning("%s: no CUDA graphs (%s); the steps run eagerly with the device-side "
                       "check", m.name, no_graph)
    logger.info("%s: adaptation steps on %s with the device-side check and fused %s%s",
                m.name, device, type(m.optimizer).__name__,
                ", captured as CUDA graphs" if backend is not None else "")
    return DeviceSteps(m, backend, rt.cuda_graph_cache, rt.cuda_graph_warmup)


def skipped(counts) -> Tuple[List[str], int]:
    """The reasons of an utterance's skipped steps (from the counters read once by ``predict``)
    and how many of them had run an ``after_backward`` hook."""
    n, bad_loss, hooked = (int(c) for c in counts)
    return ["non-finite loss"] * bad_loss + ["non-finite gradient"] * (n - bad_loss), hooked
