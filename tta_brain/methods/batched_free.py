"""R runs of one backprop-free method (``lame``, ``t3a``, ``foa``, ``ebats``) as one batch over one
shared model: the frozen prefix of an utterance once for every run, the runs' candidates of a
CMA-ES generation through the rest of the network as one forward, each run's fitness, search
state and reset policy its own.

A backprop-free method never changes the model and keeps what it learns on the host (CMA-ES and
its T-EMA, the best prompt, T3A's supports), so a run here is its own built method, moved onto the
batch's model (``FreeMethod.share_model``); :class:`FreeView` is the run as its Brain sees it. Per
utterance, for the runs at it: each run's ``begin`` (episodic: its reset; continual: its policy's
check), the prefix once (``FreeMethod.prefix`` reads no setting of a run), the LII losses of the
runs whose dynamic reset tests after the utterance (from that prefix; CMA-ES methods: each run's
phi_D and start as two candidates, all runs in one forward), then

* CMA-ES methods (``foa``, ``ebats``): the runs' ``search`` generators in lock-step; at each
  generation the candidates of the runs still searching (E-BATS stops a run early on its own)
  go through ``candidates_forward`` as one batch (``population_batch`` > 0: that many candidates
  per run and forward), and each run ``score``s its own slice;
* ``lame``, ``t3a`` (no candidates; the prefix is the whole frozen pass): each run's ``adapt``;

then each run's transcript and ``end`` (its policy after the utterance). Nothing here is captured
as a CUDA graph (no step: the work between generations is the host's CMA-ES). The transcripts are
the separate runs' (a candidate's forward differs from its separate run's only in the batch it
rides in, by last bits; the CMA-ES ranks and early stops came out the same in the tests).
"""
from contextlib import nullcontext
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from tta_brain.methods.batched import RunView, check_runs, lii_testers, run_blocker
from tta_brain.methods.ebats import EBATS
from tta_brain.methods.foa import FOA
from tta_brain.methods.free import FreeMethod
from tta_brain.methods.lame import LAME
from tta_brain.methods.t3a import T3A

__all__ = ["BatchedFree", "FreeView"]


def _rows(out, a: int, b: int):
    """Rows ``a:b`` of every tensor of ``out`` (a tensor, or tuples / lists of them)."""
    if isinstance(out, torch.Tensor):
        return out[a:b]
    return type(out)(_rows(o, a, b) for o in out)


def _cat(parts):
    """``parts`` (outputs of the same structure) joined along their first dimension."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return type(parts[0])(_cat([p[i] for p in parts]) for i in range(len(parts[0])))


class FreeView:
    """One run of a :class:`BatchedFree`, seen as its method (what ``TTABrain`` and its
    checkpoint use): its state, counts and events are its method's own."""

    def __init__(self, batch: "BatchedFree", r: int, method: FreeMethod):
        self.batch, self.r, self.method = batch, r, method
        self.name, self.episodic, self.lobe = method.name, method.episodic, batch.lobe
        self.num_adapted = method.num_adapted
        self.hyp: Optional[str] = None          # set by the batch, returned by process

    @property
    def counts(self):
        return self.method.counts

    @property
    def events(self):
        return self.method.events

    @events.setter
    def events(self, value):
        self.method.events = value

    def describe(self) -> str:
        return self.method.describe() + f"; batched run {self.r + 1} of {self.batch.R}"

    def warnings(self, n_utts: int, boundaries=None) -> List[str]:
        return self.method.warnings(n_utts, boundaries)

    def end_warnings(self) -> List[str]:
        return self.method.end_warnings()

    process = RunView.process          # the transcript the batch computed for this utterance

    def state_dict(self):
        return self.method.state_dict()

    def load_state_dict(self, sd):
        self.method.load_state_dict(sd)


class BatchedFree:
    """R runs of one backprop-free method on ``lobe`` (the model of ``methods[0]``); ``methods``:
    the runs' built methods (each checked by :meth:`blocker`; one method, one
    ``population_batch``), moved onto ``lobe``."""

    methods = (LAME, T3A, FOA, EBATS)
    capturable = False
    not_captured = "backprop-free: no step to capture (its search lives on the host)"
    graphs = None

    @classmethod
    def blocker(cls, m) -> Optional[str]:
        """Why a built method cannot be one run of this batch (None: it can)."""
        return run_blocker(cls.methods, m) or (
            None if m.shared_prefix else
            "shared_prefix false (a batch computes each utterance's prefix once for all runs)")

    def __init__(self, lobe, methods: Sequence[FreeMethod]):
        first = methods[0]
        for i, m in check_runs(self, methods):
            if m.population_batch != first.population_batch:
                raise ValueError(f"run {i + 1}: population_batch differs from run 1's")
        self.lobe, self.R, self.runs = lobe, len(methods), list(methods)
        for m in methods:
            m.share_model(lobe)
        self.population = type(first).candidates_forward is not FreeMethod.candidates_forward
        self.population_batch = first.population_batch
        self.views = [FreeView(self, r, m) for r, m in enumerate(methods)]
        self.stats = {"forwards": 0, "candidates": 0, "lii_losses": 0, "lii_forwards": 0}
        self.serving = nullcontext          # as BatchedSUTA's: run r's records, its log alone

    def work(self) -> str:
        """What the batch's candidate forwards came to (the sweep logs it at the end)."""
        f, c = self.stats["forwards"], self.stats["candidates"]
        n, k = self.stats["lii_losses"], self.stats["lii_forwards"]
        return (f"{c} candidates in {f} forwards ({c / f:.1f} per forward)" if f else
                "no candidate forwards (the runs share each utterance's whole pass)") + (
            f"; dynamic-reset LII losses: {n} in {k} forwards" if n else "")

    @torch.no_grad()
    def process(self, runs: List[int], wav: torch.Tensor, info) -> None:
        """One utterance for ``runs`` (each run's view's ``hyp`` is set): ``TTAMethod.process``
        of each, their adaptations batched."""
        ms = [self.runs[r] for r in runs]
        try:
            x = [self._as(r, m.begin, wav, info, False) for r, m in zip(runs, ms)][0]  # one input
            with ms[0].runtime.autocast(self.lobe.device.type):
                ctx = ms[0].prefix(x)
                self.lii_ahead(ms, ctx)
                logits = (self.search(ms, x, ctx, runs) if self.population
                          else [m.adapt(x, ctx) for m in ms])
                hyps = [self.lobe.decode(lg)[0] for lg in logits]
            for r, m in zip(runs, ms):
                self._as(r, m.end, x)
        finally:
            for m in ms:
                m.features.clear()
        for r, m, hyp in zip(runs, ms, hyps):
            m.t += 1
            self.views[r].hyp = hyp

    def _as(self, r: int, fn, *args):
        """``fn(*args)`` of run ``r``, its records logged as run r's (:attr:`serving`)."""
        with self.serving(r):
            return fn(*args)

    def lii_ahead(self, ms: List[FreeMethod], ctx) -> None:
        """For the continual runs whose reset policy computes an LII after this utterance: their
        losses at their phi_D and at the start (``loss_with`` answers from them), from the
        utterance's one prefix; CMA-ES methods' as two candidates per run in one forward (a
        separate run: a forward per loss). Counted as a separate run counts them."""
        want = lii_testers(ms)
        if not want:
            return
        self.stats["lii_losses"] += 2 * len(want)
        if not self.population:                         # the prefix is the whole pass
            for m in want:
                m.early_losses = m.lii_losses(ctx)
            return
        cands = [np.stack([m.lii_candidate(m.reset_policy.phi_D), m.lii_candidate(None)])
                 for m in want]
        answers, forwards = self.evaluate(want, ctx, cands)
        self.stats["lii_forwards"] += forwards
        for m, (fit, _) in zip(want, answers):
            m.early_losses = {"phi_D": fit[0], "source": fit[1]}

    def search(self, ms: List[FreeMethod], x: torch.Tensor, ctx,
               runs: Optional[List[int]] = None) -> List[torch.Tensor]:
        """The runs' searches in lock-step; each run's transcript logits ``[1, F, V]``. Each
        search's code runs as its run's (``runs``: what it logs, E-BATS's step-size warning, is
        in that run's log.txt alone)."""
        searches = [m.search(x, ctx) for m in ms]
        asked, logits = {}, [None] * len(ms)

        def advance(j, answer):
            try:
                with self.serving(runs[j]) if runs is not None else nullcontext():
                    asked[j] = next(searches[j]) if answer is None else searches[j].send(answer)
            except StopIteration as done:
                asked.pop(j, None)
                logits[j] = done.value

        for j in range(len(ms)):
            advance(j, None)
        while asked:
            js = sorted(asked)
            now, cands = [ms[j] for j in js], [np.asarray(asked[j]) for j in js]
            answers, forwards = self.evaluate(now, ctx, cands)
            self.stats["forwards"] += forwards
            self.stats["candidates"] += sum(len(c) for c in cands)
            for j, m, c, answer in zip(js, now, cands, answers):
                m.counts["adapt_forward"] += len(c)
                advance(j, answer)
        return logits

    def evaluate(self, ms: List[FreeMethod], ctx, cands) -> Tuple[List[tuple], int]:
        """The candidates of the runs ``ms`` (one array each) as one forward (or
        ``population_batch`` per run at a time): each run's ``(fitness, [logits])``, and how
        many forwards that took (the callers count them)."""
        arrays = [np.asarray(c) for c in cands]
        z = torch.as_tensor(np.concatenate(arrays), dtype=torch.float32, device=self.lobe.device)
        step = self.population_batch * len(ms) or len(z)
        parts = [ms[0].candidates_forward(ctx, z[i:i + step]) for i in range(0, len(z), step)]
        out = parts[0] if len(parts) == 1 else _cat(parts)
        answers, a = [], 0
        for m, arr in zip(ms, arrays):
            fit, logits = m.score(_rows(out, a, a + len(arr)))
            answers.append((fit, [logits]))
            a += len(arr)
        return answers, len(parts)
