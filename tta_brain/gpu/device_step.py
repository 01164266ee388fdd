"""The device step (CUDA; chosen by ``tta_brain.gpu.make_step``): the adaptation step with the
finiteness guard on the device (``tta_brain.gpu.guard``: no host sync inside a step), eager or
replayed from a captured CUDA graph (``tta_brain.gpu.graphs``).

A method's step returns its loss as a device tensor; skipped steps are counted on the device and
read once per utterance, with the transcript's labels, by :meth:`DeviceStep.transcript` (one
device-to-host copy), which records them with the method (``record_skip``). Everything here is
device-agnostic: the tests run it on CPU tensors, with a fake graph backend.
"""
import logging
from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F

from tta_brain.gpu.graphs import FIRST_WARMUP, CapturedStep, GraphCache, bucket_length
from tta_brain.gpu.guard import (DeviceHook, StepFlags, device_optimizer_blocker, guarded_update,
                                 is_device_optimizer, skipped, to_device_optimizer, where_)
from tta_brain.gpu.host_step import HostStep, step_loss, train_draws

logger = logging.getLogger(__name__)

__all__ = ["DeviceStep"]


class DeviceStep:
    """A method's adaptation steps with the device-side guard, eager or captured; the same
    interface as :class:`tta_brain.gpu.host_step.HostStep`. A method may bring its own step body
    (``device_body(step, logits_fn, optimizer)``, SAR's two passes: device work only, with
    ``step_passes`` forward/backward passes) instead of its loss and :meth:`_update`.

    ``backend``: None (eager only), a :class:`tta_brain.gpu.graphs.CudaGraphBackend`, or a test
    double with ``side()``, ``capture(body, pool)`` (returning an object with ``replay``, ``pool``,
    ``release``). ``extra_optimizers``: names of the method's optimisers besides ``optimizer``
    that run fused too (DSUTA: ``slow_optimizer``, whose state is copied into the fast one every
    utterance: both keep their step counts on the device, so that copy stays in place).
    ``buckets``: the length-bucket ratio (0: off; ``Runtime.cuda_graph_buckets``): the plain steps,
    eager and captured, run on the padded input (the graphs module's docstring).
    """

    #: steps of the last utterance skipped after their ``after_backward`` hook had run: the hook
    #: runs before the device knows, and sees zero gradients there (DSUTA uncounts them)
    skipped_hooks = 0
    #: the step runs on the device (verdicts and skips are read with the transcript)
    on_device = True

    def __init__(self, method, backend=None, capacity: int = 1, warmup: int = 1,
                 extra_optimizers=(), buckets: float = 0.0):
        self.m = method
        # a train mode that draws (dropout, ...) keeps the steps eager: a replay would repeat
        # the capture's draws; one that draws nothing is the eval mode's passes, captured
        self.draws = bool(train_draws(method))
        self.buckets = float(buckets)
        self._padded = None                   # (utterance, its padded input, its valid samples)
        self._warmed = {}                     # buckets: eager warm-up steps run per graph key
        self.host = HostStep(method)          # steps with another optimiser than the method's
        self.extra_optimizers = tuple(extra_optimizers)
        self.device = method.params[0].device
        self.flags = StepFlags(self.device, method.runtime.scale)
        self.backend = backend
        self.cache = GraphCache(capacity)
        # length buckets: the no-grad forwards (prediction, the reset policy's losses), one graph
        # per bucket and parameter set (live, the policy's phi_D, the source), own memory pool
        self.forwards = GraphCache(3 * capacity)
        self.warmup = max(0, int(warmup))
        self.captured_once = False
        self._x = self._opt = None
        self._calls = self._eager = 0
        self._entry = None
        self.stats = {"eager": 0, "replays": 0, "forward_replays": 0}

    @property
    def graphs(self) -> bool:
        return self.backend is not None

    def disable_graphs(self, why: str) -> None:
        if self.backend is not None:
            logger.warning("%s: CUDA graphs off from now on (%s); the steps run eagerly",
                           self.m.name, why)
        self.release()
        self.backend = None

    def describe(self) -> Optional[str]:
        """The run's graph counts in one line (its log, at the end of the stream: a cache that
        never hits means a capture per utterance), None where no step ran with graphs on."""
        s, f = self.cache.stats, self.forwards.stats
        if not ((self.backend is not None or s["captures"])
                and (self.stats["eager"] or self.stats["replays"])):
            return None
        off = "; turned off during the run" if self.backend is None else ""
        return (f"{s['captures']} step captures, {s['hits']} cache hits, {s['evictions']} "
                f"evictions, {self.stats['replays']} replayed and {self.stats['eager']} eager "
                f"steps, {f['captures']} forward captures, {self.stats['forward_replays']} "
                f"forward replays{off}")

    def release(self) -> None:
        """Drop the captured graphs (their pool goes back to the allocator)."""
        self.cache.clear()
        self.forwards.clear()
        self._entry = self._padded = None

    # ------------------------------------------------------------------ one step
    def __call__(self, x: torch.Tensor, optimizer, loss_fn=None, after_backward=None):
        """One guarded step on ``x``; returns its loss as a device tensor (no sync). A step with
        an optimiser the device step does not run (neither ``optimizer`` nor one of
        ``extra_optimizers``) takes the host step."""
        m = self.m
        optimizers = {name: getattr(m, name) for name in ("optimizer",) + self.extra_optimizers}
        if not any(optimizer is opt for opt in optimizers.values()):
            return self.host(x, optimizer, loss_fn, after_backward)
        for name, opt in optimizers.items():
            if not is_device_optimizer(opt):   # first step, or a state loaded since
                self._convert(name, opt)
        if x is not self._x or optimizer is not self._opt:
            # a new run of steps: a new utterance (its steps share the input tensor), or the
            # utterance's next stage with another optimiser (CEA)
            self._x, self._opt, self._calls, self._eager, self._entry = x, optimizer, 0, 0, None
        self._calls += 1
        self.flags.pending = True
        # on length buckets a DeviceHook step is captured too (its graph serves the bucket)
        hook = after_backward if self.buckets and isinstance(after_backward, DeviceHook) else None
        if loss_fn is not None or (after_backward is not None and hook is None) or self.draws:
            return self._eager_step(x, optimizer, loss_fn, after_backward)
        feats = m.features.get(x)             # cached CNN features (None: off), outside the graph
        src, samples = self._source(x, feats)
        features = feats is not None
        if self.backend is None:
            return self._plain_eager(x, src, samples, features, optimizer, hook)
        entry = (self._entry if hook is None else None) or self._cached(optimizer, src, features,
                                                                        hook)
        if entry is None:
            remaining = m.steps_with(optimizer) - self._calls + 1
            # the warm-up is per new length, or per new bucket; without buckets a graph serves
            # this utterance alone: worth it from 2 steps on
            if self.buckets:
                key = self._key(optimizer, src, features, hook)
                cold = self._warmed.get(key, 0) < self.warmup
            else:
                key, cold = None, self._eager < self.warmup
            if cold or self.stats["eager"] < FIRST_WARMUP or remaining < (1 if self.buckets else 2):
                if key is not None:
                    self._warmed[key] = self._warmed.get(key, 0) + 1
                return self._plain_eager(x, src, samples, features, optimizer, hook)
            entry = self._capture(optimizer, src, features, samples, hook)
            if entry is None:                  # capture failed: graphs are off, eager step
                return self._plain_eager(x, src, samples, features, optimizer, hook)
        if hook is None:
            self._entry = entry
        entry.load(src, samples)
        entry.replay()
        if hook is not None:
            hook.host()
        m.counts["adapt_forward"] += self.passes
        m.counts["adapt_backward"] += self.passes
        self.stats["replays"] += 1
        return self.flags.loss.clone()

    def _source(self, x, feats):
        """What a plain step reads: the input (or its CNN features) and None, or with length
        buckets the zero-padded input (features) and its valid samples (once per utterance)."""
        if not self.buckets:
            return (x if feats is None else feats), None
        if self._padded is None or self._padded[0] is not x:
            lobe, n = self.m.lobe, x.shape[-1]
            n_pad = bucket_length(n, self.buckets, lobe.frame_stride, lobe.sample_rate)
            samples = torch.full((x.shape[0],), n, dtype=torch.long, device=x.device)
            if feats is None:
                src = F.pad(x, (0, n_pad - n))
            else:
                frames = int(lobe.output_lengths(torch.tensor(n_pad)))
                src = F.pad(feats, (0, frames - feats.shape[-1]))
            valid = int(lobe.output_lengths(torch.tensor(n)))       # on the host: no sync
            self._padded = (x, src, samples, valid)
        return self._padded[1], self._padded[2]

    def _padded_logits(self, src, samples, features: bool, params=None):
        return self.m.lobe.padded_logits(None if features else src, samples,
                                         src if features else None, params)

    @property
    def passes(self) -> int:
        """Forward/backward passes in one step of the method (SAR's SAM step: 2)."""
        return int(getattr(self.m, "step_passes", 1))

    def _body(self, logits_fn, optimizer, hook=None):
        """One step's device work after the zeroed gradients: the method's own ``device_body``
        (SAR: two passes), else its loss on ``logits_fn()`` (logits, valid frames or None) and
        the guarded update. Runs eagerly or inside a capture."""
        body = getattr(self.m, "device_body", None)
        if body is not None:
            return body(self, logits_fn, optimizer)
        logits, lengths = logits_fn()
        # lengths only on buckets (where the loss must take them: bucket_blocker)
        loss = self.m.loss(logits) if lengths is None else self.m.loss(logits, lengths)
        self._update(loss, optimizer, hook)
        return loss

    def _plain_eager(self, x, src, samples, features: bool, optimizer, hook=None):
        """An eager plain step (or a DeviceHook step): on ``x`` (the method's own forward), or on
        the padded input."""
        if samples is None:
            return self._eager_step(x, optimizer, None, hook)
        m = self.m
        self._eager += 1
        self.stats["eager"] += 1
        with (self.backend.side() if self.backend is not None else nullcontext()):
            optimizer.zero_grad(set_to_none=False)
            m.counts["adapt_forward"] += self.passes
            loss = self._body(lambda: self._padded_logits(src, samples, features), optimizer, hook)
            m.counts["adapt_backward"] += self.passes
            return loss.detach()

    def _eager_step(self, x, optimizer, loss_fn, after_backward):
        m = self.m
        self._eager += 1
        self.stats["eager"] += 1
        with (self.backend.side() if self.backend is not None else nullcontext()):
            if loss_fn is None and getattr(m, "device_body", None) is not None:
                optimizer.zero_grad(set_to_none=False)
                loss = self._body(lambda: (self._forward(x), None), optimizer, after_backward)
            else:
                loss = step_loss(m, x, optimizer, loss_fn)
                self._update(loss, optimizer, after_backward)
            m.counts["adapt_backward"] += self.passes if loss_fn is None else 1
            return loss.detach()

    def _forward(self, x):
        """The method's counted forward for its step (in train mode if it adapts so)."""
        m = self.m
        if m.train_mode:
            m.net.train()
        try:
            return m.forward(x, "adapt_forward")
        finally:
            if m.train_mode:
                m.net.eval()

    @property
    def filter(self):
        """The method's filter of its own steps (``guard.StepFilter``; EATA), or None."""
        return getattr(self.m, "step_filter", None)

    def _update(self, loss, optimizer, after_backward=None) -> None:
        """Guarded backward, the hook, the fused update: device work only (captured as is). A step
        the method's filter dropped (its loss set the gate) is skipped as a non-finite one is,
        without being counted as one."""
        m, f, gate = self.m, self.flags, self.filter
        keep = None if gate is None else 1.0 - gate.gate
        if gate is not None and after_backward is not None:
            raise ValueError(f"{m.name}: a step filter and an after_backward hook in one step")
        f.note_loss(loss, keep)
        grads = m.runtime.backward_guarded(loss, m.params, self.device, f.found, f.inv_scale)
        if after_backward is not None:
            if grads:                         # a skipped step hands the hook zero gradients
                where_(f.found.bool(), grads, 0.0)
            after_backward()
        f.note_step(after_backward is not None, keep)
        if gate is not None:
            torch.maximum(f.found, gate.gate, out=f.found)
        guarded_update(optimizer, f.found)

    def _convert(self, name, opt) -> None:
        why = device_optimizer_blocker(opt)
        if why:                               # the factory checked ``optimizer``; an extra one
            raise ValueError(f"{self.m.name}: {name}: {why}; the device step runs every optimiser "
                             f"of the method as torch's fused Adam/AdamW (set cuda_graphs: off)")
        to_device_optimizer(opt)

    def transcript(self, logits: torch.Tensor) -> str:
        """The prediction's text; the utterance's step counters, the method's filter rows and
        the LII losses it computed ahead (``early_losses``) are read in the same copy, its
        skipped steps recorded with the method."""
        m = self.m
        early = [k for k, v in m.early_losses.items() if torch.is_tensor(v)]
        if not self.flags.pending and not early:
            self.skipped_hooks = 0
            return m.lobe.decode(logits)[0]
        gate = self.filter
        parts = ([] if gate is None else [gate.packed().reshape(-1)]) + (
            [torch.stack([m.early_losses[k].reshape(()) for k in early]).to(torch.float64)]
            if early else [])
        labels, counts, rows = self.flags.fetch(logits.argmax(-1),
                                                torch.cat(parts) if parts else None)
        if early:
            m.early_losses.update(zip(early, rows[len(rows) - len(early):]))
            rows = rows[:len(rows) - len(early)]
        reasons, self.skipped_hooks = skipped(counts)
        for why in reasons:
            m.record_skip(why, clear_grads=False)
        if gate is not None:
            m.step_notes(gate.unpack(rows))
        return m.lobe.decode_labels(labels)[0]

    # ------------------------------------------------------------------ no-grad forwards
    def logits(self, x: torch.Tensor, params=None):
        """No-grad logits of ``x`` for the prediction and the reset policy's losses (``params``:
        {lobe name: tensor} replacing adapted parameters, as ``lobe.logits``): on length buckets
        a padded pass, replayed from a captured graph once its bucket and parameter set are warm,
        sliced to the valid frames (a view of the graph's output, valid until its next replay).
        None without buckets or under autograd: the method runs its own pass."""
        if not self.buckets or torch.is_grad_enabled():
            return None
        m = self.m
        feats = m.features.get(x)
        src, samples = self._source(x, feats)
        valid, features = self._padded[3], feats is not None
        if self.backend is None:
            return self._padded_logits(src, samples, features, params)[0][:, :valid]
        tensors = m.params if params is None else list(params.values())
        key = ("forward", features, tuple(src.shape), src.dtype,
               tuple(t.data_ptr() for t in tensors))
        entry = self.forwards.get(key)
        if entry is None:
            if self._warmed.get(key, 0) < self.warmup:
                self._warmed[key] = self._warmed.get(key, 0) + 1
                return self._padded_logits(src, samples, features, params)[0][:, :valid]
            entry = self._capture_forward(key, src, samples, features, params)
            if entry is None:
                return self._padded_logits(src, samples, features, params)[0][:, :valid]
        entry.load(src, samples)
        entry.replay()
        self.stats["forward_replays"] += 1
        return entry.out[:, :valid]

    def _capture_forward(self, key, src, samples, features, params):
        m = self.m
        entry = CapturedStep(key, torch.empty_like(src), features, None, torch.empty_like(samples))
        entry.load(src, samples)
        frames = (src.shape[-1] if features
                  else int(m.lobe.output_lengths(torch.tensor(src.shape[-1]))))
        # the output lives outside the capture (nothing a capture allocates outlives it)
        entry.out = torch.empty(src.shape[0], frames, m.lobe.vocab_size, device=src.device)

        def body():
            with torch.no_grad():
                entry.out.copy_(self._padded_logits(entry.static, entry.samples, features,
                                                    params)[0])

        try:
            entry.graph = self.backend.capture(body, self.forwards.pool())
        except Exception as e:                 # noqa: BLE001 - any capture error: eager from now on
            self.disable_graphs(f"capture failed: {type(e).__name__}: {e}")
            return None
        self.forwards.put(key, entry)
        return entry

    # ------------------------------------------------------------------ graphs
    def _key(self, optimizer, src, features, hook=None):
        return (id(optimizer), features, tuple(src.shape), src.dtype, hook is not None)

    def signature(self, optimizer, hook=None):
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
        if self.filter is not None:
            sig += [t.data_ptr() for t in self.filter.tensors()]
        sig += [t.data_ptr() for t in self.m.device_tensors()]
        if hook is not None:
            sig += [t.data_ptr() for t in hook.tensors()]
        return tuple(sig)

    def _cached(self, optimizer, src, features, hook=None):
        key = self._key(optimizer, src, features, hook)
        entry = self.cache.get(key)
        if entry is not None and entry.signature != self.signature(optimizer, hook):
            logger.info("%s: parameters, optimiser state or settings were replaced; the captured "
                        "steps are dropped", self.m.name)
            self.release()
            entry = None
        return entry

    def _capture(self, optimizer, src, features, samples=None, hook=None):
        m = self.m
        missing = [i for i, p in enumerate(m.params) if p.grad is None]
        key = self._key(optimizer, src, features, hook)
        entry = CapturedStep(key, torch.empty_like(src), features, None,
                             None if samples is None else torch.empty_like(samples))
        entry.load(src, samples)

        def logits():
            if samples is not None:
                return self._padded_logits(entry.static, entry.samples, features)
            if features:
                return m.lobe.logits(None, None, entry.static), None
            return m.logits(entry.static), None       # the method's (CEA keeps its features)

        def body():
            optimizer.zero_grad(set_to_none=False)
            self._body(logits, optimizer, None if hook is None else hook.device)

        try:
            entry.graph = self.backend.capture(body, self.cache.pool())
        except Exception as e:                 # noqa: BLE001 - any capture error: eager from now on
            self.disable_graphs(f"capture failed: {type(e).__name__}: {e}")
            return None
        if [i for i, p in enumerate(m.params) if p.grad is None] != missing:
            entry.release()                    # a gradient was allocated inside the capture
            self.disable_graphs("a gradient was first allocated during the capture")
            return None
        entry.signature = self.signature(optimizer, hook)
        self.cache.put(key, entry)
        self.captured_once = True
        return entry


