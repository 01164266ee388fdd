"""Dynamic SUTA (fast-slow TTA, Algorithms 1 and 2 of the paper).

Per utterance x_t (t counted from 1):
  1. fast:  phi_hat <- phi_t; N SUTA steps on x_t; predict with phi_hat.
  2. slow:  every M utterances (buffer full): phi_{t+1} <- AdamW(phi_t, mean_{x in B} grad L(phi_t, x)),
            unless the reset policy resets phi_{t+1} <- phi_pre instead (buffer discarded).

The slow gradient costs no extra pass: phi_t is constant while the buffer fills, so the gradient
of L(phi_t, x_i) is exactly the gradient of the first fast step on x_i; it is accumulated there
(``slow_grad: reuse``, the default). With N = 0 one explicit forward/backward per utterance
provides it. ``slow_grad: recompute`` is the plain reference (the official code's way): the
buffer's utterances are kept and, at the update, M fresh forward/backward passes on phi_t give
the mean gradient; same result (bit-identical on CPU), M more passes per update.

``slow_lr`` (default: ``lr``, as the paper) gives the slow learner its own learning rate.
The fast optimiser starts each utterance from the slow optimiser's moments (as the official code
does; ``fast_moments: zero`` starts from fresh moments instead). With ``param_collection:
official`` both optimisers see the official code's list (CNN tensors repeated, see
``tta_brain.methods.params``) and the inherited moments are those of the repeated updates, as there.
"""
from typing import Callable, Optional

import torch

from tta_brain.gpu.guard import DeviceHook
from tta_brain.gpu.host_step import grads_finite
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register
from tta_brain.methods.optim import build_optimizer
from tta_brain.methods.state import copy_optimizer_state, restore, snapshot, zero_optimizer_state


@register("dsuta")
class DSUTA(TTAMethod):
    episodic = False

    def __init__(self, model, buffer_size: int = 5, steps: int = 10,
                 slow_optimizer: Optional[Callable] = None, fast_moments: str = "slow",
                 slow_grad: str = "reuse", slow_lr: Optional[float] = None, **kwargs):
        super().__init__(model, steps=steps, **kwargs)
        self.slow_grad = slow_grad
        self.M = int(buffer_size)
        self.fast_moments = fast_moments
        # slow (meta) parameters phi_t: plain leaf tensors with their own optimiser
        self.meta = [torch.nn.Parameter(t, requires_grad=False) for t in snapshot(self.params)]
        # the same selection over phi_t (with param_collection: official, the same repeats)
        meta_sel = (self.selected.on(self.meta) if hasattr(self.selected, "on") else
                    [(n, m, mult) for (n, _, mult), m in zip(self.selected, self.meta)])
        # the paper uses one lr for both learners; slow_lr sets the slow learner's on its own
        self.slow_lr = self.lr if slow_lr is None else float(slow_lr)
        self.slow_optimizer = build_optimizer(slow_optimizer, meta_sel, self.slow_lr)
        self.buffer_x = []             # slow_grad: recompute: the buffered (prepared) inputs
        self.grad_sum = [torch.zeros_like(p) for p in self.params]
        self.n_buffered = 0            # utterances in the buffer (their gradients are in grad_sum)
        self.n_grads = 0               # of which contributed a finite gradient
        # the first fast step's hook: its device half is captured with the step on length buckets
        self._accumulate = DeviceHook(self._add_grads, self._count_grad, lambda: self.grad_sum)

    # ---------------------------------------------------------------- steps
    def _add_grads(self):
        # a selected parameter unused by the eval forward (e.g. wav2vec2's masked_spec_embed
        # under `adapt_params: [all]`) has no gradient: it contributes zero
        pairs = [(s, p.grad) for s, p in zip(self.grad_sum, self.params) if p.grad is not None]
        if pairs:
            torch._foreach_add_([s for s, _ in pairs], [g for _, g in pairs])

    def _count_grad(self):
        self.n_grads += 1

    def forward_and_adapt(self, x, info):
        # fast adaptation from phi_t
        restore(self.params, self.meta)
        if self.fast_moments == "slow":
            copy_optimizer_state(self.slow_optimizer, self.meta, self.optimizer, self.params)
        else:
            zero_optimizer_state(self.optimizer)
        reuse = self.slow_grad == "reuse"
        for n in range(self.steps):
            self.adapt_step(x, after_backward=self._accumulate if n == 0 and reuse else None)
        if reuse and self.steps == 0:
            self._slow_gradient_only(x)
        elif not reuse:
            self.buffer_x.append(x)
        hyp = self.predict(x)
        # the device step runs the hook before it knows a step is skipped (the hook then added
        # zero gradients): such a step's gradient does not count
        self.n_grads -= self.step.skipped_hooks
        self.n_buffered += 1
        return hyp

    def update_due(self):
        return self.n_buffered >= self.M

    # what the device step needs to know (tta_brain.gpu): the SUTA loss runs on the device alone
    # (the first fast step, with _accumulate, runs eagerly, the others may be replayed from a
    # captured graph), and the slow optimiser runs fused too (its state is copied into the fast
    # one every utterance: both keep their step counts on the device, a copy in place)
    device_loss = True
    device_optimizers = ("slow_optimizer",)

    def _slow_gradient_only(self, x):
        """grad L(live params, x) into the buffer sum by one forward/backward, no update (skipped
        like a fast step's when the loss or the gradient is not finite)."""
        self.optimizer.zero_grad(set_to_none=False)
        logits = self.forward(x, "adapt_forward")
        loss = self.loss(logits)
        if torch.isfinite(loss):
            grads = self.backward(loss)
            if not grads or grads_finite(grads):
                self._accumulate()

    def _recompute_slow_gradient(self):
        """slow_grad: recompute: the buffer's gradients on phi_t by fresh passes (the live
        model keeps the fast weights that made the last prediction)."""
        fast = snapshot(self.params)
        restore(self.params, self.meta)
        for x in self.buffer_x:
            self._slow_gradient_only(x)
        restore(self.params, fast)

    def meta_update(self):
        """The slow step (a reset discards the buffer instead: see ``reset``)."""
        if self.slow_grad == "recompute":
            self._recompute_slow_gradient()
        if self.n_grads > 0:
            self._slow_step()
        self._clear_buffer()

    @torch.no_grad()
    def _slow_step(self):
        for m, g in zip(self.meta, self.grad_sum):
            m.grad = g / self.n_grads
        self.slow_optimizer.step()
        for m in self.meta:
            m.grad = None

    def _clear_buffer(self):
        torch._foreach_zero_(self.grad_sum)
        self.buffer_x.clear()
        self.n_buffered = self.n_grads = 0

    # ------------------------------------------------------- meta-parameters
    def meta_values(self):
        return self.meta

    def reset(self):
        """Fast and slow learners back to the source; the buffer is discarded."""
        super().reset()
        restore(self.meta, self.source)
        zero_optimizer_state(self.slow_optimizer)
        self._clear_buffer()

    # ---------------------------------------------------------------- resume
    def state_dict(self):
        sd = super().state_dict()
        sd.update(meta=[m.detach().clone() for m in self.meta],
                  slow_optimizer=self.slow_optimizer.state_dict(),
                  grad_sum=[g.clone() for g in self.grad_sum],
                  n_buffered=self.n_buffered, n_grads=self.n_grads,
                  buffer_x=[x.detach().clone() for x in self.buffer_x])
        return sd

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        restore(self.meta, sd["meta"])
        self.slow_optimizer.load_state_dict(sd["slow_optimizer"])
        restore(self.grad_sum, sd["grad_sum"])
        self.n_buffered, self.n_grads = sd["n_buffered"], sd["n_grads"]
        self.buffer_x = [x.to(self.lobe.device) for x in sd.get("buffer_x", [])]
