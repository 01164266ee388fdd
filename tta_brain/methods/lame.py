"""LAME (Boudiaf et al., CVPR 2022, "Parameter-free online test-time adaptation"), as the E-BATS
reference runs it on CTC models: no parameter changes and no state; every frame of an utterance is
a sample. The frame posteriors q are replaced by the Laplacian-regularised assignment

    min_Y  sum_i KL(Y_i || q_i) - lambda sum_ij W_ij Y_i^T Y_j

with W the symmetrised kNN graph (k = ``knn``) of the L2-normalised last hidden states, found by
the bound optimiser's fixed-point iterations ``Y = softmax(log q + lambda W Y)`` until the relative
change of the energy is <= ``tol`` (at most ``max_steps``). Frames whose blank probability exceeds
``blank_threshold`` are left out of the graph when more than k + 1 others remain, and keep their
blank probability (rows renormalised); the transcript is the argmax.
"""
from typing import Tuple

import torch
import torch.nn.functional as F

from tta_brain.methods.free import FreeMethod
from tta_brain.methods.registry import register

__all__ = ["LAME", "knn_affinity", "laplacian_optimization", "lame_posteriors"]


def knn_affinity(feats: torch.Tensor, knn: int) -> torch.Tensor:
    """Symmetrised kNN graph ``(W + W^T) / 2`` of ``feats [N, D]`` (L2 distances, self excluded)."""
    n = feats.shape[0]
    dist = torch.cdist(feats, feats)
    dist.fill_diagonal_(float("inf"))
    idx = dist.topk(min(knn, n - 1), dim=-1, largest=False).indices
    W = torch.zeros(n, n, dtype=feats.dtype, device=feats.device).scatter_(-1, idx, 1.0)
    return 0.5 * (W + W.T)


def laplacian_optimization(unary: torch.Tensor, kernel: torch.Tensor, bound_lambda: float = 1.0,
                           max_steps: int = 100, tol: float = 1e-8) -> Tuple[torch.Tensor, list]:
    """LAME's bound iterations from ``Y = softmax(-unary)``; returns Y and the energy of each step."""
    Y = (-unary).softmax(dim=-1)
    energies = []
    for i in range(max_steps):
        pairwise = bound_lambda * kernel @ Y
        Y = (pairwise - unary).softmax(dim=-1)
        e = float((Y * (unary + Y.clamp(min=1e-20).log()) - pairwise * Y).sum())
        if i > 1 and abs(energies[-1] - e) <= tol * abs(energies[-1]):
            energies.append(e)
            break
        energies.append(e)
    return Y, energies


def lame_posteriors(logits: torch.Tensor, hidden: torch.Tensor, blank_id: int = 0, knn: int = 5,
                    bound_lambda: float = 1.0, max_steps: int = 100, tol: float = 1e-8,
                    blank_threshold: float = 0.5) -> torch.Tensor:
    """LAME on one utterance: logits ``[F, V]``, last hidden states ``[F, H]`` -> posteriors Y."""
    prob = logits.softmax(dim=-1)
    feats = F.normalize(hidden, dim=-1)
    blank = prob[:, blank_id] > blank_threshold
    keep = ~blank
    if int(keep.sum()) > knn + 1:
        W = torch.zeros(len(feats), len(feats), dtype=feats.dtype, device=feats.device)
        W[keep.nonzero()[:, 0][:, None], keep.nonzero()[:, 0][None]] = knn_affinity(feats[keep], knn)
    else:
        W = knn_affinity(feats, knn)
    Y, _ = laplacian_optimization(-(prob + 1e-10).log(), W, bound_lambda, max_steps, tol)
    Y[blank, blank_id] = prob[blank, blank_id]
    return Y / Y.sum(dim=1, keepdim=True)


@register("lame")
class LAME(FreeMethod):
    episodic = True

    def __init__(self, model, knn: int = 5, bound_lambda: float = 1.0, max_steps: int = 100,
                 tol: float = 1e-8, blank_threshold: float = 0.5, **kwargs):
        self.opts = dict(knn=int(knn), bound_lambda=float(bound_lambda), max_steps=int(max_steps),
                         tol=float(tol), blank_threshold=float(blank_threshold))
        super().__init__(model, **kwargs)

    needs_partial = False

    def prefix(self, x):
        return self.lobe.head_input(x)         # the frozen network, once per utterance

    def adapt(self, x, ctx):
        self.counts["infer_forward"] += 1
        logits, last = ctx
        Y = lame_posteriors(logits[0], last[0], self.blank_id, **self.opts)
        return Y.clamp(min=1e-8).log()[None]
