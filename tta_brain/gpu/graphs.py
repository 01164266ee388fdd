"""CUDA graphs of the adaptation step: the capture machinery of ``tta_brain.gpu.device_step``.

* **Captured steps** (``Runtime.cuda_graphs``, CUDA only, fp32, no ``compile``, no train mode).
  Within an utterance every step has the same input. The first steps of a new input length run
  eagerly (``cuda_graph_warmup``; 3 eager steps in all before the first capture): they are real
  steps and warm up what a capture must not do for the first time (cuBLAS/cuDNN set-up,
  optimiser state). With ``cuda_graph_warmup: 0`` a new length is captured at once once the
  process is warm (its first step is then a replay too: no eager step per utterance; on an H100
  faster for SUTA, slower for DSUTA + dynamic). A length is captured only when at least 2 steps
  of the utterance remain. Then one step (zero the gradients, forward, loss, guarded backward,
  fused update, the counters) is
  captured into a ``torch.cuda.CUDAGraph`` (capture does not run it) and replayed for this and
  the remaining steps. Everything a replay reads or writes outside its own scratch memory is
  static: the input is copied into the graph's input buffer (the CNN features instead, when the
  feature cache is on), parameters, gradients and optimiser state are updated in place by the
  method (``restore``, ``copy_optimizer_state``, ``zero_optimizer_state`` copy in place), and a
  signature of their addresses and the optimiser's hyperparameters is checked before a graph is
  reused (a ``load_state_dict`` or a changed lr drops the cached graphs). Warm-up and capture run
  on one side stream, as in PyTorch's whole-network capture recipe; replays on the current one.
* **Graph memory.** :class:`GraphCache` keeps at most ``cuda_graph_cache`` graphs (LRU keyed by
  optimiser and input shape). Every capture shares the memory pool of the graphs already cached
  (``pool=graph.pool()``), and nothing a capture allocates outlives it (its outputs go into
  tensors allocated outside the capture), so the pool holds only scratch that every replay
  rewrites before reading: graphs of different lengths reuse it instead of growing it. An
  evicted graph is reset; when the cache empties the pool goes back to the allocator.
* **Length buckets** (``Runtime.cuda_graph_buckets``; ``auto``, the default, is ratio 0.1 on
  CUDA, from the H200 measurement in the README's GPU section). Every
  utterance of a real stream has its own length, so without buckets each one pays a warm-up and a
  capture and the cache never hits. With buckets the plain steps run on the input zero-padded to
  its bucket (:func:`bucket_length`) with the valid length in a static device tensor; the padded
  pass masks the padding exactly (``tta_brain.lobes.partial``), so one graph per bucket serves
  every length in it, from the utterance's first step, and a one-step method (csuta) is captured
  too. Only for models and losses where that is exact (``tta_brain.gpu.bucket_blocker``).

Everything here but the capture itself is device-agnostic (tests run it on CPU tensors, with a
fake graph that records the step and re-executes it on replay).
"""
import gc
import logging
import math
from collections import OrderedDict
from typing import Callable, Hashable, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["GraphCache", "CapturedStep", "CudaGraphBackend", "FIRST_WARMUP", "bucket_length"]

#: Eager steps (in all) before the first capture of a method (PyTorch's recipe warms up a few
#: iterations); each later length needs ``warmup`` eager steps of its own.
FIRST_WARMUP = 3


def bucket_length(n: int, ratio: float, multiple: int = 1, smallest: int = 1) -> int:
    """The length bucket of an input of ``n`` samples: the smallest edge ``>= n`` of
    ``ceil(smallest * (1 + ratio)^k / multiple) * multiple``, k = 0, 1, ... (so a bucket pads an
    input longer than ``smallest`` by less than ``ratio`` of its length plus ``multiple``)."""
    if ratio <= 0:
        raise ValueError("bucket ratio must be > 0")
    multiple, smallest = max(1, int(multiple)), max(1, int(smallest))

    def edge(k):
        return -(-math.ceil(smallest * (1.0 + ratio) ** k) // multiple) * multiple

    k = 0 if n <= smallest else max(0, math.ceil(math.log(n / smallest) / math.log1p(ratio)) - 1)
    while edge(k) < n:
        k += 1
    while k > 0 and edge(k - 1) >= n:
        k -= 1
    return edge(k)


# ------------------------------------------------------------------------------ graph cache
class GraphCache:
    """LRU of captured steps keyed by anything hashable (here: optimiser and input shape).

    ``put`` evicts the least recently used entries beyond ``capacity`` (``entry.release()``);
    ``clear`` releases all. ``pool()`` is the memory pool of a cached graph (None when empty):
    new captures share it.
    """

    def __init__(self, capacity: int = 1):
        if capacity < 1:
            raise ValueError("GraphCache capacity must be >= 1")
        self.capacity = int(capacity)
        self._entries: "OrderedDict[Hashable, object]" = OrderedDict()
        self.stats = {"captures": 0, "hits": 0, "evictions": 0, "clears": 0}

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return key in self._entries

    def keys(self):
        return list(self._entries)

    def get(self, key):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.stats["hits"] += 1
        return entry

    def put(self, key, entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None and old is not entry:
            old.release()
        self._entries[key] = entry
        self.stats["captures"] += 1
        while len(self._entries) > self.capacity:
            _, victim = self._entries.popitem(last=False)
            victim.release()
            self.stats["evictions"] += 1

    def discard(self, key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.release()

    def clear(self) -> None:
        if self._entries:
            self.stats["clears"] += 1
        while self._entries:
            self._entries.popitem(last=False)[1].release()

    def pool(self):
        for entry in reversed(self._entries.values()):
            pool = entry.pool()
            if pool is not None:
                return pool
        return None


class CapturedStep:
    """One captured step: the graph, its static input, what it was captured against."""

    def __init__(self, key, static: torch.Tensor, features: bool, signature,
                 samples: Optional[torch.Tensor] = None):
        self.key, self.static, self.features, self.signature = key, static, features, signature
        self.samples = samples           # length buckets: the valid samples of ``static``
        self.out = None                  # a captured forward's output (allocated outside it)
        self.graph = None
        self.src = None                  # the utterance tensor last copied into ``static``

    def load(self, src: torch.Tensor, samples: Optional[torch.Tensor] = None) -> None:
        if self.src is not src:
            self.static.copy_(src)
            if self.samples is not None:
                self.samples.copy_(samples)
            self.src = src

    def replay(self) -> None:
        self.graph.replay()

    def pool(self):
        return None if self.graph is None else self.graph.pool()

    def release(self) -> None:
        if self.graph is not None:
            self.graph.release()
        self.graph = self.static = self.src = self.samples = self.out = None


# ------------------------------------------------------------------------------ backends
class _CudaGraph:
    def __init__(self, graph):
        self.graph = graph

    def replay(self):
        self.graph.replay()

    def pool(self):
        return self.graph.pool()

    def release(self):
        self.graph.reset()


class CudaGraphBackend:
    """Capture on a side stream with ``torch.cuda.CUDAGraph``: the documented
    ``capture_begin``/``capture_end`` pair that ``torch.cuda.graph`` wraps, with its
    ``synchronize`` but without its ``empty_cache`` (which would hand the allocator's cached
    blocks back to the driver once per new length, i.e. about once per utterance), in
    ``thread_local`` capture mode (another thread's CUDA call cannot invalidate the capture)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def side(self):
        """Context: run on the side stream (it waits for the current stream; on exit the
        current stream waits for it)."""
        return _SideStream(self.stream, self.device)

    def capture(self, body: Callable[[], None], pool=None) -> _CudaGraph:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        # No cyclic garbage collection inside a capture: a collected graph (an evicted one still
        # in a reference cycle) resets itself, which a capturing stream does not permit and which
        # invalidates the capture (seen on an H100: dsuta + dynamic reset, graph cache 4).
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with self.side():
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    body()
                except BaseException:
                    try:
                        graph.capture_end()
                    except Exception:           # the capture is invalid anyway
                        pass
                    raise
                graph.capture_end()
        finally:
            if gc_was_on:
                gc.enable()
        return _CudaGraph(graph)


class _SideStream:
    def __init__(self, stream, device):
        self.stream, self.device = stream, device

    def __enter__(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.ctx = torch.cuda.stream(self.stream)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
