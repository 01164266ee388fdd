"""T3A (Iwasawa & Matsuo, NeurIPS 2021, "Test-time classifier adjustment module"), frame-level
on a CTC head as the E-BATS reference runs it on wav2vec 2.0: the head's weight rows are replaced
by class prototypes (its bias kept), each the mean of the L2-normalised supports of its class.

Supports start as the head's rows (entropy ~0, so they are always kept); an utterance with a
non-blank argmax frame adds every frame's last hidden state with its argmax label and entropy;
then each class keeps its ``filter_K`` lowest-entropy supports (bounded memory: at most
``filter_K`` per class). The transcript comes from the adjusted classifier on the same utterance.
Continual; never reset by itself (reset policies may be attached).
"""
import torch
import torch.nn.functional as F

from tta_brain.methods import losses
from tta_brain.methods.free import FreeMethod
from tta_brain.methods.registry import register

__all__ = ["T3A", "select_supports", "prototypes"]


def select_supports(labels: torch.Tensor, ent: torch.Tensor, filter_K: int) -> torch.Tensor:
    """Indices of the ``filter_K`` lowest-entropy supports of each class (``-1``: all), stable
    order (by class, then entropy)."""
    if filter_K < 0:
        return torch.arange(len(labels), device=labels.device)
    order = torch.argsort(ent, stable=True)
    order = order[torch.argsort(labels[order], stable=True)]   # by class, entropy within
    lab = labels[order]
    first = torch.searchsorted(lab, lab, side="left")           # start of each class's run
    rank = torch.arange(len(lab), device=lab.device) - first
    return order[rank < filter_K]


def prototypes(supports, labels, num_classes: int, fallback: torch.Tensor) -> torch.Tensor:
    """``[V, H]``: mean of the L2-normalised supports of each class (``fallback`` row if none)."""
    onehot = F.one_hot(labels, num_classes).to(supports.dtype)      # [N, V]
    n = onehot.sum(dim=0)
    protos = onehot.T @ F.normalize(supports, dim=1) / n.clamp(min=1)[:, None]
    return torch.where(n[:, None] > 0, protos, fallback)


@register("t3a")
class T3A(FreeMethod):
    episodic = False

    def __init__(self, model, filter_K: int = 10, **kwargs):
        self.filter_K = int(filter_K)
        weight, bias = model.head_weights()
        self.W, self.bias = weight.clone(), bias.clone()
        super().__init__(model, **kwargs)

    def initial_state(self):
        sims = F.normalize(self.W, dim=1) @ F.normalize(self.W, dim=1).T
        return {"supports": self.W.clone(), "labels": sims.argmax(dim=-1),
                "ent": torch.full((len(self.W),), 1e-8, device=self.W.device)}

    def free_state(self):
        return {"supports": self.supports, "labels": self.labels, "ent": self.ent}

    def load_free_state(self, state):
        self.supports, self.labels, self.ent = state["supports"], state["labels"], state["ent"]

    def meta_values(self):
        return [prototypes(self.supports, self.labels, len(self.W), self.W)]

    def classify(self, hidden, protos):
        return hidden @ protos.T + self.bias

    needs_partial = False

    def prefix(self, x):
        return self.lobe.head_input(x)         # the frozen network, once per utterance

    def adapt(self, x, ctx):
        self.counts["infer_forward"] += 1
        logits, hidden = ctx
        path = logits[0].argmax(-1)
        if (path != self.blank_id).any():
            self.supports = torch.cat([self.supports, hidden[0]])
            self.labels = torch.cat([self.labels, path])
            self.ent = torch.cat([self.ent, losses.entropy_loss(  # per-frame entropy, T = 1
                logits[0][:, None], temperature=1.0, non_blank=False)])
        keep = select_supports(self.labels, self.ent, self.filter_K)
        self.supports, self.labels, self.ent = self.supports[keep], self.labels[keep], self.ent[keep]
        return self.classify(hidden, self.meta_values()[0])

    def loss_at(self, ctx, values):
        """SUTA loss of the utterance (its full pass ``ctx``) under the prototypes ``values``
        (None: the head's own rows)."""
        logits = self.classify(ctx[1], self.W if values is None else values[0])
        return losses.suta_loss(logits, alpha=self.em_coef, temperature=self.temperature,
                                blank_id=self.blank_id).mean()
