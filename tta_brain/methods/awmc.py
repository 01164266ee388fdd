"""AWMC (Lee et al., 2023): anchor / chaser / leader pseudo-label continual TTA.

The anchor is the frozen source model, the chaser the adapted model (LayerNorm + encoder biases,
train mode), the leader an EMA of the chaser. Each of the N steps per utterance minimises the mean
of CTC(chaser, anchor label) and CTC(chaser, leader label), then updates the leader. The
prediction comes from the chaser. Continual; a reset policy returns chaser, leader and optimiser
to the source. Anchor and leader share the frozen weights of the one model and
differ only in the adapted tensors (``torch.func.functional_call``), and the anchor label is
computed once per utterance (the anchor never changes).
"""
import torch

from tta_brain.methods import losses
from tta_brain.asr.ctc import greedy_labels
from tta_brain.methods.base import TTAMethod
from tta_brain.methods.registry import register
from tta_brain.methods.state import restore, snapshot


def pseudo_label_loss(logits, anchor, leader, blank_id: int = 0) -> torch.Tensor:
    """AWMC's step loss: the mean of CTC(``anchor`` labels) and CTC(``leader`` labels) of
    ``logits``; one CTC when the two label sequences are the same (same value and gradient:
    0.5 * (a + a) == a exactly). Reads the labels on the host (the comparison)."""
    a = losses.ctc_pseudo_label_loss(logits, anchor, blank_id=blank_id)
    if len(anchor) == len(leader) and all(torch.equal(p, q) for p, q in zip(anchor, leader)):
        return a.mean()
    return (0.5 * (a + losses.ctc_pseudo_label_loss(logits, leader, blank_id=blank_id))).mean()


@register("awmc")
class AWMC(TTAMethod):
    episodic = False

    def __init__(self, model, lr: float = 2e-4, ema_decay: float = 0.999, train_mode: bool = True,
                 **kwargs):
        kwargs.setdefault("adapt_params", ({"select": "layernorm"}, {"select": "encoder_bias"}))
        super().__init__(model, lr=lr, train_mode=train_mode, **kwargs)
        self.ema_decay = float(ema_decay)
        self.leader = snapshot(self.params)

    @torch.no_grad()
    def _labels(self, values, x):
        self.counts["aux_forward"] += 1
        return greedy_labels(self.logits(x, values), self.blank_id)     # on the logits' device

    def forward_and_adapt(self, x, info):
        anchor = self._labels(self.source, x)
        for _ in range(self.steps):
            leader = self._labels(self.leader, x)
            self.adapt_step(x, loss_fn=lambda lg: pseudo_label_loss(lg, anchor, leader,
                                                                    self.blank_id))
            with torch.no_grad():
                torch._foreach_lerp_(self.leader, [p.detach() for p in self.params], 1 - self.ema_decay)
        return self.predict(x)

    def reset(self):
        super().reset()
        restore(self.leader, self.source)

    def state_dict(self):
        return super().state_dict() | {"leader": [p.clone() for p in self.leader]}

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        restore(self.leader, sd["leader"])
