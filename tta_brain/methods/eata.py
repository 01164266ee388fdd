"""EATA (Niu et al., ICML 2022) for CTC, continual: an entropy step only on reliable,
non-redundant utterances, with a Fisher (EWC) term that pulls the LayerNorm parameters towards the
source.

Per step on x_t: ``H`` = mean entropy (T = 1) of the non-blank frames. Reliability: keep x_t only
if ``H < E0 = e_margin_factor * ln V`` (the reference hard-codes ln 32, the wav2vec2-base
vocabulary size; V is the model's vocabulary here). Redundancy: keep x_t only if
``|cos(p_bar, m)| < d_margin``, ``p_bar`` the mean posterior vector of x_t and ``m`` an EMA (0.9)
of those of the kept utterances (the first reliable one only starts ``m``). A dropped utterance
takes no step; it is counted (``counts['filtered_unreliable' | 'filtered_redundant']``), logged
and left in ``events`` (kind ``filter``). Loss of a kept one: ``H + fisher_alpha * sum F
(theta - theta0)^2``, F from the source statistics file (``python -m tta_brain.stats --kinds
fisher``), theta0 the source values.
"""
import logging
from functools import partial

import torch
import torch.nn.functional as F

from tta_brain.data.manifest import expand_path
from tta_brain.methods import losses
from tta_brain.methods import source_stats as stats_file
from tta_brain.methods import Event      # (the package exports it wherever it is defined)
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register

logger = logging.getLogger(__name__)

OPTIMIZERS = {"adamw": lambda momentum: partial(torch.optim.AdamW, weight_decay=0.0),
              "sgd": lambda momentum: partial(torch.optim.SGD, momentum=momentum)}


def optimizer_factory(name: str, momentum: float = 0.9):
    """``eata_optimizer``: adamw (what the reference runs) or sgd (what its config says; the
    yaml rules check the name)."""
    return OPTIMIZERS[name](momentum)


class Dropped(Exception):
    """The utterance failed a filter: no step."""


@register("eata")
class EATA(TTAMethod):
    episodic = False

    def __init__(self, model, steps: int = 1, temperature: float = 1.0,
                 e_margin_factor: float = 0.4, d_margin: float = 1.0, probs_ema: float = 0.9,
                 fisher_alpha: float = 2000.0, source_stats: str = "", data_root: str = "",
                 **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "layernorm"},))
        super().__init__(model, steps=steps, temperature=temperature, **kwargs)
        self.e_margin = losses.entropy_margin(model.vocab_size, e_margin_factor)
        self.d_margin, self.probs_ema = float(d_margin), float(probs_ema)
        self.fisher_alpha = float(fisher_alpha)
        self.model_probs = None
        self.counts.update(filtered_unreliable=0, filtered_redundant=0)
        self.stats_path = expand_path(source_stats, data_root)
        self.fisher = self._fisher(self.stats_path) if self.fisher_alpha > 0 else None

    def _fisher(self, path):
        record = stats_file.load(path)
        record.check_model(self.net, path)
        table = record.kind("fisher", path)
        missing = [n for n in self.param_names if n not in table]
        if missing:
            raise stats_file.SourceStatsError(
                f"{path}: no Fisher information for {len(missing)} adapted tensor(s) ({missing[0]}, "
                f"...); make it with {stats_file.make_command(path)} --params=<the adapt_params>")
        return [table[n].to(p.device, p.dtype) for n, p in zip(self.param_names, self.params)]

    def _filtered_loss(self, logits):
        h = losses.entropy_loss(logits, temperature=self.temperature, blank_id=self.blank_id).mean()
        value = float(h.detach())
        if not value < self.e_margin:
            raise Dropped(f"unreliable: entropy {value:.3f} >= E0 {self.e_margin:.3f}")
        probs = losses.mean_probability(logits.detach())[0]
        if self.model_probs is not None:
            cos = float(F.cosine_similarity(self.model_probs, probs, dim=0))
            if abs(cos) >= self.d_margin:
                raise Dropped(f"redundant: |cos| {abs(cos):.4f} >= d_margin {self.d_margin}")
            probs = torch.lerp(probs, self.model_probs, self.probs_ema)
        self.model_probs = probs
        if self.fisher is None:
            return h
        return h + self.fisher_alpha * losses.fisher_penalty(self.params, self.source, self.fisher)

    def forward_and_adapt(self, x, info):
        for _ in range(self.steps):
            try:
                self.adapt_step(x, loss_fn=self._filtered_loss)
            except Dropped as e:
                kind = str(e).split(":")[0]
                self.counts[f"filtered_{kind}"] += 1
                self.events.append(Event("filter", info.position, str(e)))
                logger.info("eata: %s (position %d): %s, no step", info.id, info.position, e)
        return self.predict(x)

    def reset(self):
        super().reset()
        self.model_probs = None

    def state_dict(self):
        return super().state_dict() | {"model_probs": self.model_probs}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.model_probs = sd.get("model_probs")

