"""The host step: one eager forward/backward/update with the finiteness check read on the host.

This is the step of every method on CPU, and on CUDA of the methods (or settings) the device step
does not cover (``tta_brain.gpu.make_step``). A non-finite loss skips the backward, a non-finite
gradient the update; the method records the skip (``record_skip``: counted, logged, an event).
A step the method's own filter drops (``guard.StepFilter``, EATA) skips both, recorded by the
method (``filtered``).
"""
import math
from typing import List

import torch

__all__ = ["HostStep", "grads_finite", "step_loss", "train_draws"]


def train_draws(m) -> List[str]:
    """What method ``m``'s train mode draws that its eval mode does not (empty: ``train_mode``
    is off, or a train-mode pass of its model is its eval-mode pass; ``lobe.train_draws``; a
    model that cannot say is taken to draw)."""
    if not m.train_mode:
        return []
    return m.lobe.train_draws() if hasattr(m.lobe, "train_draws") else ["unknown"]


def grads_finite(grads: List[torch.Tensor]) -> bool:
    """Are all gradients finite? (one host read of their norms)"""
    return bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())


def step_loss(m, x: torch.Tensor, optimizer, loss_fn=None) -> torch.Tensor:
    """The first half of a step of method ``m`` (host and device steps): zeroed gradients, the
    counted forward (in train mode if the method adapts so), the loss (``loss_fn``, else
    ``m.loss``)."""
    optimizer.zero_grad(set_to_none=False)
    if m.train_mode:
        m.net.train()
    logits = m.forward(x, "adapt_forward")
    loss = (loss_fn or m.loss)(logits)
    if m.train_mode:
        m.net.eval()
    return loss


class HostStep:
    """``step(x, optimizer, loss_fn, after_backward)`` -> the loss (float, nan when skipped);
    ``transcript(logits)`` -> the text of the prediction's logits."""

    #: steps of the last utterance skipped after their ``after_backward`` hook had run (never here:
    #: the hook runs only after the checks passed; see ``DeviceStep``)
    skipped_hooks = 0
    #: the checks are read on the host at every step (``DeviceStep``: on the device)
    on_device = False

    def __init__(self, method):
        self.m = method

    def __call__(self, x: torch.Tensor, optimizer, loss_fn=None, after_backward=None) -> float:
        m = self.m
        loss = step_loss(m, x, optimizer, loss_fn)
        gate = getattr(m, "step_filter", None)
        if gate is not None:                        # the method's filter (EATA): read at once
            rows = gate.take()
            if rows:
                m.step_notes(rows)
                if rows[-1][0]:
                    return float("nan")
        value = float(loss.detach())               # the one host sync before the backward
        if not math.isfinite(value):
            return m.record_skip(f"non-finite loss {value}")
        grads = m.backward(loss)
        if grads and not grads_finite(grads):
            return m.record_skip("non-finite gradient")
        if after_backward is not None:
            after_backward()
        optimizer.step()
        return value

    def transcript(self, logits: torch.Tensor) -> str:
        return self.m.lobe.decode(logits)[0]

    def logits(self, x: torch.Tensor, params=None):
        """None: the method runs its own pass (the device step replays some on length buckets)."""
        return None

    def release(self) -> None:
        """Nothing held (the device step frees its captured graphs here)."""
