"""SDPL: single-utterance pseudo-label baseline of the SUTA paper. N steps of CTC on the greedy
pseudo label (recomputed every step from the current model), reset per utterance."""
import torch

from tta_brain import losses
from tta_brain.ctc import collapse
from tta_brain.methods.base import TTAMethod, register


@register("sdpl")
class SDPL(TTAMethod):
    def loss(self, logits):
        labels = [torch.tensor(collapse(p, self.blank_id)) for p in logits.detach().argmax(-1)]
        return losses.ctc_pseudo_label_loss(logits, labels, blank_id=self.blank_id).mean()

    def adapt_and_predict(self, x, info):
        self.reset()
        for _ in range(self.steps):
            self.adapt_step(x)
        return self.predict(x)
