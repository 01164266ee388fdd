"""R runs of ``cotta`` as one batch: every weight of each run a row, its teacher a row, its own
random generators (the runs may differ in ``seed``: a sweep over the seeds of a stochastic method).

Per utterance, as ``CoTTA`` for each run: the anchor (the source: one forward for all runs, one
host read) against the run's ``ap_threshold``; the teacher's output, plain (the runs' teacher rows,
one batched pass) or the mean of ``n_augment`` views whose noise the run's own augmentation
generator draws, in its order (each view one batched pass over the augmenting runs, every row with
its own input); per step the student's symmetric cross-entropy to its teacher, its AdamW step, the
teacher's EMA where the step updated with a loss > 0 (masked on the device), and the stochastic
restore, whose indices the run's own restore generator draws on the host; each step takes its
teacher's output anew. The transcript is the teacher's output from before the last update. Each run's generators are in its checkpoint, as CoTTA's.
"""
import logging
import warnings
from types import SimpleNamespace
from typing import Dict, List

import torch

from tta_brain.methods import losses
from tta_brain.methods.batched import BatchedSUTA, to_device, upload
from tta_brain.methods.cotta import CoTTA, augmented_view

logger = logging.getLogger(__name__)

__all__ = ["BatchedCoTTA"]


class BatchedCoTTA(BatchedSUTA):
    methods = (CoTTA,)
    capturable = False
    not_captured = "each utterance's teacher outputs are new tensors"

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        dev = self.P.device
        self.teacher = self.fast.init.repeat(self.R, 1)
        self.ema_weight = upload([1 - m.ema_decay for m in methods], self.P.dtype, dev)
        self.ap_threshold = [m.ap_threshold for m in methods]
        self.n_augment = [m.n_augment for m in methods]
        self.noise = [m.noise for m in methods]
        self.aug_gen = [m.aug_gen for m in methods]
        # what CoTTA.restore_indices reads of its method (the tensors' shapes, not the tensors)
        shapes = [torch.empty(s, device="meta") for s in self.shapes]
        self.restorers = [SimpleNamespace(params=shapes, restore_mask=m.restore_mask,
                                          restore_prob=m.restore_prob, seed=m.seed,
                                          restore_gen=m.restore_gen, _fixed=None)
                          for m in methods]
        self.offsets = torch.tensor([0] + self.numels[:-1]).cumsum(0).tolist()
        self.fixed = [None] * self.R
        self.targets: Dict[int, torch.Tensor] = {}    # this utterance's teacher outputs
        self.wav = None
        if any("weight_g" in n or "parametrizations" in n for n in self.names):
            logger.info("batched cotta: the weight-normed convolution runs row by row (torch has "
                        "no vmap batching rule for _weight_norm)")

    def logits_each(self, flat, x, x_dim=0, samples=None):
        """As the batch's; the positional convolution's weight norm (adapted here, as every
        weight) runs row by row, as torch has no batching rule for it: its warning is said once,
        in the log, not on every pass."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*batching rule for aten::_weight_norm")
            return super().logits_each(flat, x, x_dim, samples)

    @torch.enable_grad()
    def process(self, runs: List[int], wav: torch.Tensor, info) -> None:
        self.wav = wav                          # the augmented views noise the raw waveform
        super().process(runs, wav, info)

    # ------------------------------------------------------------- the teacher
    @torch.no_grad()
    def teach(self, runs: List[int], x: torch.Tensor, early=()) -> None:
        """Each run's teacher output for ``x`` (``CoTTA.teacher_logits``), with its counts (the
        runs in ``early`` take it for a step before their last: an auxiliary forward)."""
        anchor = self.logits(self.source[None], x)[0]
        confident = float(anchor.softmax(-1).max(-1).values.mean())      # the host read
        plain = [r for r in runs if confident >= self.ap_threshold[r] or self.n_augment[r] < 1]
        noisy = [r for r in runs if r not in plain]
        for r in runs:
            self.views[r].counts["aux_forward"] += 2 if r in early else 1
        if plain:
            out = self.logits(self._rows(self.teacher, plain), x)
            self.targets.update((r, out[j]) for j, r in enumerate(plain))
        wav = self.wav.reshape(-1).float().cpu()
        views = {r: [] for r in noisy}
        for k in range(max([self.n_augment[r] for r in noisy], default=0)):
            now = [r for r in noisy if k < self.n_augment[r]]
            # the runs' k-th views, drawn on the host, one upload, each prepared as prepare does
            raw = torch.stack([augmented_view(wav, self.aug_gen[r], self.noise[r]) for r in now])
            xs = self.lobe.prepare_each(raw if self.lobe.filterbank
                                        else to_device(raw, self.P.device))
            out = self.logits_each(self._rows(self.teacher, now), xs)
            for j, r in enumerate(now):
                views[r].append(out[j])
        for r in noisy:
            self.targets[r] = torch.stack(views[r]).mean(0)
            self.views[r].counts["augmented"] += 1
            self.views[r].counts["aux_forward"] += self.n_augment[r] - 1

    # ------------------------------------------------------------- the student
    def adapt(self, runs: List[int], x: torch.Tensor) -> None:
        last = {r: max(self.views[r].steps, 1) - 1 for r in runs}
        for n in range(max(last.values()) + 1):
            now = [r for r in runs if n <= last[r]]
            self.teach(now, x, early=[r for r in now if n < last[r]])
            now = [r for r in now if n < self.views[r].steps]
            if now:
                done, _ = self.step(now, x)
                self._follow(now, done)

    def losses(self, runs, logits, leaf, lengths=None):
        loss = torch.stack([losses.symmetric_cross_entropy_loss(
            logits[j], self.targets[r], blank_id=self.blank_id).mean()
            for j, r in enumerate(runs)])
        self.last_loss = loss.detach()
        return loss, None, None

    @torch.no_grad()
    def _follow(self, runs: List[int], done: torch.Tensor) -> None:
        """After a step: the teacher's EMA where the run updated with a loss > 0, then each run's
        stochastic restore of its student."""
        teacher, student = self._rows(self.teacher, runs), self.fast.rows(runs)
        moved = torch.lerp(teacher, student, self._rows(self.ema_weight, runs)[:, None])
        keep = (done & (self.last_loss > 0))[:, None]
        self._put_rows(self.teacher, runs, torch.where(keep, moved, teacher))
        for r in runs:
            flat = self._restore_indices(r)
            self.fast.P[r].index_copy_(0, flat, self.source.index_select(0, flat))

    def _restore_indices(self, r: int) -> torch.Tensor:
        """Run ``r``'s restore indices for this step along its row (``CoTTA.restore_indices``)."""
        if self.fixed[r] is not None:
            return self.fixed[r]
        local = CoTTA.restore_indices(self.restorers[r])
        flat = to_device(torch.cat([i + o for i, o in zip(local, self.offsets)]), self.P.device)
        if self.restorers[r].restore_mask == "fixed":
            self.fixed[r] = flat
        return flat

    def prediction(self, runs: List[int], x: torch.Tensor) -> torch.Tensor:
        """The teacher's outputs from before the last update (CoTTA's transcript)."""
        return torch.stack([self.targets.pop(r) for r in runs])

    # ------------------------------------------------------------- state
    @torch.no_grad()
    def reset(self, runs: List[int]) -> None:
        """Students and teachers back to the source (the generators go on, as CoTTA's)."""
        super().reset(runs)
        idx = self.rows_index(runs)
        self.teacher.index_copy_(0, idx, self.fast.init.expand(len(runs), -1))

    def state_dict(self, r: int) -> Dict:
        return super().state_dict(r) | {
            "teacher": [t.clone() for t in self.split(self.teacher[r])],
            "aug_gen": self.aug_gen[r].get_state(),
            "restore_gen": self.restorers[r].restore_gen.get_state()}

    @torch.no_grad()
    def load_state_dict(self, r: int, sd: Dict) -> None:
        super().load_state_dict(r, sd)
        self.teacher[r] = self.flat(sd["teacher"])
        self.aug_gen[r].set_state(sd["aug_gen"])
        self.restorers[r].restore_gen.set_state(sd["restore_gen"])
