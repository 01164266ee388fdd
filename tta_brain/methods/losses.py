"""Unsupervised test-time adaptation objectives for CTC models.

Pure functions on logits ``[B, T, V]`` with optional ``lengths`` (valid frames per item, ``[B]``).
Every loss returns one value per utterance (shape ``[B]``); average them yourself when you want a
batch loss. Definitions follow the SUTA / SGEM papers and the official code (see README,
"Deviations"):

* ``entropy_loss``: mean Shannon entropy of the tempered posteriors over **non-blank** frames
  (argmax of the raw logits != blank). An utterance whose frames are all blank gets 0, as in the
  paper's code (hhhaaahhhaa/Dynamic-SUTA sets the term to 0 and flags a collapse; only the
  original SUTA repository averages over no frames and returns NaN).
* ``mcc_loss``: minimum class confusion over all valid frames with the entropy re-weighting trick;
  the confusion matrix is row-normalised and the off-diagonal mass divided by V.
* ``suta_loss = alpha * entropy + (1 - alpha) * mcc`` with alpha 0.3 and temperature 2.5.
* ``renyi_entropy_loss`` and ``negative_sampling_loss``: the two terms of SGEM.
* ``ctc_pseudo_label_loss``: CTC against (greedy) pseudo labels (SDPL, AWMC).

The field's methods (Tent, EATA, SAR use ``entropy_loss`` at T = 1) add:

* ``confidence_weighted_entropy_loss``: CEA's stage-1 term, ``sigmoid(H) * H`` over non-blank frames.
* ``symmetric_cross_entropy_loss``: CoTTA's teacher/student term over the student's non-blank frames.
* ``temporal_coherence_loss``: CEA's stage-2 regulariser on the CNN features.
* ``fisher_penalty``: EATA's anti-forgetting term ``sum F (theta - theta_0)^2``.
* ``mean_probability`` and ``entropy_margin``: EATA's redundancy vector and EATA / SAR's
  reliability threshold ``E0 = factor * ln V``.
"""
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "frame_mask",
    "non_blank_mask",
    "entropy_loss",
    "mcc_loss",
    "suta_loss",
    "renyi_entropy_loss",
    "negative_sampling_loss",
    "ctc_pseudo_label_loss",
    "confidence_weighted_entropy_loss",
    "symmetric_cross_entropy_loss",
    "temporal_coherence_loss",
    "fisher_penalty",
    "mean_probability",
    "entropy_margin",
]


def frame_mask(logits: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean ``[B, T]`` mask of the valid (non-padded) frames."""
    B, T = logits.shape[:2]
    if lengths is None:
        return torch.ones(B, T, dtype=torch.bool, device=logits.device)
    lengths = torch.as_tensor(lengths, device=logits.device)
    return torch.arange(T, device=logits.device)[None, :] < lengths[:, None]


def non_blank_mask(logits, lengths=None, blank_id: int = 0, path: Optional[torch.Tensor] = None):
    """Valid frames whose best label (``path`` if given, else argmax of the logits) is not blank."""
    if path is None:
        path = logits.argmax(dim=-1)
    return (path != blank_id) & frame_mask(logits, lengths)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``values [B, T]`` over ``mask``; rows with an empty mask give 0."""
    mask = mask.to(values.dtype)
    count = mask.sum(dim=1)
    total = (values * mask).sum(dim=1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of softmax(logits) along the last dimension."""
    log_p = logits.log_softmax(dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def entropy_loss(logits, lengths=None, temperature: float = 2.5, blank_id: int = 0,
                 non_blank: bool = True, path=None) -> torch.Tensor:
    """Mean frame entropy of ``softmax(logits / T)`` over (non-blank) valid frames, per utterance."""
    h = _entropy(logits / temperature)
    mask = non_blank_mask(logits, lengths, blank_id, path) if non_blank else frame_mask(logits, lengths)
    return _masked_mean(h, mask)


def mcc_loss(logits, lengths=None, temperature: float = 2.5, reweight: bool = True,
             num_classes: Optional[int] = None) -> torch.Tensor:
    """Minimum class confusion over the valid frames of each utterance.

    ``C = sum_t w_t p_t p_t^T`` with ``w_t = L (1 + exp(-H_t)) / sum_s (1 + exp(-H_s))`` (``H``
    detached) when ``reweight``; ``C`` is row-normalised and ``(sum(C) - trace(C)) / V`` returned.
    ``num_classes`` (V) defaults to the vocabulary size (the official code hard-codes 32, which is
    the wav2vec2-base-960h vocabulary size).
    """
    x = logits / temperature
    p = x.softmax(dim=-1)                                   # [B, T, V]
    mask = frame_mask(logits, lengths).to(p.dtype)          # [B, T]
    if reweight:
        w = 1.0 + torch.exp(-_entropy(x).detach())          # [B, T]
        w = w * mask
        n = mask.sum(dim=1, keepdim=True)
        w = n * w / w.sum(dim=1, keepdim=True).clamp(min=1e-12)
    else:
        w = mask
    cov = torch.einsum("btv,bt,btu->bvu", p, w, p)          # [B, V, V]
    cov = cov / cov.sum(dim=2, keepdim=True).clamp(min=1e-12)
    V = num_classes or logits.shape[-1]
    return (cov.sum(dim=(1, 2)) - cov.diagonal(dim1=1, dim2=2).sum(dim=1)) / V


def suta_loss(logits, lengths=None, alpha: float = 0.3, temperature: float = 2.5,
              blank_id: int = 0, reweight: bool = True, num_classes: Optional[int] = None,
              path=None) -> torch.Tensor:
    """SUTA objective ``alpha * L_em + (1 - alpha) * L_mcc`` per utterance."""
    loss = 0.0
    if alpha > 0:
        loss = alpha * entropy_loss(logits, lengths, temperature, blank_id, path=path)
    if alpha < 1:
        loss = loss + (1 - alpha) * mcc_loss(logits, lengths, temperature, reweight, num_classes)
    return loss


def renyi_entropy_loss(logits, lengths=None, alpha: float = 1.5, temperature: float = 2.5,
                       blank_id: int = 0, non_blank: bool = True, path=None) -> torch.Tensor:
    """Mean Renyi entropy ``1/(1-alpha) log sum_v p_v^alpha`` of the tempered posteriors.

    ``alpha = 1`` gives the Shannon entropy; ``alpha = inf`` the min-entropy ``-log max_v p_v``.
    """
    x = logits / temperature
    log_p = x.log_softmax(dim=-1)
    if alpha == 1:
        h = -(log_p.exp() * log_p).sum(-1)
    elif alpha == float("inf"):
        h = -log_p.max(dim=-1).values
    else:
        h = torch.logsumexp(alpha * log_p, dim=-1) / (1 - alpha)
    mask = non_blank_mask(logits, lengths, blank_id, path) if non_blank else frame_mask(logits, lengths)
    return _masked_mean(h, mask)


def negative_sampling_loss(logits, lengths=None, temperature: float = 2.5,
                           threshold: float = 0.04) -> torch.Tensor:
    """SGEM negative sampling: push down the mass of implausible classes.

    Negatives of a frame are the classes whose *untempered* probability is below
    ``threshold * 10 / V``; the loss is the frame mean of ``-log(1 - sum_neg p_tempered)``.
    """
    V = logits.shape[-1]
    with torch.no_grad():
        negatives = logits.softmax(dim=-1) < threshold * 10.0 / V
    p_t = (logits / temperature).softmax(dim=-1)
    neg_mass = (p_t * negatives).sum(dim=-1).clamp(max=1 - 1e-6)
    return _masked_mean(-torch.log1p(-neg_mass), frame_mask(logits, lengths))


def ctc_pseudo_label_loss(logits, targets: Sequence[torch.Tensor], lengths=None,
                          blank_id: int = 0) -> torch.Tensor:
    """CTC loss of ``logits`` against label sequences ``targets`` (one 1-D tensor per item).

    Per utterance, normalised by the target length (``reduction='mean'`` semantics); an empty
    target gives the loss of the all-blank path. Infinite losses (target longer than the input)
    are zeroed. ``targets`` may live on the logits' device (``tta_brain.asr.ctc.greedy_labels``):
    they are concatenated there, and the lengths come from their shapes (no host round trip).
    """
    B, T = logits.shape[:2]
    device = logits.device
    log_probs = logits.float().log_softmax(dim=-1).transpose(0, 1)  # [T, B, V]
    in_lens = torch.full((B,), T, dtype=torch.long) if lengths is None else torch.as_tensor(lengths).long().cpu()
    targets = [torch.as_tensor(t, dtype=torch.long, device=device).reshape(-1) for t in targets]
    tgt_lens = torch.tensor([t.numel() for t in targets], dtype=torch.long)
    flat = torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long, device=device)
    loss = F.ctc_loss(log_probs, flat, in_lens, tgt_lens, blank=blank_id,
                      reduction="none", zero_infinity=True)
    return loss / tgt_lens.clamp(min=1).to(loss.device)


def confidence_weighted_entropy_loss(logits, lengths=None, temperature: float = 2.5,
                                     blank_id: int = 0, path=None) -> torch.Tensor:
    """CEA's confidence-weighted entropy: the mean of ``sigmoid(H_t) * H_t`` over the non-blank
    valid frames, ``H_t`` the entropy of ``softmax(logits_t / T)`` (the weight is not detached:
    frames the model is unsure of count more, in value and gradient)."""
    h = _entropy(logits / temperature)
    return _masked_mean(torch.sigmoid(h) * h, non_blank_mask(logits, lengths, blank_id, path))


def symmetric_cross_entropy_loss(logits, teacher_logits, lengths=None, blank_id: int = 0) -> torch.Tensor:
    """CoTTA's symmetric cross-entropy ``-1/2 sum_v q_v log p_v - 1/2 sum_v p_v log q_v`` per frame
    (``p`` the student's posteriors, ``q`` the teacher's; detach the teacher yourself), averaged
    over the valid frames whose *student* argmax is not blank (0 when there are none)."""
    log_p, log_q = logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    ce = -0.5 * (log_q.exp() * log_p).sum(-1) - 0.5 * (log_p.exp() * log_q).sum(-1)
    return _masked_mean(ce, non_blank_mask(logits, lengths, blank_id))


def temporal_coherence_loss(features: torch.Tensor, mask: torch.Tensor,
                            lengths=None) -> torch.Tensor:
    """CEA's temporal coherence of CNN features ``[B, C, T]``: ``A = softmax(X X^T) X + X`` with
    ``X`` the ``[T, C]`` frames (self-attention smoothing plus the residual; padded frames are no
    keys), then the mean L2 norm of ``A_t - A_{t-1}`` over the frames ``t >= 1`` where ``mask``
    (``[B, T]``, e.g. the non-blank frames) is set. 0 for an utterance without such a frame."""
    x = features.transpose(1, 2)                              # [B, T, C]
    valid = frame_mask(x, lengths)
    att = torch.matmul(x, x.transpose(1, 2))                  # [B, T, T]
    att = att.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    smooth = torch.matmul(att, x) + x
    diff = (smooth[:, 1:] - smooth[:, :-1]).norm(p=2, dim=-1)  # [B, T - 1]
    return _masked_mean(diff, mask[:, 1:] & valid[:, 1:])


def fisher_penalty(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor],
                   fisher: Sequence[torch.Tensor]) -> torch.Tensor:
    """EATA's elastic weight consolidation term ``sum_i F_i (theta_i - theta0_i)^2`` (a scalar;
    multiply by the method's weight)."""
    terms = [(f * (p - a) ** 2).sum() for p, a, f in zip(params, anchors, fisher)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def mean_probability(logits, lengths=None) -> torch.Tensor:
    """The mean posterior vector over the valid frames of each utterance, ``[B, V]``."""
    mask = frame_mask(logits, lengths).to(logits.dtype)[..., None]
    return (logits.softmax(-1) * mask).sum(1) / mask.sum(1).clamp(min=1)


def entropy_margin(num_classes: int, factor: float = 0.4) -> float:
    """The reliability threshold ``E0 = factor * ln V`` of EATA and SAR (``factor * ln(V)`` is
    that fraction of the largest possible entropy of V classes)."""
    return float(factor) * math.log(int(num_classes))
