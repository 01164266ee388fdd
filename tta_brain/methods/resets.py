"""Reset policies for continual methods (CSUTA, DSUTA, AWMC, EATA, SAR, CoTTA; T3A, FOA, E-BATS
through the backprop-free skeleton), orthogonal to the methods.

A policy sees the stream through four calls made by the method, with ``t`` the 1-based count of
utterances processed so far (Algorithm 2 of the paper):

* ``before_utterance(info)``: reset before adapting this utterance? (oracle boundaries)
* ``after_utterance(t, x, info)``: after the prediction for x_t (dynamic: compute LII_t)
* ``at_update(t)``: the method is about to update its meta-parameters (DSUTA: buffer full);
  a reason string means "reset to the source instead, discard the buffer"
* ``end_step(t)``: end of step t (dynamic: save phi_D at r + K/2, fit the Gaussian at r + K)

and ``on_reset(after)`` whenever the method resets (phi_{after+1} = phi_pre). A policy uses the
method only through ``meta_values()`` (phi_t) and ``loss_with(values, x)`` (L_suta of x with the
adapted parameters set to ``values``; None = source).
"""
import logging
import math
from typing import List, Optional

import torch

from tta_brain.methods.base import Event
from tta_brain.methods.state import restore, snapshot

logger = logging.getLogger(__name__)

__all__ = ["ResetPolicy", "NoReset", "FixedReset", "OracleReset", "DynamicReset",
           "make_reset_policy", "RESET_POLICIES", "z_score", "fit_gaussian"]


def fit_gaussian(values: List[float]):
    """Mean and sample standard deviation (n - 1) of ``values``."""
    n = len(values)
    if n < 2:
        raise ValueError(f"need at least 2 LII values to fit a Gaussian, got {n}")
    mu = sum(values) / n
    var = sum((v - mu) ** 2 for v in values) / (n - 1)
    return mu, math.sqrt(var)


def z_score(values: List[float], mu: float, sigma: float) -> float:
    """z of the mean of ``values`` under N(mu, sigma^2 / n)."""
    n = len(values)
    return (sum(values) / n - mu) / (max(sigma, 1e-12) / math.sqrt(n))


class ResetPolicy:
    name = "none"

    def bind(self, method):
        self.method = method

    def before_utterance(self, info) -> Optional[str]:
        return None

    def after_utterance(self, t: int, x: torch.Tensor, info) -> None:
        pass

    def needs_lii(self, t: int) -> bool:
        """Does ``after_utterance(t, ...)`` compute an LII (two ``loss_with`` calls)?"""
        return False

    def at_update(self, t: int) -> Optional[str]:
        return None

    def end_step(self, t: int) -> None:
        pass

    def on_reset(self, after: int) -> None:
        pass

    def warnings(self, n_utts: int, boundaries=None) -> List[str]:
        """Why this policy cannot act on a stream of ``n_utts`` utterances whose true domain
        boundaries are ``boundaries`` (None: unknown) (logged, summarised)."""
        return []

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


class NoReset(ResetPolicy):
    name = "none"


class FixedReset(ResetPolicy):
    """Reset every ``every`` utterances, checked at meta-update times (RDumb-style)."""
    name = "fixed"

    def __init__(self, every: int = 50):
        self.every = int(every)
        self.last = 0

    def at_update(self, t):
        if t - self.last >= self.every:
            return f"fixed (every {self.every})"
        return None

    def on_reset(self, after):
        self.last = after

    def warnings(self, n_utts, boundaries=None):
        if n_utts <= self.every:
            return [f"fixed reset every {self.every} utterances on a stream of {n_utts}: it never "
                    f"fires (set reset_every below the stream length)"]
        return []

    def state_dict(self):
        return {"last": self.last}

    def load_state_dict(self, sd):
        self.last = sd["last"]


class OracleReset(ResetPolicy):
    """Reset at every true domain boundary (a change of the manifest's ``segment``), wherever it
    falls, before the first utterance of the new segment is adapted."""
    name = "oracle"

    def __init__(self):
        self.prev = None

    def warnings(self, n_utts, boundaries=None):
        if boundaries is not None and not boundaries:
            return ["oracle reset on a stream with one domain block (its manifest's segment, or "
                    "domain, never changes, or it has neither column): it never fires"]
        return []

    def before_utterance(self, info):
        seg, prev = info.segment, self.prev
        self.prev = seg
        if prev is not None and seg != prev:
            return f"oracle boundary ({prev}->{seg}, {info.domain})"
        return None

    def state_dict(self):
        return {"prev": self.prev}

    def load_state_dict(self, sd):
        self.prev = sd["prev"]


class DynamicReset(ResetPolicy):
    """The paper's dynamic reset: LII statistics, a right-tailed z-test and a patience.

    After a reset at r: phi_D = phi at r + floor(K/2) (after that step's update); LII_t =
    L(phi_D, x_t) - L(phi_pre, x_t) is collected for t in (r + K/2, r + K] and a Gaussian
    (mean, sample std) fitted at r + K. Afterwards, at each meta-update the mean LII of the
    utterances since the previous update is tested: z = (mean - mu) / (sigma / sqrt(n)); z >
    ``threshold`` is a detection, ``patience`` consecutive detections reset the model.
    ``test_size`` > 0: a test waits for that many LII values (the meta-updates between go
    untested), so a method that updates after every utterance (n = 1) is tested on the mean of
    ``test_size``, as DSUTA on its buffer of M; 0: the values since the previous update.

    ``lii_count`` says which LII values make the Gaussian: ``paper`` (Algorithm 2: the K - K/2
    values of r + K/2 < t <= r + K) or ``official`` (the official code collects while
    r + K/2 <= t < r + K and saves phi_D at t = r + K/2, so r + K/2 < t < r + K: one value
    fewer; the LII at t = r + K then only counts for detection).
    """
    name = "dynamic"

    def __init__(self, K: int = 100, patience: int = 2, threshold: float = 2.0,
                 lii_count: str = "paper", test_size: int = 0):
        self.lii_count = lii_count
        self.test_size = int(test_size)
        self.K, self.k = int(K), int(K) // 2
        self.patience, self.threshold = int(patience), float(threshold)
        self.phi_D: Optional[List[torch.Tensor]] = None
        self._clear(0)

    def _clear(self, last):
        self.last = last
        self.have_phi_D = False
        self.stats, self.recent = [], []
        self.mu = self.sigma = None
        self.counter = 0
        self.diverged, self.nonfinite = False, 0

    def needs_lii(self, t):
        return self.have_phi_D and t > self.last + self.k

    def after_utterance(self, t, x, info):
        if not self.needs_lii(t):
            return
        m = self.method
        with_phi_D, source = m.loss_with(self.phi_D, x), m.loss_with(None, x)
        lii = with_phi_D - source
        if not math.isfinite(lii):
            self.nonfinite = self.nonfinite + 1 if math.isfinite(source) else 0
            if self.nonfinite >= self.patience and not self.diverged:
                # phi_D (the adapted model at r + K/2) has no finite loss where the source has,
                # on `patience` utterances in a row (not one overflow at fp16): the adaptation
                # diverged (a learning rate too high), skipped steps leave it so, and no LII
                # test can fire on it; every later utterance would be decoded from it (empty
                # transcripts): reset at the next meta-update
                logger.warning("dynamic reset: the adapted model's loss is non-finite at "
                               "utterance %d (%d in a row: it diverged): reset at the next "
                               "meta-update", t, self.nonfinite)
                self.diverged = True
            elif not self.diverged:
                logger.warning("dynamic reset: non-finite LII at utterance %d ignored", t)
            return
        self.nonfinite = 0
        construction = t < self.last + self.K or (t == self.last + self.K
                                                  and self.lii_count == "paper")
        if construction:
            self.stats.append(lii)
        self.recent.append(lii)
        m.events.append(Event("lii", info.position, "construction" if construction else "detection",
                              lii))

    def at_update(self, t):
        values = self.recent
        if self.diverged:
            self.recent = []
            return "dynamic (non-finite loss: the adapted model diverged)"
        if t <= self.last + self.K or self.mu is None or not values:
            self.recent = []
            return None
        if len(values) < self.test_size:        # a test of test_size values: gather on
            return None
        self.recent = []
        z = z_score(values, self.mu, self.sigma)
        self.counter = self.counter + 1 if z > self.threshold else 0
        if self.counter >= self.patience:
            return f"dynamic (z={z:.2f}, {self.counter} detections)"
        return None

    def end_step(self, t):
        if t == self.last + self.k:
            values = self.method.meta_values()
            if self.phi_D is None:
                self.phi_D = snapshot(values)
            else:
                restore(self.phi_D, values)
            self.have_phi_D = True
        if t == self.last + self.K and self.mu is None:
            if len(self.stats) >= 2:
                self.mu, self.sigma = fit_gaussian(self.stats)
                logger.info("dynamic reset: LII ~ N(%.4f, %.4f^2) from %d utterances",
                            self.mu, self.sigma, len(self.stats))
            else:
                logger.warning("dynamic reset: only %d LII values at t=%d; no test this stage",
                               len(self.stats), t)

    def warnings(self, n_utts, boundaries=None):
        out = []
        if n_utts <= self.K:
            low = 5 if self.lii_count == "official" else 4   # the least reset_K accepted (rules)
            use = (f"the stream is too short for any reset_K accepted (at least {low})"
                   if n_utts <= low else
                   f"use {low} <= reset_K < {n_utts}; with DSUTA, whose reset_K must be at "
                   f"least 2 x buffer_size, lower --buffer_size too")
            out.append(f"dynamic reset with reset_K = {self.K} on a stream of {n_utts} "
                       f"utterances: its construction stage (K utterances) does not end before "
                       f"the stream does, so it never tests and never fires ({use})")
        precision = getattr(getattr(getattr(self, "method", None), "runtime", None),
                            "precision", "fp32")
        if precision != "fp32":     # measured: LII values 1e-4..1e-2 apart from fp32's, signs
            out.append(f"dynamic reset in {precision}: the LII is a difference of two losses "
                       f"of {precision} forwards, whose rounding is as large as the LII itself "
                       f"(about 1e-4 to 1e-3), so its test decides partly on rounding; use "
                       f"--precision=fp32 for runs whose resets you compare")
        return out

    def on_reset(self, after):
        self._clear(after)

    def state_dict(self):
        return {k: getattr(self, k) for k in
                ("last", "have_phi_D", "stats", "recent", "mu", "sigma", "counter",
                 "diverged", "nonfinite")} | {
            "phi_D": [p.clone() for p in self.phi_D] if self.phi_D is not None else None}

    def load_state_dict(self, sd):
        for k in ("last", "have_phi_D", "stats", "recent", "mu", "sigma", "counter"):
            setattr(self, k, sd[k])
        self.diverged = sd.get("diverged", False)     # (a state saved before they were kept)
        self.nonfinite = sd.get("nonfinite", 0)
        if sd["phi_D"] is not None:
            self.phi_D = [p.clone() for p in sd["phi_D"]]


RESET_POLICIES = {"none": NoReset, "fixed": FixedReset, "oracle": OracleReset,
                  "dynamic": DynamicReset}


def make_reset_policy(name: str = "none", every: int = 50, K: int = 100, patience: int = 2,
                      threshold: float = 2.0, lii_count: str = "paper",
                      test_size: int = 0) -> ResetPolicy:
    """Build a policy by name (used from yaml: ``reset: dynamic`` + its options)."""
    if name == "fixed":
        return FixedReset(every)
    if name == "dynamic":
        return DynamicReset(K, patience, threshold, lii_count, test_size)
    if name not in RESET_POLICIES:
        raise ValueError(f"make_reset_policy: unknown reset policy {name!r} (one of "
                         f"{', '.join(RESET_POLICIES)})")
    return RESET_POLICIES[name]()
