"""R runs of ``cea`` as one batch (:class:`BatchedSUTA` with CEA's two stages).

Each run's row holds its stage-1 tensors (LayerNorm, CNN, projection); stage 2's tensors are a
subset of them, with their own AdamW rows (``self.second``, the runs' ``lr2``). Per utterance, as
``CEA.forward_and_adapt`` for each run (episodic: from the source every time): stage 1's steps
(confidence-weighted entropy + MCC) with the first AdamW; stage 2's steps (entropy over all frames
+ MCC + ``tc_coef`` times the temporal coherence of the run's own CNN features, from the same
batched pass as its logits) with the second, which moves only stage 2's part of the row; then the
prediction. On CUDA each stage's steps are captured (one graph per stage, run set and length).
"""
from types import SimpleNamespace
from typing import List

import torch
from torch.func import functional_call, vmap

from tta_brain.methods.batched import (AdamRows, BatchedSUTA, optimizer_blocker, tensor_lrs,
                                       vmap_ready)
from tta_brain.methods.cea import CEA

__all__ = ["BatchedCEA"]


class BatchedCEA(BatchedSUTA):
    methods = (CEA,)
    masks_padding = False

    @classmethod
    def blocker(cls, m):
        return super().blocker(m) or optimizer_blocker(m.optimizer2, "stage-2 optimizer")

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        first = methods[0]
        tensors = self._stage2_tensors(first)                # their places in the row
        for i, m in enumerate(methods):
            if self._stage2_tensors(m) != tensors:
                raise ValueError(f"run {i + 1}: stage2_params differ from run 1's")
            self._same(i, m.optimizer2, first.optimizer2, "stage-2 optimizer")
        offsets = [sum(self.numels[:k]) for k in range(len(self.numels))]
        self.cols = torch.cat([torch.arange(offsets[k], offsets[k] + self.numels[k])
                               for k in tensors]).to(self.P.device)
        row_params = lambda m: [m.params[k] for k in tensors]
        self.second = AdamRows(self.source.index_select(0, self.cols), torch.stack(
            [tensor_lrs(m.optimizer2, row_params(m)) for m in methods]),
            [self.numels[k] for k in tensors], first.optimizer2)
        self.em_coef = [m.em_coef for m in methods]
        self.temperature = [m.temperature for m in methods]
        self.tc_coef = [m.tc_coef for m in methods]
        self.steps2 = [m.steps2 for m in methods]
        if any(self.tc_coef):       # (none: every run's stage 2 is the model's own forward)
            self.cnn = lobe.model.base_model.feature_extractor
            self.cnn_prefix = f"model.{lobe.model.base_model_prefix}.feature_extractor."
        self.stage2, self.feats = False, None

    @staticmethod
    def _stage2_tensors(m) -> List[int]:
        """The positions, among method ``m``'s adapted tensors, of its stage-2 ones."""
        second = {id(p) for g in m.optimizer2.param_groups for p in g["params"]}
        return [k for k, p in enumerate(m.params) if id(p) in second]

    # ------------------------------------------------------------- passes
    def logits(self, flat: torch.Tensor, x: torch.Tensor, samples=None) -> torch.Tensor:
        """Stage 2: each row's CNN features too (``self.feats``), from the same pass (never
        padded: CEA's losses do not mask padding, so it has no length buckets)."""
        if not (self.stage2 and any(self.tc_coef)):
            return super().logits(flat, x, samples)

        def one(row):
            params = dict(zip(self.names, self.split(row)))
            cnn = {n[len(self.cnn_prefix):]: t for n, t in params.items()
                   if n.startswith(self.cnn_prefix)}
            feats = functional_call(self.cnn, cnn, (x,))
            return functional_call(self.lobe, params, (x,), {"features": feats}), feats
        with vmap_ready(self.lobe):
            logits, self.feats = vmap(one, randomness="same")(flat)
        return logits

    def losses(self, runs, logits, leaf, lengths=None):
        """``CEA.loss`` of each run (its stage's terms; stage 2: its own CNN features)."""
        return torch.stack([CEA.loss(SimpleNamespace(
            _stage2=self.stage2, _feats=None if self.feats is None else self.feats[j],
            em_coef=self.em_coef[r], temperature=self.temperature[r], tc_coef=self.tc_coef[r],
            blank_id=self.blank_id), logits[j]) for j, r in enumerate(runs)]), None, None

    # ------------------------------------------------------------- the two stages
    def adapt(self, runs: List[int], x: torch.Tensor) -> None:
        super().adapt(runs, x)                               # stage 1
        idx = self.rows_index(runs)
        self.second.P.index_copy_(0, idx, self.fast.P.index_select(0, idx)
                                  .index_select(1, self.cols))
        self.stage2 = True
        try:
            for n in range(max(self.steps2[r] for r in runs)):
                now = [r for r in runs if n < self.steps2[r]]
                self.step(now, x, grads=False, left=min(self.steps2[r] for r in now) - n)
        finally:
            self.stage2, self.feats = False, None

    def graph_key(self):
        return (self.stage2,)

    def device_tensors(self):
        return super().device_tensors() + self.second.tensors() + [self.cols]

    def advance(self, runs) -> None:
        (self.second if self.stage2 else self.fast).advance(runs)

    @torch.no_grad()
    def apply(self, runs, grad, finite) -> None:
        if not self.stage2:
            return super().apply(runs, grad, finite)
        self.second.move(runs, grad.index_select(1, self.cols), finite)
        idx = self.rows_index(runs)
        rows = self.fast.P.index_select(0, idx)
        rows.index_copy_(1, self.cols, self.second.P.index_select(0, idx))
        self.fast.P.index_copy_(0, idx, rows)

    def reset(self, runs: List[int]) -> None:
        """Back to the source, both optimisers' moments zeroed (every utterance: episodic)."""
        super().reset(runs)
        self.second.zero_moments(runs)
