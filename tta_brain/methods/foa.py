"""FOA (Niu et al., ICML 2024, "Test-time model adaptation with only forward passes"), as the
E-BATS reference runs it on wav2vec 2.0: CMA-ES over ``n_prompts`` prompt tokens prepended to the
transformer's input (after the projection and the positional conv), plus activation shifting.

Continual; one CMA-ES generation per utterance: ``popsize`` samples and the previous best prompt,
fitness ``coef * sum_d (mu_layers - mu_layers_src)^2 / disc_div + H_nb(T)`` (time-mean of every
hidden state vs the source statistics; the reference's std terms are zero at batch size 1 and left
out). The transcript is the best candidate's, from shifted activations: ``head(h + shift_coef
(mu_src_last - m))``, m an EMA (``hist_decay``) of the population's mean last hidden state over the
previous utterances (no shift on the first).

CNN + projection + positional conv run once per utterance; the transformer runs once for the
``[P, n_prompts + F, H]`` batch of prompted sequences.
"""
import math

import numpy as np
import torch

from tta_brain.lobes.partial import PartialForward
from tta_brain.methods import losses
from tta_brain.methods.activation_stats import layer_means, load_stats, mean_alignment
from tta_brain.methods.free import FreeMethod, check_search, make_es, tell
from tta_brain.methods.registry import register


@register("foa")
class FOA(FreeMethod):
    episodic = False

    def __init__(self, model, source_stats="", data_root: str = "", n_prompts: int = 3,
                 popsize: int = 27, sigma: float = 0.1, fitness_coef: float = 0.2,
                 disc_div: float = 64.0, temperature: float = 2.5, shift_coef: float = 0.1,
                 hist_decay: float = 0.95, cma_seed: int = 2020, **kwargs):
        PartialForward(model)          # a model it cannot run: said before asking for statistics
        self.stats = load_stats(source_stats, data_root, model, ("hidden",))
        self.n_prompts, self.popsize = int(n_prompts), int(popsize)
        self.sigma0, self.coef, self.disc_div = float(sigma), float(fitness_coef), float(disc_div)
        self.shift_coef, self.hist_decay = float(shift_coef), float(hist_decay)
        self.cma_seed = int(cma_seed)
        self.H = model.model.config.hidden_size
        self.dim = self.n_prompts * self.H
        super().__init__(model, temperature=temperature, **kwargs)
        self._last_means = []
        self.src_last = self.stats["hidden"]["layers_mean"][-self.H:].to(self.lobe.device)

    # ------------------------------------------------------------- state
    def initial_state(self):
        val = math.sqrt(6.0 / (2 * self.H))          # the reference's Xavier-uniform first prompt
        first = np.random.RandomState(self.cma_seed).uniform(-val, val, self.dim)
        return {"es": make_es(np.zeros(self.dim), self.sigma0, self.popsize, self.cma_seed),
                "best": first, "hist": None}

    def free_state(self):
        return {"es": self.es, "best": self.best_prompt, "hist": self.hist}

    def load_free_state(self, state):
        check_search(self.name, state["es"], self.dim, self.popsize)
        self.es, self.best_prompt, self.hist = state["es"], state["best"], state["hist"]

    def center(self):
        return self.es.mean

    # ------------------------------------------------------------- fitness
    def prefix(self, x):
        return self.pf.encoder_input(self.lobe.features(x))      # [1, F, H], once per utterance

    def candidates_forward(self, h0, z):
        return self.pf.prompted(h0, z.view(len(z), self.n_prompts, self.H))

    def score(self, out):
        logits, states, last = out
        means = layer_means(states)
        src = self.stats["hidden"]["layers_mean"]
        disc = self.coef * mean_alignment(means, src) / self.disc_div
        ent = losses.entropy_loss(logits, temperature=self.temperature, blank_id=self.blank_id)
        self._last_means.append(means[:, -self.H:])
        if self.hist is not None:                                  # activation shifting
            logits = self.pf.head(last + self.shift_coef * (self.src_last - self.hist))
        return disc + ent, logits

    # ------------------------------------------------------------- one utterance
    def search(self, x, h0):
        cands = self.es.ask() + [self.best_prompt]
        self._last_means = []
        fit, parts = yield cands
        best = int(fit.argmin())
        self.best_prompt = np.array(cands[best])
        tell(self.es, cands, fit)
        m = torch.cat(self._last_means).mean(dim=0)
        self.hist = m if self.hist is None else torch.lerp(m, self.hist, self.hist_decay)
        return self.pick(parts, best)
