"""R runs of a pseudo-label method as one batch: ``sdpl`` (CTC on the greedy label of the
step's own logits) and ``sgem`` (Renyi entropy on the frames of the beam search's best path,
negative sampling, a cosine lr schedule over the steps), both episodic.

They are :class:`~tta_brain.methods.batched.BatchedSUTA` with another step loss: the runs'
forward and backward are one batched pass, each run's AdamW row its own, and each run's loss
takes its own pseudo label from its own logits (the label's module function, with the run's
settings: ``sdpl.greedy_label_loss``, ``sgem.best_path`` / ``sgem_loss``); SGEM's lr of each
step is each run's own (``sgem.annealed_lr``: its lr, lr_min and step count). The labels are
made on the host every step (a collapse, a beam search), so a step reads the device and is never
captured as a CUDA graph.
"""
from functools import partial
from typing import List

from tta_brain.methods.batched import BatchedSUTA, tensor_lrs, upload
from tta_brain.methods.sdpl import SDPL, greedy_label_loss
from tta_brain.methods.sgem import SGEM, annealed_lr, best_path, sgem_loss

__all__ = ["BatchedSDPL", "BatchedSGEM"]


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
    """R runs of ``sdpl`` (eval mode: ``train_mode`` is refused by the blocker)."""

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
