"""R runs of a pseudo-label method as one batch: ``sdpl`` (CTC on the greedy label of the
step's own logits) and ``sgem`` (Renyi entropy on the frames of the beam search's best path,
negative sampling, a cosine lr schedule over the steps), both episodic, and ``awmc`` (CTC on the
anchor's and the leader's greedy labels; continual, each run's leader a row).

They are :class:`~tta_brain.methods.batched.BatchedSUTA` with another step loss: the runs'
forward and backward are one batched pass, each run's AdamW row its own, and each run's loss
takes its own pseudo label from its own logits (the label's module function, with the run's
settings: ``sdpl.greedy_label_loss``, ``sgem.best_path`` / ``sgem_loss``); SGEM's lr of each
step is each run's own (``sgem.annealed_lr``: its lr, lr_min and step count). AWMC's anchor label
is the source's, one pass for all runs; its leaders' labels one batched pass a step. The labels are
made on the host every step (a collapse, a beam search), so a step reads the device and is never
captured as a CUDA graph.
"""
from functools import partial
from typing import Dict, List

import torch

from tta_brain.asr.ctc import greedy_labels
from tta_brain.methods.awmc import AWMC, pseudo_label_loss
from tta_brain.methods.batched import BatchedSUTA, tensor_lrs, upload
from tta_brain.methods.sdpl import SDPL, greedy_label_loss
from tta_brain.methods.sgem import SGEM, annealed_lr, best_path, sgem_loss

__all__ = ["BatchedSDPL", "BatchedSGEM", "BatchedAWMC"]


def _sdpl_loss(blank_id, logits, lengths=None):
    return greedy_label_loss(logits, blank_id)


def _sgem_loss(opts, logits, lengths=None):
    beam_width, blank_id, lm_search, rest = opts
    return sgem_loss(logits, best_path(logits, beam_width, blank_id, lm_search),
                     blank_id=blank_id, **rest)


class HostLabelBatch(BatchedSUTA):
    """A batch whose step loss (``step_loss(method)``: a function of one run's logits) makes a
    pseudo label on the host: never captured, no length buckets."""

    capturable = False
    masks_padding = False

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        self.step_losses = [self.step_loss(m) for m in methods]

    @staticmethod
    def step_loss(m):
        raise NotImplementedError


class BatchedSDPL(HostLabelBatch):
    """R runs of ``sdpl`` (eval mode: ``train_mode`` only where the model's train mode draws
    nothing, ``batched.train_mode_blocker``)."""

    methods = (SDPL,)
    not_captured = "its pseudo labels are made on the host every step"

    @staticmethod
    def step_loss(m):
        return partial(_sdpl_loss, m.blank_id)


class BatchedSGEM(HostLabelBatch):
    """R runs of ``sgem``; each its own beam width, LM search, loss weights and lr schedule."""

    methods = (SGEM,)
    not_captured = "its pseudo paths are beam searches on the host every step"

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        self.schedules = [(tensor_lrs(m.optimizer, m.params).tolist(), m.lr, m.lr_min)
                          for m in methods]

    @staticmethod
    def step_loss(m):
        return partial(_sgem_loss, (m.beam_width, m.blank_id, m.lm_search, dict(
            renyi_alpha=m.renyi_alpha, temperature=m.temperature, ns_threshold=m.ns_threshold,
            ns_coef=m.ns_coef)))

    def before_step(self, runs: List[int], n: int) -> None:
        """Each run's lr of step ``n`` (``SGEM.before_step``: cosine over its own steps)."""
        lrs = [[annealed_lr(base, lr, lr_min, n, self.views[r].steps) for base in bases]
               for r in runs for bases, lr, lr_min in [self.schedules[r]]]
        idx = self.fast.rows_index(runs)
        self.fast.lr.index_copy_(0, idx, upload(lrs, self.fast.lr.dtype, self.fast.lr.device))


class BatchedAWMC(HostLabelBatch):
    """R runs of ``awmc`` (continual, any reset policy), each its own lr, steps and
    ``ema_decay``. Per utterance, as ``AWMC`` for each run: the anchor's label (the source's:
    one pass for all runs), then per step the labels of the runs' leaders (one batched pass of
    their leader rows), the chaser's step on the mean of the two CTC losses, and each leader's
    EMA towards its chaser. The transcript is the chaser's. ``train_mode`` (AWMC's default)
    only where the model's train mode draws nothing (``batched.train_mode_blocker``): a real
    checkpoint's dropout is refused, and such runs go separately."""

    methods = (AWMC,)
    not_captured = "its pseudo labels are made on the host every step"

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        self.leader = self.fast.init.repeat(self.R, 1)
        self.ema_weight = upload([1 - m.ema_decay for m in methods], self.P.dtype, self.P.device)
        self.labels: Dict[int, tuple] = {}     # this step's (anchor, leader) labels of each run

    @staticmethod
    def step_loss(m):
        return None                            # the labels change every step: see losses

    @torch.no_grad()
    def _labels(self, rows: torch.Tensor, x: torch.Tensor) -> List[List[torch.Tensor]]:
        """Each row's greedy label of ``x`` (``AWMC._labels``, on the device)."""
        return [greedy_labels(lg, self.blank_id) for lg in self.logits(rows, x)]

    def adapt(self, runs: List[int], x: torch.Tensor) -> None:
        (anchor,) = self._labels(self.source[None], x)
        for r in runs:
            self.views[r].counts["aux_forward"] += 1
        for n in range(max(self.views[r].steps for r in runs)):
            now = [r for r in runs if n < self.views[r].steps]
            for r, leader in zip(now, self._labels(self._rows(self.leader, now), x)):
                self.labels[r] = (anchor, leader)
                self.views[r].counts["aux_forward"] += 1
            self.step(now, x)
            with torch.no_grad():              # every leader follows, a skipped step too
                self._put_rows(self.leader, now, torch.lerp(
                    self._rows(self.leader, now), self.fast.rows(now),
                    self._rows(self.ema_weight, now)[:, None]))
        self.labels = {}

    def losses(self, runs, logits, leaf, lengths=None):
        loss = torch.stack([pseudo_label_loss(logits[j], *self.labels[r], self.blank_id)
                            for j, r in enumerate(runs)])
        return loss, None, None

    # ------------------------------------------------------------- state
    @torch.no_grad()
    def reset(self, runs: List[int]) -> None:
        """Chasers, their moments and leaders back to the source."""
        super().reset(runs)
        self.leader.index_copy_(0, self.rows_index(runs), self.fast.init.expand(len(runs), -1))

    def state_dict(self, r: int) -> Dict:
        return super().state_dict(r) | {"leader": [t.clone() for t in self.split(self.leader[r])]}

    @torch.no_grad()
    def load_state_dict(self, r: int, sd: Dict) -> None:
        super().load_state_dict(r, sd)
        self.leader[r] = self.flat(sd["leader"])
