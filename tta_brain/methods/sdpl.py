"""SDPL: single-utterance pseudo-label baseline of the SUTA paper. N steps of CTC on the greedy
pseudo label (recomputed every step from the current model), reset per utterance."""
import torch

from tta_brain import losses
from tta_brain.ctc import collapse
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register


@register("sdpl")
class SDPL(TTAMethod):
    episodic = True

    def loss(self, logits):
        labels = [torch.tensor(collapse(p, self.blank_id)) for p in logits.detach().argmax(-1)]
        return losses.ctc_pseudo_label_loss(logits, labels, blank_id=self.blank_id).mean()
