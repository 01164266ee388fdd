"""CTC decoding: greedy paths and labels, prefix beam search (no LM) and forced alignment.

The word n-gram LM decoder (pyctcdecode + KenLM, the optional ``[lm]`` extra) is in
:mod:`tta_brain.asr.lm`; it returns the best hypothesis' labels, which :func:`viterbi_align` then
aligns to the frames like those of :func:`prefix_beam_search`.
"""
import math
from operator import itemgetter
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["greedy_path", "collapse", "greedy_labels", "viterbi_align", "prefix_beam_search"]

_NEG = -math.inf


def greedy_path(logits: torch.Tensor) -> torch.Tensor:
    """Frame-level argmax path ``[T]`` (or ``[B, T]``)."""
    return logits.argmax(dim=-1)


def collapse(path: Sequence[int], blank_id: int = 0) -> List[int]:
    """Merge repeats and drop blanks: a frame path -> a label sequence."""
    if torch.is_tensor(path):
        runs = torch.unique_consecutive(path.reshape(-1))
        return runs[runs != blank_id].tolist()
    out, prev = [], None
    for k in path:
        if k != prev and k != blank_id:
            out.append(k)
        prev = k
    return out


def greedy_labels(logits: torch.Tensor, blank_id: int = 0,
                  lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Greedy CTC label sequences of ``logits [B, T, V]`` (or ``[T, V]``): per utterance the
    argmax path (its first ``lengths[b]`` frames) with repeats merged and blanks dropped, a 1-D
    long tensor on the logits' device (no per-frame Python, no host copy of the path)."""
    path = logits.detach().argmax(dim=-1)
    if path.dim() == 1:
        path = path[None]
    if lengths is not None:
        lengths = torch.as_tensor(lengths).tolist()
    out = []
    for b, p in enumerate(path):
        runs = torch.unique_consecutive(p if lengths is None else p[:int(lengths[b])])
        out.append(runs[runs != blank_id])
    return out


def viterbi_align(log_probs: torch.Tensor, labels: Sequence[int], blank_id: int = 0) -> torch.Tensor:
    """Best CTC frame path ``[T]`` of ``labels`` through ``log_probs [T, V]`` (forced alignment,
    ``torchaudio.functional.forced_align``), on the device of ``log_probs``.

    Empty ``labels`` give the all-blank path; labels that cannot fit (more labels + repeats than
    frames) give the greedy path.
    """
    T = log_probs.shape[0]
    labels = torch.as_tensor(labels, dtype=torch.long).reshape(-1).cpu()
    if labels.numel() == 0:
        return torch.full((T,), blank_id, dtype=torch.long, device=log_probs.device)
    if bool((labels == blank_id).any()):
        raise ValueError("viterbi_align: labels must not contain the blank")
    need = labels.numel() + int((labels[1:] == labels[:-1]).sum())
    if need > T:
        return log_probs.argmax(dim=-1)
    from torchaudio.functional import forced_align
    path, _ = forced_align(log_probs.detach().float()[None].contiguous(),
                           labels[None].to(log_probs.device), blank=blank_id)
    return path[0].long()


def _log_add(a: float, b: float, exp=math.exp, log=math.log) -> float:
    """log(e^a + e^b) as max + log(1 + e^(min - max)), -inf handled first."""
    if a == _NEG:
        return b
    if b == _NEG:
        return a
    return a + log(1.0 + exp(b - a)) if a >= b else b + log(exp(a - b) + 1.0)


def prefix_beam_search(log_probs: torch.Tensor, beam_width: int = 5, blank_id: int = 0,
                       prune_top_k: int = 16, token_min_logp: float = -8.0
                       ) -> List[Tuple[List[int], float]]:
    """CTC prefix beam search (acoustic only) over ``log_probs [T, V]``.

    Returns the beams ``[(labels, log p(labels | x))]`` best first (the score sums every frame
    path of the prefix that the search kept). Only the ``prune_top_k`` most likely labels of each
    frame are expanded, and of those only labels with log-probability above ``token_min_logp``
    (the frame's best label is always kept, and the blank is always expanded). ``log_probs`` must
    not hold NaN. For a word n-gram LM, see :class:`tta_brain.asr.lm.LMBeamSearch`.
    """
    lp = log_probs.detach().float().cpu()
    T, V = lp.shape
    if T == 0:
        return [([], 0.0)]
    # per frame, the labels to expand, best first, then the blank if it is not among them
    vals, idx = torch.topk(lp, min(prune_top_k, V), dim=-1)
    n_keep = (vals > token_min_logp).sum(-1).clamp_(min=1).tolist()   # values sorted: a prefix
    frames = []
    for cs, ps, n, p_blank in zip(idx.tolist(), vals.tolist(), n_keep, lp[:, blank_id].tolist()):
        cs = cs[:n]
        cand = list(zip(cs, ps[:n]))
        if blank_id not in cs:
            cand.append((blank_id, p_blank))
        frames.append(cand)
    NEG, log_add = _NEG, _log_add

    # prefixes are the nodes of a trie (node 0 = empty): parent[n], label[n]; node * V + c -> child
    parent, label, children = [-1], [-1], {}
    beams = [(0, 0.0, NEG)]            # (node, log p ending in a blank, log p ending in its label)
    for cand in frames:
        if len(cand) == 1:             # only the blank: every beam extends by it, order unchanged
            p = cand[0][1]
            nxt_beams = []
            for node, pb, pnb in beams:
                total = log_add(pb, pnb)
                nxt_beams.append((node, total + p, NEG))
            beams = nxt_beams
            continue
        nxt = {}                       # node -> [log p blank-ended, log p label-ended]
        for node, pb, pnb in beams:
            total = log_add(pb, pnb)
            last = label[node]
            base = node * V
            for c, p in cand:
                if c == blank_id:      # the prefix stays, now ending in a blank
                    v = total + p
                    e = nxt.get(node)
                    if e is None:
                        nxt[node] = [v, NEG]
                    else:
                        e[0] = log_add(e[0], v)
                    continue
                child = children.get(base + c)
                if child is None:
                    child = children[base + c] = len(parent)
                    parent.append(node)
                    label.append(c)
                    e = nxt[child] = [NEG, NEG]
                else:
                    e = nxt.get(child)
                    if e is None:
                        e = nxt[child] = [NEG, NEG]
                if c == last:          # a repeat extends only after a blank ...
                    v = pb + p
                    e[1] = log_add(e[1], v)
                    v = pnb + p        # ... and otherwise merges into the prefix
                    s = nxt.get(node)
                    if s is None:
                        nxt[node] = [NEG, v]
                    else:
                        s[1] = log_add(s[1], v)
                else:
                    v = total + p
                    e[1] = log_add(e[1], v)
        scored = []
        for node, (pb, pnb) in nxt.items():
            s = log_add(pb, pnb)
            if s > NEG:
                scored.append((s, node, pb, pnb))
        scored.sort(key=itemgetter(0), reverse=True)    # stable: ties keep the expansion order
        beams = [(node, pb, pnb) for _, node, pb, pnb in scored[:beam_width]]
    out = []
    for node, pb, pnb in beams:
        s = log_add(pb, pnb)
        labels = []
        while node:
            labels.append(label[node])
            node = parent[node]
        labels.reverse()
        out.append((labels, s))
    out.sort(key=itemgetter(1), reverse=True)
    return out
