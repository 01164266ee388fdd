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
fisher``), theta0 the source values. ``H`` is not weighted by EATA's ``1 / exp(H - E0)`` (the
image paper's per-sample weight in a batch): the E-BATS reference, one utterance a step, runs
the plain entropy, and so does this.

The filter is decided on the device (``loss`` notes its verdict with the method's ``StepFilter``):
the host step reads it at once and skips the backward; the device step (CUDA: captured) skips the
update and reads the verdicts with the transcript.
"""
import logging
from functools import partial

import torch
import torch.nn.functional as F

from tta_brain.data.manifest import expand_path
from tta_brain.gpu.guard import StepFilter
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


#: the filter's verdicts of a dropped step (the first value of its rows; 0: kept)
UNRELIABLE, REDUNDANT = 1, 2


@register("eata")
class EATA(TTAMethod):
    episodic = False
    # its filter decides on the device (a StepFilter), so on CUDA the step is the device step
    # (captured, on length buckets too: the loss masks padded frames through ``lengths``)
    device_loss = True

    def __init__(self, model, steps: int = 1, temperature: float = 1.0,
                 e_margin_factor: float = 0.4, d_margin: float = 1.0, probs_ema: float = 0.9,
                 fisher_alpha: float = 2000.0, source_stats: str = "", data_root: str = "",
                 **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "layernorm"},))
        # the filter's state lives on the device, updated in place (a captured step reads it):
        # the EMA m, whether it has started, and a row per step (verdict, entropy, |cos|)
        self.step_filter = StepFilter(model.device, steps, width=3)
        self._probs = torch.zeros(model.vocab_size, device=model.device)
        self._started = torch.zeros((), dtype=torch.bool, device=model.device)
        super().__init__(model, steps=steps, temperature=temperature, **kwargs)
        self.e_margin = losses.entropy_margin(model.vocab_size, e_margin_factor)
        self.d_margin, self.probs_ema = float(d_margin), float(probs_ema)
        self.fisher_alpha = float(fisher_alpha)
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

    @property
    def model_probs(self):
        """The EMA m of the kept utterances' mean posteriors (None before the first; a host read)."""
        return self._probs.clone() if bool(self._started) else None

    def loss(self, logits, lengths=None):
        """The entropy (+ the Fisher term); the filter's verdict goes to ``step_filter``, all on
        the device: a dropped step must not update (the step reads the verdict)."""
        h = losses.entropy_loss(logits, lengths, temperature=self.temperature,
                                blank_id=self.blank_id).mean()
        probs = losses.mean_probability(logits.detach(), lengths)[0]
        # non-finite posteriors (a NaN input, a diverged model) are unreliable: their entropy
        # over non-blank frames was 0 (NaN logits argmax to the blank: no frame counted), so the
        # step was kept and its NaN mean posterior went into the EMA, after which every |cos|
        # was NaN and nothing was ever redundant again
        value = torch.where(torch.isfinite(probs).all(), h.detach(), torch.nan)
        cos = F.cosine_similarity(self._probs, probs, dim=0).abs()
        # compared in float64, as the host compares Python floats (the margins are not float32)
        unreliable = torch.logical_not(value.double() < self.e_margin)
        redundant = ~unreliable & self._started & (cos.double() >= self.d_margin)
        keep = ~(unreliable | redundant)
        ema = torch.where(self._started, torch.lerp(probs, self._probs, self.probs_ema), probs)
        self._probs.copy_(torch.where(keep, ema, self._probs))
        self._started.logical_or_(keep)
        verdict = unreliable.float() * UNRELIABLE + redundant.float() * REDUNDANT
        self.step_filter.note(~keep, torch.stack([verdict, value.float(), cos.float()]))
        if self.fisher is None:
            return h
        return h + self.fisher_alpha * losses.fisher_penalty(self.params, self.source, self.fisher)

    def filtered(self, values):
        """A dropped step: counted, logged and left in ``events`` (kind ``filter``)."""
        verdict, value, cos = values
        if verdict == UNRELIABLE:
            kind, why = "unreliable", f"entropy {value:.3f} >= E0 {self.e_margin:.3f}"
        else:
            kind, why = "redundant", f"|cos| {cos:.4f} >= d_margin {self.d_margin}"
        info = self.info
        self.counts[f"filtered_{kind}"] += 1
        self.events.append(Event("filter", info.position, f"{kind}: {why}"))
        logger.info("eata: %s (position %d): %s: %s, no step", info.id, info.position, kind, why)

    def device_tensors(self):
        return [self._probs, self._started]

    def reset(self):
        super().reset()
        self._probs.zero_()
        self._started.zero_()

    def state_dict(self):
        return super().state_dict() | {"model_probs": self.model_probs}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        probs = sd.get("model_probs")
        self._started.fill_(probs is not None)
        if probs is None:
            self._probs.zero_()
        else:
            self._probs.copy_(probs)
