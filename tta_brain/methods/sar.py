"""SAR (Niu et al., ICLR 2023) for CTC, continual: a sharpness-aware entropy step on reliable
utterances, with model recovery.

One step on x_t is two forward-backward passes. Pass 1: ``H`` = mean entropy (T = 1) over the
non-blank frames; unless ``H < E0 = e_margin_factor * ln V`` the step stops there (no update).
Its gradient g moves the weights to ``theta + rho g / ||g||`` (SAM's ascent). Pass 2 at those
weights: the entropy over pass 1's non-blank frames, filtered again with E0; its gradient, taken
back at ``theta``, updates with the base optimiser (AdamW). Recovery: an EMA (0.9) of the pass-2
losses; when it drops below ``reset_constant`` after an utterance, model and optimiser go back to
the source and the EMA is cleared (a ``reset`` event, reason ``recovery``).
"""
import logging
import math

import torch

from tta_brain.methods import losses
from tta_brain.methods import Event      # (the package exports it wherever it is defined)
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register

logger = logging.getLogger(__name__)


@register("sar")
class SAR(TTAMethod):
    episodic = False

    def __init__(self, model, steps: int = 1, temperature: float = 1.0, rho: float = 0.05,
                 e_margin_factor: float = 0.4, loss_ema: float = 0.9, reset_constant: float = 0.3,
                 **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "layernorm"},))
        super().__init__(model, steps=steps, temperature=temperature, **kwargs)
        self.rho, self.loss_ema, self.reset_constant = float(rho), float(loss_ema), float(reset_constant)
        self.e_margin = losses.entropy_margin(model.vocab_size, e_margin_factor)
        self.ema = None
        self.ascent = SAMAscent(self.params, self.rho)
        self.counts.update(filtered_first=0, filtered_second=0, recoveries=0)

    def _entropy(self, logits, path=None):
        return losses.entropy_loss(logits, temperature=self.temperature, blank_id=self.blank_id,
                                   path=path).mean()

    def _reliable(self, info, which, loss):
        """``loss`` if it is below E0 (nan passes: the step skips it), else no update."""
        value = float(loss.detach())
        if not value >= self.e_margin:
            return loss
        self.counts[f"filtered_{which}"] += 1
        why = f"unreliable ({which} pass): entropy {value:.3f} >= E0 {self.e_margin:.3f}"
        self.events.append(Event("filter", info.position, why))
        raise _Filtered

    def sam_step(self, x, info) -> float:
        """Pass 1 and the ascent, pass 2 and the update; the pass-2 loss (nan: no update)."""
        first = {}

        def first_loss(logits):                   # pass 1's non-blank frames serve pass 2 too
            first["path"] = logits.detach().argmax(-1)
            return self._reliable(info, "first", self._entropy(logits, first["path"]))

        def second_loss(logits):
            return self._reliable(info, "second", self._entropy(logits, first["path"]))
        try:
            self.adapt_step(x, optimizer=self.ascent, loss_fn=first_loss)
            if self.ascent.eps is None:           # pass 1 skipped (non-finite)
                return float("nan")
            return self.adapt_step(x, loss_fn=second_loss, after_backward=self.ascent.undo)
        except _Filtered:
            return float("nan")
        finally:
            self.ascent.undo()

    def loss(self, logits):
        return self._entropy(logits)

    def forward_and_adapt(self, x, info):
        for _ in range(self.steps):
            value = self.sam_step(x, info)
            if math.isfinite(value):
                self.ema = value if self.ema is None else self.loss_ema * self.ema + (1 - self.loss_ema) * value
        hyp = self.predict(x)
        if self.ema is not None and self.ema < self.reset_constant:
            self.counts["recoveries"] += 1
            logger.info("sar: loss EMA %.4f < %g after %s: model recovery", self.ema,
                        self.reset_constant, info.id)
            self.reset_meta(self.t + 1, info.position + 1, "recovery")
        return hyp

    def reset(self):
        super().reset()
        self.ema = None

    def state_dict(self):
        return super().state_dict() | {"ema": self.ema}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.ema = sd.get("ema")


class _Filtered(Exception):
    """A pass found the utterance unreliable: no update."""


class SAMAscent:
    """SAM's first half as an optimiser for the skeleton's step: ``step()`` moves the parameters
    by ``rho g / ||g||_2`` (g their gradients, the norm over all of them), ``undo()`` moves them
    back (once)."""

    def __init__(self, params, rho: float):
        self.params, self.rho, self.eps = list(params), float(rho), None

    def zero_grad(self, set_to_none: bool = False):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        grads = [p.grad for p in self.params]
        norm = torch.stack(torch._foreach_norm(grads)).norm()
        self.eps = torch._foreach_mul(grads, (self.rho / (norm + 1e-12)).item())
        torch._foreach_add_(self.params, self.eps)

    @torch.no_grad()
    def undo(self):
        if self.eps is not None:
            torch._foreach_sub_(self.params, self.eps)
            self.eps = None
