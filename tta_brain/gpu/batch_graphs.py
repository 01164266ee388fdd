"""CUDA graphs of a batched sweep's step (``tta_brain.methods.batched``): R runs' adaptation step,
one ``vmap`` forward/backward and the rows' AdamW update, captured once per set of runs, input
length and ``graph_key`` (CEA's stage) and replayed for the utterance's later steps, as
:class:`tta_brain.gpu.device_step.DeviceStep` does for one run (the same warm-up rules,
:class:`GraphCache`, capture backend and side stream). On length buckets (``BatchedSUTA.pad``:
the input padded to its bucket, its valid samples in a static device tensor) one graph serves
every length of its bucket.

A batch's step is device work alone (``BatchedSUTA.step_body``: nothing read on the host, every
state tensor updated in place); its host work (the counts, the optimiser's step bounds, the note
that the utterance's read settles) runs around it, so a replay is the step. What the step leaves
for the host (its ``[w, R']`` values) is copied out of the graph's output after each replay. A
captured step is valid while the batch's state tensors stay where they are
(``BatchedSUTA.device_tensors``): their addresses are checked before every replay (a grown
bias-correction table drops the graphs). Only steps whose gradients the caller does not keep are
captured (DSUTA's first fast step, whose gradient goes into its buffer, stays eager).

Device-agnostic: the tests run it on CPU tensors with a fake backend that replays by running the
step again.
"""
import logging
from typing import List, Optional

import torch

from tta_brain.gpu.graphs import FIRST_WARMUP, CapturedStep, CudaGraphBackend, GraphCache

logger = logging.getLogger(__name__)

__all__ = ["BatchGraphs", "batch_graphs"]


def batch_graphs(batch, runtime) -> Optional["BatchGraphs"]:
    """The graphs of ``batch``'s steps from its runs' runtime options (``cuda_graphs``,
    ``cuda_graph_cache``, ``cuda_graph_warmup``), or None (eager): off, not on CUDA, or a batch
    whose step is not captured (``capturable``). The runs' blockers already refused fp16/bf16,
    ``compile`` and a train mode that draws."""
    name = type(batch).__name__
    device = batch.P.device
    if runtime.cuda_graphs == "off" or device.type != "cuda":
        return None
    if not getattr(batch, "capturable", False):
        (logger.warning if runtime.cuda_graphs == "on" else logger.info)(
            "%s: its steps are not captured (%s); they run eagerly on %s", name,
            getattr(batch, "not_captured", "not capturable"), device)
        return None
    # the cache as for buckets where they are asked for (the batch sets it again once it knows
    # whether they run: ``set_capacity``)
    capacity = runtime.graph_cache(runtime.bucket_ratio(device.type))
    logger.info("%s: the batched steps are captured as CUDA graphs on %s", name, device)
    return BatchGraphs(batch, CudaGraphBackend(device), capacity, runtime.cuda_graph_warmup)


class BatchGraphs:
    """The captured steps of one batch. ``backend``: :class:`CudaGraphBackend` or a test double
    (``side()``, ``capture(body, pool)``)."""

    def __init__(self, batch, backend, capacity: int = 1, warmup: int = 1):
        self.batch, self.backend = batch, backend
        self.cache = GraphCache(capacity)
        self.warmup = max(0, int(warmup))
        self.widths = {}                 # run set -> rows of its step's values (from an eager step)
        self._x, self._eager = None, 0   # the current utterance's input and its eager steps
        self._live = {}                  # the graphs this utterance has replayed (key -> entry)
        self._warmed = {}                # length buckets: eager steps run per graph key
        # length buckets: the no-grad forwards too (the prediction per run set, the LII per row
        # count), per bucket
        self.forwards = GraphCache(capacity)
        self.shapes = {}                 # forward key -> its output's shape (from an eager one)
        self.stats = {"eager": 0, "replays": 0, "failed": 0, "forward_replays": 0,
                      "lii_replays": 0}

    def set_capacity(self, capacity: int) -> None:
        """The graphs kept (steps, and forwards), set before the first capture."""
        self.cache.capacity = self.forwards.capacity = max(1, int(capacity))

    # ------------------------------------------------------------------ eager
    def eager(self, runs: List[int], x: torch.Tensor, update: bool = True,
              samples: Optional[torch.Tensor] = None):
        """The step run eagerly, on the capture's side stream (as the warm-up before a
        capture); its outputs are marked as used by the current stream too."""
        self._utterance(x)
        self._eager += 1
        self.stats["eager"] += 1
        with self.backend.side():
            finite, grad, values = self.batch.step_body(runs, x, update, samples)
        if x.is_cuda:
            current = torch.cuda.current_stream(x.device)
            for t in (finite, grad, values):
                t.record_stream(current)
        self.widths[(tuple(runs),) + self.batch.graph_key()] = values.shape[0]
        return finite, grad, values

    def _utterance(self, x: torch.Tensor) -> None:
        if x is not self._x:
            self._x, self._eager, self._live = x, 0, {}

    # ------------------------------------------------------------------ captured
    def step(self, runs: List[int], x: torch.Tensor, left: int,
             samples: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One step of ``runs`` on ``x`` (with its update), replayed from its graph (captured
        first where due) or run eagerly; its values (a copy). ``samples``: ``x`` is padded to
        its length bucket (``BatchedSUTA.pad``): the graph serves every length of the bucket,
        so it is captured after ``warmup`` eager steps of the bucket (not of each utterance)
        and even for a last step."""
        self._utterance(x)
        kind = (tuple(runs),) + self.batch.graph_key()     # a step of this kind ran eagerly
        key = kind + (tuple(x.shape), x.dtype)
        entry = self._live.get(key) or self.cache.get(key)
        if entry is not None and entry.signature != self.signature():
            logger.info("%s: the batch's state tensors moved; its captured steps are dropped",
                        type(self.batch).__name__)
            self.release()
            self._live, entry = {}, None
        if entry is None:
            bucketed = samples is not None
            cold = (self._warmed.get(key, 0) if bucketed else self._eager) < self.warmup
            if (cold or self.stats["eager"] < FIRST_WARMUP or left < (1 if bucketed else 2)
                    or kind not in self.widths):
                if bucketed:
                    self._warmed[key] = self._warmed.get(key, 0) + 1
                return self.eager(runs, x, True, samples)[2]
            entry = self._capture(key, runs, x, self.widths[kind], samples)
            if entry is None:
                return self.eager(runs, x, True, samples)[2]
        self._live[key] = entry
        entry.load(x, samples)
        entry.replay()
        self.stats["replays"] += 1
        return entry.out.clone()

    def signature(self):
        return tuple(t.data_ptr() for t in self.batch.device_tensors())

    def _capture(self, key, runs: List[int], x: torch.Tensor, width: int,
                 samples: Optional[torch.Tensor] = None) -> Optional[CapturedStep]:
        batch = self.batch
        # the run set's index tensors exist: a step of its kind ran eagerly before (``widths``)
        entry = CapturedStep(key, torch.empty_like(x), False, None,
                             None if samples is None else torch.empty_like(samples))
        entry.load(x, samples)
        # the values live outside the capture (nothing a capture allocates outlives it)
        entry.out = torch.empty(width, len(runs), dtype=torch.float64, device=x.device)

        def body():
            entry.out.copy_(batch.step_body(runs, entry.static, True, entry.samples)[2])
        return entry if self._record(entry, body, self.cache, "its step") else None

    def _record(self, entry: CapturedStep, body, cache, what: str) -> bool:
        """Capture ``body`` as ``entry``'s graph and keep it in ``cache``; on any capture error
        the batch runs eagerly from now on (logged; False)."""
        try:
            entry.graph = self.backend.capture(body, cache.pool())
        except Exception as e:                 # noqa: BLE001 - any capture error: eager from now on
            self.stats["failed"] += 1
            logger.warning("%s: capture of %s failed (%s: %s); the batch runs eagerly from now "
                           "on", type(self.batch).__name__, what, type(e).__name__, e)
            self.release()
            self.batch.graphs = None
            return False
        entry.signature = self.signature()
        cache.put(entry.key, entry)
        return True

    # ------------------------------------------------------------------ the prediction
    def predict(self, runs: List[int], x: torch.Tensor,
                samples: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The runs' no-grad logits of ``x`` (the prediction: their rows as they are now). On
        length buckets replayed from a graph per run set and bucket once it is warm (the output
        is the graph's: valid until its next replay); else, and while warming, eagerly."""
        return self.forward(("forward", tuple(runs)), lambda: self.batch.fast.rows(runs), x,
                            samples, "the prediction", "forward_replays")

    def forward(self, kind: tuple, rows, x: torch.Tensor, samples: Optional[torch.Tensor] = None,
                what: str = "a forward", stat: str = "forward_replays") -> torch.Tensor:
        """The no-grad logits of ``x`` under the rows ``rows()`` returns (rows of a tensor that
        stays where it is: a replay reads them there), as :meth:`predict`; ``kind``: what
        besides the bucket makes another graph (the rows' shape with it)."""
        batch = self.batch

        def forward(inputs, valid):
            with torch.no_grad():
                return batch.logits(rows(), inputs, valid)
        if samples is None:
            return forward(x, None)
        key = kind + batch.graph_key() + (tuple(x.shape), x.dtype)
        entry = self.forwards.get(key)
        if entry is not None and entry.signature != self.signature():
            self.forwards.clear()
            entry = None
        if entry is None:
            if self._warmed.get(key, 0) < self.warmup or key not in self.shapes:
                self._warmed[key] = self._warmed.get(key, 0) + 1
                with self.backend.side():
                    out = forward(x, samples)
                if x.is_cuda:
                    out.record_stream(torch.cuda.current_stream(x.device))
                self.shapes[key] = out.shape
                return out
            entry = CapturedStep(key, torch.empty_like(x), False, None, torch.empty_like(samples))
            entry.load(x, samples)
            # the output lives outside the capture (nothing a capture allocates outlives it)
            entry.out = torch.empty(self.shapes[key], dtype=torch.float32, device=x.device)

            def body():
                entry.out.copy_(forward(entry.static, entry.samples))
            if not self._record(entry, body, self.forwards, what):
                return forward(x, samples)
        entry.load(x, samples)
        entry.replay()
        self.stats[stat] += 1
        return entry.out

    def release(self) -> None:
        self.cache.clear()
        self.forwards.clear()

    def describe(self) -> str:
        s = self.cache.stats
        return (f"{s['captures']} captures, {self.stats['replays']} replays, "
                f"{self.stats['eager']} eager steps, {s['hits']} cache hits, "
                f"{self.forwards.stats['captures']} forward captures, "
                f"{self.stats['forward_replays']} prediction and {self.stats['lii_replays']} "
                f"LII forward replays")
