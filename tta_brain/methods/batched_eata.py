"""R runs of ``eata`` as one batch (:class:`BatchedSUTA` plus EATA's sample filter and Fisher term).

Each run keeps its own filter state on the device (the EMA ``m`` of its kept utterances' mean
posteriors and whether it has started: ``probs [R, V]``, ``started [R]``) and its own margins
(``e_margin_factor``, ``d_margin``, ``probs_ema``) and Fisher weight; the Fisher information is the
statistics file's, one for the batch. Per step, as ``EATA.loss`` for each run: the entropy of its
logits, its verdict (unreliable, redundant or kept) and its EMA update, decided on the device; a
dropped run's update is masked there and its filter record (``EATA.filtered``) is written when the
transcripts are read; a kept run's loss adds ``fisher_alpha * sum F (theta - theta0)^2`` of its row.
"""
from types import SimpleNamespace
from typing import Dict, List

import torch

from tta_brain.methods.batched import BatchedSUTA, RunView
from tta_brain.methods.eata import EATA

__all__ = ["BatchedEATA"]


class _Noted:
    """What ``EATA.loss`` notes with its step filter (the drop flag and the values)."""

    def note(self, drop: torch.Tensor, values: torch.Tensor) -> None:
        self.drop, self.values = drop, values


class BatchedEATA(BatchedSUTA):
    methods = (EATA,)

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        stats = {m.stats_path for m in methods if m.fisher is not None}
        if len(stats) > 1:
            raise ValueError("the runs' Fisher statistics files differ: " + ", ".join(sorted(stats)))
        fisher = next((m.fisher for m in methods if m.fisher is not None), None)
        self.fisher = None if fisher is None else self.flat(fisher)
        self.fisher_alpha = [m.fisher_alpha if m.fisher is not None else 0.0 for m in methods]
        self.temperature = [m.temperature for m in methods]
        self.e_margin = [m.e_margin for m in methods]
        self.d_margin = [m.d_margin for m in methods]
        self.probs_ema = [m.probs_ema for m in methods]
        dev = self.source.device
        self.probs = torch.zeros(self.R, lobe.vocab_size, device=dev)
        self.started = torch.zeros(self.R, dtype=torch.bool, device=dev)
        for v, m in zip(self.views, methods):     # what EATA.filtered reads of its method
            v.e_margin, v.d_margin = m.e_margin, m.d_margin

    def losses(self, runs: List[int], logits: torch.Tensor, leaf: torch.Tensor, lengths=None):
        """``EATA.loss`` of each run on its row (its own filter state: views of the batch's rows,
        updated in place), plus its Fisher term of its row: the losses, the dropped runs, and
        the filter's values ``[verdict, entropy, |cos|]``."""
        penalty = None
        if self.fisher is not None and any(self.fisher_alpha[r] for r in runs):
            terms = (self.fisher * (leaf - self.source) ** 2).split(self.numels, dim=1)
            penalty = torch.stack([t.sum(dim=1) for t in terms], dim=1).sum(dim=1)
        loss, drop, why = [], [], []
        for j, r in enumerate(runs):
            verdict = _Noted()
            h = EATA.loss(SimpleNamespace(
                temperature=self.temperature[r], blank_id=self.blank_id, e_margin=self.e_margin[r],
                d_margin=self.d_margin[r], probs_ema=self.probs_ema[r], _probs=self.probs[r],
                _started=self.started[r], step_filter=verdict, fisher=None), logits[j], lengths)
            drop.append(verdict.drop)
            why.append(verdict.values)
            loss.append(h if not self.fisher_alpha[r] else h + self.fisher_alpha[r] * penalty[j])
        return torch.stack(loss), torch.stack(drop), torch.stack(why)

    def device_tensors(self) -> List[torch.Tensor]:
        return super().device_tensors() + [self.probs, self.started] + (
            [] if self.fisher is None else [self.fisher])

    def filtered(self, view: RunView, values: List[float]) -> None:
        EATA.filtered(view, values)

    @torch.no_grad()
    def reset(self, runs: List[int]) -> None:
        """Runs back to the source; their filters start again."""
        super().reset(runs)
        idx = self.rows_index(runs)
        self.probs.index_fill_(0, idx, 0.0)
        self.started.index_fill_(0, idx, False)

    # ------------------------------------------------------------- EATA's checkpoint format
    def state_dict(self, r: int) -> Dict:
        return super().state_dict(r) | {
            "model_probs": self.probs[r].clone() if bool(self.started[r]) else None}

    @torch.no_grad()
    def load_state_dict(self, r: int, sd: Dict) -> None:
        super().load_state_dict(r, sd)
        probs = sd.get("model_probs")
        self.started[r] = probs is not None
        self.probs[r] = 0.0 if probs is None else probs.to(self.probs)
