"""R runs of ``sar`` as one batch (:class:`BatchedSUTA` with SAR's sharpness-aware step).

Per step, as ``SAR.device_body`` for each run: pass 1's entropy over its own non-blank frames,
filtered with its E0; its gradient moves the run's row to ``theta + rho g / ||g||`` (no ascent
after a stopped pass 1); pass 2 at those rows (a separate leaf: the runs' rows themselves never
move, so they stay ``theta`` exactly, as SAR's SAM restores it) over pass 1's frames, filtered
again; the runs whose passes were both
kept take their AdamW step with pass 2's gradient; each run's loss EMA (float64, on the device)
follows its updates. The verdicts (filter and skip records, pass counts) and the EMAs are read
with the transcripts; a run whose EMA fell below its ``reset_constant`` recovers (model and
optimiser to the source, a ``reset`` with reason ``recovery``) before its reset policy's hooks.
The step is device work only (``step_body``), so on CUDA it is captured as the other batches'
are (``tta_brain.gpu.batch_graphs``), on length buckets too (its entropies over the valid frames,
as ``SAR.device_body``'s): with SAR's one step per utterance only buckets replay it.
"""
import logging
import math
from functools import partial
from typing import Dict, List, Optional

import torch

from tta_brain.methods import losses
from tta_brain.methods.batched import BatchedSUTA, upload
from tta_brain.methods.sar import SAR

logger = logging.getLogger(__name__)

__all__ = ["BatchedSAR"]


class BatchedSAR(BatchedSUTA):
    methods = (SAR,)

    def __init__(self, lobe, methods):
        super().__init__(lobe, methods)
        dev = self.P.device
        self.e_margin = upload([m.e_margin for m in methods], torch.float64, dev)
        self.rho = upload([m.rho for m in methods], self.P.dtype, dev)
        self.loss_ema = upload([m.loss_ema for m in methods], torch.float64, dev)
        self.temperature = [m.temperature for m in methods]
        self.reset_constant = [m.reset_constant for m in methods]
        self.ema = torch.zeros(self.R, dtype=torch.float64, device=dev)
        self.ema_on = torch.zeros(self.R, dtype=torch.bool, device=dev)
        for v, m in zip(self.views, methods):     # what SAR.step_notes reads and writes
            v.e_margin, v.ema = m.e_margin, None

    def _entropy(self, runs, logits, paths, lengths=None):
        return torch.stack([losses.entropy_loss(logits[j], lengths, temperature=self.temperature[r],
                                                blank_id=self.blank_id, path=paths[j]).mean()
                            for j, r in enumerate(runs)])

    def device_tensors(self) -> List[torch.Tensor]:
        return super().device_tensors() + [self.e_margin, self.rho, self.loss_ema, self.ema,
                                           self.ema_on]

    def settler(self, runs: List[int], update: bool):
        return partial(self._settle_sam, runs)

    def step_body(self, runs: List[int], x: torch.Tensor, update: bool = True,
                  samples: Optional[torch.Tensor] = None):
        """One SAM step of ``runs`` (device work only, state in place: captured as the base
        step is, on length buckets too, its entropies over the valid frames): the mask of the
        runs that updated, pass 2's gradient rows and the verdicts :meth:`_settle_sam` reads."""
        e_margin, rho = self._rows(self.e_margin, runs), self._rows(self.rho, runs)
        lengths = self.frames_of(samples)
        rows = self.fast.rows(runs)
        leaf = rows.detach().requires_grad_(True)
        logits = self.logits(leaf, x, samples)
        paths = logits.detach().argmax(-1)                 # pass 1's frames serve pass 2 too
        h1 = self._entropy(runs, logits, paths, lengths)
        v1 = h1.detach()
        out1 = v1.double() >= e_margin                     # filtered (nan is not: a skip)
        ran1 = ~out1 & v1.isfinite()                       # pass 1's backward ran
        g1 = self.backward(torch.where(ran1, h1, torch.zeros_like(h1)).sum(), leaf)
        ok1 = ran1 & g1.isfinite().all(dim=1)
        with torch.no_grad():                              # SAM's ascent, per row
            norm = torch.stack([t.norm(dim=1) for t in g1.split(self.numels, dim=1)], 1)
            eps = g1 * (rho / (norm.norm(dim=1) + 1e-12))[:, None]
            eps = torch.where(ok1[:, None], eps, torch.zeros_like(eps))
            shifted = rows + eps
        leaf2 = shifted.detach().requires_grad_(True)
        h2 = self._entropy(runs, self.logits(leaf2, x, samples), paths, lengths)
        v2 = h2.detach()
        out2 = ok1 & (v2.double() >= e_margin)
        ran2 = ok1 & ~out2 & v2.isfinite()
        g2 = self.backward(torch.where(ran2, h2, torch.zeros_like(h2)).sum(), leaf2)
        done = ran2 & g2.isfinite().all(dim=1)
        with torch.no_grad():
            if update:
                self.apply(runs, g2, done)
            a, ema, on = (self._rows(t, runs) for t in (self.loss_ema, self.ema, self.ema_on))
            value2 = v2.double()
            new = torch.where(on, a * ema + (1 - a) * value2, value2)
            ema, on = torch.where(done, new, ema), on | done
            self._put_rows(self.ema, runs, ema)
            self._put_rows(self.ema_on, runs, on)
        verdict = SAR.verdicts(v1, out1, ~ok1, v2, out2, ok1 & ~out2 & ~done)
        return done, g2, self.pack([verdict, torch.where(ok1, v2, v1), ran1, ok1, ran2, ema, on])

    def _settle_sam(self, runs: List[int], block) -> None:
        """A SAM step's values (:meth:`step_body`) on the host: the passes' counts; the filter
        and skip records and the EMA as SAR's own (``SAR.step_notes``, on the run's view)."""
        verdict, value, ran1, ok1, ran2, ema, on = block
        for j, r in enumerate(runs):
            v = self.views[r]
            v.counts["adapt_forward"] += int(ok1[j])                   # pass 2's forward
            v.counts["adapt_backward"] += int(ran1[j]) + int(ran2[j])
            with self.serving(r):
                SAR.step_notes(v, [[0.0, verdict[j], value[j], ema[j] if on[j] else math.nan]])

    def after(self, views, x, info) -> None:
        """SAR's model recovery (after the prediction, before the reset policy's hooks)."""
        for v in views:
            ema = v.ema
            if ema is not None and ema < self.reset_constant[v.r]:
                v.counts["recoveries"] += 1
                with self.serving(v.r):
                    logger.info("sar: loss EMA %.4f < %g after %s: model recovery", ema,
                                self.reset_constant[v.r], info.id)
                    v.reset_meta(v.t + 1, info.position + 1, "recovery")
        super().after(views, x, info)

    @torch.no_grad()
    def reset(self, runs: List[int]) -> None:
        """Runs back to the source; their loss EMAs cleared."""
        super().reset(runs)
        idx = self.rows_index(runs)
        self.ema.index_fill_(0, idx, 0.0)
        self.ema_on.index_fill_(0, idx, False)
        for r in runs:
            self.views[r].ema = None

    # ------------------------------------------------------------- SAR's checkpoint format
    def state_dict(self, r: int) -> Dict:
        return super().state_dict(r) | {"ema": self.views[r].ema}

    @torch.no_grad()
    def load_state_dict(self, r: int, sd: Dict) -> None:
        super().load_state_dict(r, sd)
        ema = sd.get("ema")
        self.views[r].ema = ema
        self.ema[r] = 0.0 if ema is None else float(ema)
        self.ema_on[r] = ema is not None
