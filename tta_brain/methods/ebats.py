"""E-BATS (Dong et al., NeurIPS 2025): backprop-free TTA by CMA-ES over an additive bias after the
conv of the last CNN layer (before its norm and activation).

Per utterance: CMA-ES restarts from the T-EMA of its state (mean, sigma, C; evolution paths
zeroed) and runs up to ``generations`` generations of ``popsize`` candidates, stopping early after
``patience`` generations without a gain > ``early_stop_threshold`` of the generation's best
fitness; the transcript is the best candidate of the last generation. Fitness of a candidate::

    L = a H_nb(T) + b [sum (mu_cnn - mu_cnn_src)^2 + sum (mu_layers - mu_layers_src)^2 / H]
    L += (2 - clip(L / loss_max, 0, 2)) * token-level loss (``activation_stats.token_alignment``)

The CNN up to the last conv runs once per utterance; the candidates' biases are added to its
output as one batch ``[P, C, F]`` and the rest of the network runs once for the population.
"""
import logging

import numpy as np
import torch

from tta_brain.lobes.partial import PartialForward
from tta_brain.methods import losses
from tta_brain.methods.activation_stats import (confidence_weight, layer_means, load_stats,
                                                mean_alignment, token_alignment,
                                                token_frames_blocker)
from tta_brain.methods.free import EarlyStop, FreeMethod, check_search, make_es, tell
from tta_brain.methods.registry import register

logger = logging.getLogger(__name__)

#: the T-EMA step size, as a multiple of its start, past which the search is said to diverge
#: (measured on the tiny model of the tests over 2,000 utterances: 46x at 100, 1,500x at 300,
#: transcripts all empty from about 950; on the synthetic source model it levelled at 26x)
SIGMA_GROWTH = 100.0


def tema_restart(es, ema, cov_ratio: float):
    """Set ``es`` to the T-EMA state: mean, sigma, ``C = r EMA_C + (1 - r) I``, zero paths."""
    es.mean = ema["mean"].copy()
    es.sigma = float(ema["sigma"])
    es.sm.C = cov_ratio * ema["C"] + (1 - cov_ratio) * np.eye(len(ema["mean"]))
    es.sm.update_now(-1)
    es.pc = np.zeros_like(es.pc)
    if getattr(es.adapt_sigma, "ps", None) is not None:       # CSA's path (the default)
        es.adapt_sigma.ps = np.zeros_like(es.adapt_sigma.ps)


def ema_update(ema, es, decay: float):
    """One T-EMA step of the CMA-ES state (mean, sigma, C) after an utterance."""
    for key, value in (("mean", es.mean), ("sigma", es.sigma), ("C", es.sm.C)):
        ema[key] = decay * ema[key] + (1 - decay) * np.asarray(value, dtype=float)


@register("ebats")
class EBATS(FreeMethod):
    episodic = False

    def __init__(self, model, source_stats="", data_root: str = "", popsize: int = 50,
                 sigma: float = 0.01, generations: int = 25, early_stop_threshold: float = 0.001, patience: int = 3,
                 entropy_coef: float = 1.0, stats_coef: float = 2.0, temperature: float = 2.0,
                 tokenwise: bool = True, loss_max: float = 5.0, ema_decay: float = 0.9,
                 cov_ratio: float = 1.0, cma_seed: int = 2024, **kwargs):
        PartialForward(model)          # a model it cannot run: said before asking for statistics
        why = token_frames_blocker(model)
        if why:
            raise ValueError(why)
        self.stats = load_stats(source_stats, data_root, model, ("hidden", "tokens"))
        self.popsize, self.sigma0 = int(popsize), float(sigma)
        self.generations, self.patience = int(generations), int(patience)
        self.threshold, self.loss_max = float(early_stop_threshold), float(loss_max)
        self.a, self.b, self.tokenwise = float(entropy_coef), float(stats_coef), bool(tokenwise)
        self.ema_decay, self.cov_ratio, self.cma_seed = float(ema_decay), float(cov_ratio), int(cma_seed)
        self.dim = model.model.base_model.feature_extractor.conv_layers[-1].conv.out_channels
        super().__init__(model, temperature=temperature, **kwargs)
        self.sigma_peak = self.sigma0     # the largest T-EMA sigma of the run (resets included)

    def state_dict(self):
        return {**super().state_dict(), "sigma_peak": self.sigma_peak}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)       # (a state saved before the peak was kept: the EMA's)
        self.sigma_peak = float(sd.get("sigma_peak", self.ema["sigma"]))

    # ------------------------------------------------------------- state
    def initial_state(self):
        es = make_es(np.zeros(self.dim), self.sigma0, self.popsize, self.cma_seed)
        ema = {"mean": np.zeros(self.dim), "sigma": self.sigma0, "C": np.eye(self.dim)}
        return {"es": es, "ema": ema, "best": np.inf}

    def free_state(self):
        return {"es": self.es, "ema": self.ema, "best": self.best}

    def load_free_state(self, state):
        check_search(self.name, state["es"], self.dim, self.popsize)
        self.es, self.ema, self.best = state["es"], state["ema"], state["best"]

    def center(self):
        return self.ema["mean"]

    # ------------------------------------------------------------- fitness
    def prefix(self, x):
        return self.pf.last_conv(x)                            # [1, C, F], once per utterance

    def candidates_forward(self, conv_out, z):
        feats = self.pf.finish_cnn(conv_out + z[:, :, None])  # [P, C, F]
        logits, states, _ = self.pf.from_features(feats)
        return logits, feats, states

    def score(self, out):
        logits, feats, states = out
        return self.fitness(logits, feats, states), logits

    def fitness(self, logits, feats, states):
        s, path = self.stats["hidden"], logits.argmax(-1)
        ent = losses.entropy_loss(logits, temperature=self.temperature, blank_id=self.blank_id, path=path)
        nb = (path != self.blank_id).any(dim=1)
        ent = torch.where(nb, ent, torch.full_like(ent, 10.0))   # no non-blank frame: 10 (reference)
        align = (mean_alignment(feats.mean(dim=2), s["cnn_mean"])
                 + mean_alignment(layer_means(states), s["layers_mean"]) / self.pf.hidden_size)
        loss = self.a * ent + self.b * align
        if self.tokenwise:
            tok = token_alignment(states, path, self.stats["tokens"], self.blank_id)
            loss = loss + confidence_weight(loss, self.loss_max) * tok
        return loss

    def end_warnings(self):
        grown = self.sigma_peak / self.sigma0      # a reset after the divergence: still said
        if grown <= SIGMA_GROWTH:
            return []
        return [f"ebats: the T-EMA of CMA-ES' step size sigma reached {self.sigma_peak:.3g}, "
                f"{grown:.3g}x its start ({self.sigma0:g}): the search diverged (the E-BATS "
                f"reference bounds neither sigma nor the mean), its candidates' biases swamp the "
                f"CNN's output and transcripts go empty; log.txt says at which utterance it "
                f"passed {SIGMA_GROWTH:g}x"]

    # ------------------------------------------------------------- one utterance
    def search(self, x, conv_out):
        if self.t > 0:
            tema_restart(self.es, self.ema, self.cov_ratio)
        stop, logits = EarlyStop(self.threshold, self.patience, self.best), None
        for _ in range(self.generations):
            cands = self.es.ask()
            fit, parts = yield cands
            best = int(fit.argmin())
            logits = self.pick(parts, best)
            tell(self.es, cands, fit)
            if stop(float(fit[best])):
                break
        self.best = stop.previous
        before = float(self.ema["sigma"])
        ema_update(self.ema, self.es, self.ema_decay)
        self.sigma_peak = max(self.sigma_peak, float(self.ema["sigma"]))
        if before <= SIGMA_GROWTH * self.sigma0 < float(self.ema["sigma"]):
            logger.warning("ebats: utterance %d: the T-EMA of CMA-ES' step size sigma passed %gx "
                           "its start (%.3g, from %g): the search is diverging", self.t,
                           SIGMA_GROWTH, float(self.ema["sigma"]), self.sigma0)
        return logits
