"""A stand-in for the CUDA graph backend (``tta_brain.gpu.graphs.CudaGraphBackend``) on CPU:
"capture" records the step without running it (as CUDA capture does), "replay" runs it again."""
from contextlib import nullcontext


class FakeGraph:
    def __init__(self, body, pool, backend):
        self.body, self._pool, self.backend = body, pool, backend

    def replay(self):
        self.body()

    def pool(self):
        return self._pool

    def release(self):
        self.backend.released += 1
        self.body = None


class FakeBackend:
    """Capture records the step (without running it, as CUDA capture); replay runs it."""

    def __init__(self, fail=False):
        self.captures = self.released = 0
        self.pools = []
        self.fail = fail

    def side(self):
        return nullcontext()

    def capture(self, body, pool=None):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        self.pools.append(pool)
        return FakeGraph(body, pool if pool is not None else object(), self)
