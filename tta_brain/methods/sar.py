"""SAR (Niu et al., ICLR 2023) for CTC, continual: a sharpness-aware entropy step on reliable
utterances, with model recovery.

One step on x_t is two forward-backward passes. Pass 1: ``H`` = mean entropy (T = 1) over the
non-blank frames; unless ``H < E0 = e_margin_factor * ln V`` the step stops there (no update).
Its gradient g moves the weights to ``theta + rho g / ||g||`` (SAM's ascent). Pass 2 at those
weights: the entropy over pass 1's non-blank frames, filtered again with E0; its gradient, taken
back at ``theta``, updates with the base optimiser (AdamW). Recovery: an EMA (0.9) of the pass-2
losses; when it drops below ``reset_constant`` after an utterance, model and optimiser go back to
the source and the EMA is cleared (a ``reset`` event, reason ``recovery``).

On CUDA the SAM step is one body of device work (``device_body``: captured, on length buckets
too); on CPU, and wherever the host step is taken, the step below (``sam_step``) runs as before.
"""
import logging
import math

import torch

from tta_brain.gpu.guard import StepFilter, guarded_update, where_
from tta_brain.methods import losses
from tta_brain.methods import Event      # (the package exports it wherever it is defined)
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register

logger = logging.getLogger(__name__)


@register("sar")
class SAR(TTAMethod):
    episodic = False
    # on CUDA its SAM step runs on the device (``device_body``, below), captured
    device_loss = True

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
        self._ema_t = None
        if self.step.on_device:
            self._on_device()

    def _entropy(self, logits, path=None, lengths=None):
        return losses.entropy_loss(logits, lengths, temperature=self.temperature,
                                   blank_id=self.blank_id, path=path).mean()

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

    def loss(self, logits, lengths=None):
        return self._entropy(logits, lengths=lengths)

    def forward_and_adapt(self, x, info):
        if self.step.on_device:                   # the whole SAM step on the device
            for _ in range(self.steps):
                self.adapt_step(x)
            hyp = self.predict(x)                 # its verdicts and the EMA: step_notes
        else:
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

    # ------------------------------------------------------------- the device step (CUDA)
    # One SAM step as one body of device work (``DeviceStep``, captured on CUDA): both passes,
    # both filters, the ascent and its undo, the guarded update and the loss EMA, without a host
    # read. Its verdict per step (a ``StepFilter`` row: code, entropy, EMA after the step) is read
    # with the transcript; the recovery check then runs on the host as above. Where the host step
    # stops early (a filtered or non-finite pass), the device runs both passes and leaves
    # parameters, moments and EMA unchanged.
    step_passes = 2
    #: row codes: the step updated, or why it did not (the host step's filter and skip records)
    UPDATED, FILTERED_FIRST, FILTERED_SECOND, LOSS_1, GRAD_1, LOSS_2, GRAD_2 = range(7)

    def _on_device(self):
        """The device step's state: the EMA (float64, as the host's float) and the verdicts."""
        if self._ema_t is None:
            dev = self.params[0].device
            self._ema_t = torch.zeros((), dtype=torch.float64, device=dev)
            self._ema_on = torch.zeros((), dtype=torch.bool, device=dev)
            self.step_filter = StepFilter(dev, self.steps, width=3)
            self._load_ema(self.ema)

    def _load_ema(self, ema):
        if self._ema_t is not None:
            self._ema_t.fill_(0.0 if ema is None else float(ema))
            self._ema_on.fill_(ema is not None)

    def device_tensors(self):
        return [self._ema_t, self._ema_on]

    def device_body(self, step, logits_fn, optimizer):
        """``DeviceStep``'s body for one SAM step (device work only; gradients zeroed)."""
        rt, params, f = self.runtime, self.params, step.flags
        logits, lengths = logits_fn()
        path = logits.detach().argmax(-1)
        h1 = self._entropy(logits, path, lengths)
        v1 = h1.detach()
        out1 = v1.double() >= self.e_margin     # filtered (nan is not: a skip, as on the host)
        grads = rt.backward_guarded(h1, params, step.device, f.found, f.inv_scale)
        bad1 = f.found.bool()
        ok1 = ~(out1 | bad1)
        with torch.no_grad():
            eps = sam_ascent(grads, self.rho)
            where_(~ok1, eps, 0.0)                        # no ascent after a stopped pass 1
            theta = [torch.empty_like(p) for p in params]
            torch._foreach_copy_(theta, params)
            torch._foreach_add_(params, eps)
        optimizer.zero_grad(set_to_none=False)
        h2 = self._entropy(logits_fn()[0], path, lengths)
        v2 = h2.detach()
        out2 = ok1 & (v2.double() >= self.e_margin)
        rt.backward_guarded(h2, params, step.device, f.found, f.inv_scale)
        bad2 = ok1 & ~out2 & f.found.bool()
        with torch.no_grad():
            torch._foreach_copy_(params, theta)           # theta itself, as SAR's SAM restores it
        update = ok1 & ~(out2 | bad2)
        value2 = v2.double()
        ema = torch.where(self._ema_on, self.loss_ema * self._ema_t + (1 - self.loss_ema) * value2,
                          value2)
        self._ema_t.copy_(torch.where(update, ema, self._ema_t))
        self._ema_on.logical_or_(update)
        verdict = self.verdicts(v1, out1, bad1, v2, out2, bad2)
        value = torch.where(ok1, v2, v1)
        shown = torch.where(self._ema_on, self._ema_t, torch.full_like(self._ema_t, math.nan))
        self.step_filter.note(~update, torch.stack([verdict.double(), value.double(), shown]))
        f.found.copy_(~update)
        f.loss.copy_(v2)
        guarded_update(optimizer, f.found)
        return h2

    @classmethod
    def verdicts(cls, v1, out1, bad1, v2, out2, bad2) -> torch.Tensor:
        """The row code of SAM steps from their passes' values and flags (device tensors of one
        shape; ``out``: filtered, ``bad``: a non-finite loss or gradient of a pass that ran): the
        first reason on the host step's path, filter, then loss, then gradients; pass 1, then 2."""
        def code(cond, yes: int, no):
            return torch.where(cond, torch.full_like(v1, yes), no)
        second = code(out2, cls.FILTERED_SECOND, code(bad2, cls.GRAD_2, torch.zeros_like(v1)))
        second = code(bad2 & ~torch.isfinite(v2), cls.LOSS_2, second)
        first = code(torch.isfinite(v1), cls.GRAD_1, torch.full_like(v1, cls.LOSS_1))
        return code(out1, cls.FILTERED_FIRST, torch.where(bad1, first, second))

    def step_notes(self, rows):
        """The device steps' verdicts (once per utterance): filter events and skip records as
        the host step makes them; the loss EMA after the last step. (Also a batched run's, on its
        view: it reads only ``info``, ``counts``, ``events``, ``e_margin`` and ``record_skip``.)"""
        info = self.info
        for _, verdict, value, ema in rows:
            if verdict in (SAR.FILTERED_FIRST, SAR.FILTERED_SECOND):
                which = "first" if verdict == SAR.FILTERED_FIRST else "second"
                self.counts[f"filtered_{which}"] += 1
                self.events.append(Event("filter", info.position, f"unreliable ({which} pass): "
                                         f"entropy {value:.3f} >= E0 {self.e_margin:.3f}"))
            elif verdict in (SAR.LOSS_1, SAR.LOSS_2):
                self.record_skip(f"non-finite loss {value}", clear_grads=False)
            elif verdict in (SAR.GRAD_1, SAR.GRAD_2):
                self.record_skip("non-finite gradient", clear_grads=False)
        if rows:
            self.ema = None if math.isnan(rows[-1][3]) else rows[-1][3]

    def reset(self):
        super().reset()
        self.ema = None
        self._load_ema(None)

    def state_dict(self):
        return super().state_dict() | {"ema": self.ema}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        self.ema = sd.get("ema")
        self._load_ema(self.ema)


class _Filtered(Exception):
    """A pass found the utterance unreliable: no update."""


def sam_ascent(grads, rho: float):
    """SAM's ascent ``rho g / ||g||_2`` (the norm over all of ``grads``), on the device."""
    norm = torch.stack(torch._foreach_norm(grads)).norm()
    return torch._foreach_mul(grads, rho / (norm + 1e-12))


class SAMAscent:
    """SAM's first half as an optimiser for the skeleton's step: ``step()`` moves the parameters
    by ``rho g / ||g||_2`` (g their gradients, the norm over all of them), ``undo()`` puts them
    back (once): their values from before the step, exactly, as SAR's SAM does (subtracting the
    step again left float rounding: a filtered utterance moved the model)."""

    def __init__(self, params, rho: float):
        self.params, self.rho, self.eps = list(params), float(rho), None
        self.theta = None

    def zero_grad(self, set_to_none: bool = False):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self):
        self.eps = sam_ascent([p.grad for p in self.params], self.rho)
        if self.theta is None:
            self.theta = [torch.empty_like(p) for p in self.params]
        torch._foreach_copy_(self.theta, self.params)
        torch._foreach_add_(self.params, self.eps)

    @torch.no_grad()
    def undo(self):
        if self.eps is not None:
            torch._foreach_copy_(self.params, self.theta)
            self.eps = None
