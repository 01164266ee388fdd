"""SDPL: single-utterance pseudo-label baseline of the SUTA paper. N steps of CTC on the greedy
pseudo label (recomputed every step from the current model), reset per utterance.

``train_mode`` (default off: eval mode, as every other method here) adapts as the official code
does (``SDPLStrategy`` in hhhaaahhhaa/Dynamic-SUTA): each step first decodes the pseudo label in
eval mode (one more no-grad forward, counted as ``aux_forward``), then takes the CTC step with the
model in train mode (dropout, LayerDrop and SpecAugment as configured in the checkpoint). In eval
mode the label comes from the adaptation forward itself (the same logits, no extra pass).
"""
import torch

from tta_brain.methods import losses
from tta_brain.asr.ctc import collapse
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


__all__ = ["SDPL", "greedy_labels", "greedy_label_loss"]


def greedy_labels(logits: torch.Tensor, blank_id: int):
    """The greedy pseudo label of each item of ``logits [B, T, V]`` (collapsed on the host)."""
    return [torch.tensor(collapse(p, blank_id)) for p in logits.detach().argmax(-1)]


def greedy_label_loss(logits: torch.Tensor, blank_id: int, labels=None) -> torch.Tensor:
    """SDPL's step loss: CTC of ``logits`` on ``labels`` (default: their own greedy labels)."""
    labels = greedy_labels(logits, blank_id) if labels is None else labels
    return losses.ctc_pseudo_label_loss(logits, labels, blank_id=blank_id).mean()


@register("sdpl")
class SDPL(TTAMethod):
    episodic = True

    def _labels(self, logits):
        return greedy_labels(logits, self.blank_id)

    def loss(self, logits):
        return greedy_label_loss(logits, self.blank_id)

    def _ctc(self, logits, labels):
        return greedy_label_loss(logits, self.blank_id, labels)

    @torch.no_grad()
    def _eval_labels(self, x):
        """The greedy pseudo label of the current model in eval mode (the official order:
        ``inference`` in eval mode, then ``train()`` and the CTC step)."""
        self.counts["aux_forward"] += 1
        return self._labels(self.logits(x))

    def forward_and_adapt(self, x, info):
        if not self.train_mode:
            return super().forward_and_adapt(x, info)
        for n in range(self.steps):
            self.before_step(n)
            labels = self._eval_labels(x)
            self.adapt_step(x, loss_fn=lambda lg, labels=labels: self._ctc(lg, labels))
        return self.predict(x)
