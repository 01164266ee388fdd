"""R runs of ``dsuta`` as one batch (:class:`BatchedSUTA` plus the slow learner).

Each run has the fast rows of the batch (``self.fast``) and slow rows ``self.slow`` (phi_t, with
the slow AdamW's moments and its own learning rates), a gradient sum ``G [R, N]`` and its buffer
counts. Per utterance, as ``DSUTA.forward_and_adapt``: the fast rows start from phi_t (and, with
``fast_moments: slow``, from the slow moments and step count), the fast steps run batched, the
first step's gradient of each run goes into its sum (a run with N = 0 gets it from one gradient
pass with no update), and when a run's buffer is full its policy resets it or the runs due take
one batched slow step with their mean gradients. ``slow_grad: recompute`` is not batched (it is
the reference; ``reuse`` gives the same gradients).
"""
from typing import Dict, List

import torch

from tta_brain.methods.batched import (BatchedSUTA, AdamRows, optimizer_blocker,
                                       optimizer_template, tensor_lrs)
from tta_brain.methods.dsuta import DSUTA

__all__ = ["BatchedDSUTA"]


class BatchedDSUTA(BatchedSUTA):
    methods = (DSUTA,)

    @classmethod
    def blocker(cls, m):
        return (super().blocker(m) or
                (f"slow_grad {m.slow_grad} (batched: reuse)" if m.slow_grad != "reuse" else None)
                or optimizer_blocker(m.slow_optimizer, "slow optimizer"))

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        for i, m in enumerate(methods):
            self._same(i, m.slow_optimizer, methods[0].slow_optimizer, "slow optimizer")
        self.slow = AdamRows(self.source, torch.stack(
            [tensor_lrs(m.slow_optimizer, m.meta) for m in methods]), self.numels,
            methods[0].slow_optimizer)
        self.slow_templates = [optimizer_template(m.slow_optimizer, m.meta) for m in methods]
        self.buffer_size = [m.M for m in methods]
        self.inherit = [m.fast_moments == "slow" for m in methods]
        self.G = torch.zeros_like(self.slow.P)
        self.n_buffered = [0] * self.R          # utterances in the buffer (host)
        # finite gradients in the sum: on the device, as the masks that decide them
        self.n_grads = torch.zeros(self.R, dtype=torch.int64, device=self.G.device)

    # ------------------------------------------------------------- the fast and slow learners
    def adapt(self, runs: List[int], x: torch.Tensor) -> None:
        self.fast.take(self.slow, runs, [r for r in runs if self.inherit[r]])
        for n in range(max(self.views[r].steps for r in runs)):
            stepping = [r for r in runs if n < self.views[r].steps]
            # the first step's gradients go into the buffers; the later steps may be replayed
            finite, g = self.step(stepping, x, grads=n == 0,
                                  left=min(self.views[r].steps for r in stepping) - n)
            if n == 0:
                self._accumulate(stepping, finite, g)
        no_steps = [r for r in runs if self.views[r].steps == 0]
        if no_steps:
            self._accumulate(no_steps, *self.step(no_steps, x, update=False))
        for r in runs:
            self.n_buffered[r] += 1

    @torch.no_grad()
    def _accumulate(self, runs: List[int], finite: torch.Tensor, g: torch.Tensor) -> None:
        """The first step's gradients of ``runs`` into their buffer sums, where ``finite``."""
        idx = self.rows_index(runs)
        rows = self.G.index_select(0, idx)
        self.G.index_copy_(0, idx, torch.where(finite[:, None], rows + g, rows))
        self.n_grads.index_add_(0, idx, finite.to(self.n_grads.dtype))

    def update_due(self, r: int) -> bool:
        return self.n_buffered[r] >= self.buffer_size[r]

    @torch.no_grad()
    def meta_update(self, runs: List[int]) -> None:
        """The slow step of the runs with a finite gradient in their buffer; buffers cleared."""
        idx = self.rows_index(runs)
        n = self.n_grads.index_select(0, idx)
        mean = self.G.index_select(0, idx) / n.clamp(min=1).to(self.G.dtype)[:, None]
        self.slow.update(runs, mean, n > 0)
        self._clear(runs)

    def _clear(self, runs: List[int]) -> None:
        idx = self.rows_index(runs)
        self.G.index_fill_(0, idx, 0.0)
        self.n_grads.index_fill_(0, idx, 0)
        for r in runs:
            self.n_buffered[r] = 0

    def reset(self, runs: List[int]) -> None:
        """Fast and slow rows back to the source; the buffers discarded."""
        super().reset(runs)
        self.slow.reset(runs)
        self._clear(runs)

    def meta_values(self, r: int) -> List[torch.Tensor]:
        return [t.clone() for t in self.split(self.slow.P[r])]

    # ------------------------------------------------------------- DSUTA's checkpoint format
    def state_dict(self, r: int) -> Dict:
        return super().state_dict(r) | {
            "meta": self.meta_values(r),
            "slow_optimizer": self.slow.state(r, self.slow_templates[r], self.split),
            "grad_sum": [t.clone() for t in self.split(self.G[r])],
            "n_buffered": self.n_buffered[r], "n_grads": int(self.n_grads[r]), "buffer_x": []}

    @torch.no_grad()
    def load_state_dict(self, r: int, sd: Dict) -> None:
        if sd.get("buffer_x"):
            raise ValueError("a checkpoint of slow_grad: recompute (buffered inputs) cannot "
                             "resume in a batch")
        super().load_state_dict(r, sd)
        self.slow.load(r, sd["meta"], sd["slow_optimizer"], self.slow_templates[r], self.numels)
        self.G[r] = self.flat(sd["grad_sum"])
        self.n_buffered[r], self.n_grads[r] = sd["n_buffered"], sd["n_grads"]
