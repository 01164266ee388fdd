"""CTC decoding: greedy, prefix beam search (optional word n-gram LM) and Viterbi alignment."""
import math
from collections import defaultdict
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["greedy_path", "collapse", "viterbi_align", "prefix_beam_search", "ArpaLM"]


def greedy_path(logits: torch.Tensor) -> torch.Tensor:
    """Frame-level argmax path ``[T]`` (or ``[B, T]``)."""
    return logits.argmax(dim=-1)


def collapse(path: Sequence[int], blank_id: int = 0) -> List[int]:
    """Merge repeats and drop blanks: a frame path -> a label sequence."""
    out, prev = [], None
    for k in (path.tolist() if torch.is_tensor(path) else path):
        if k != prev and k != blank_id:
            out.append(k)
        prev = k
    return out


def viterbi_align(log_probs: torch.Tensor, labels: Sequence[int], blank_id: int = 0) -> torch.Tensor:
    """Best CTC frame path ``[T]`` of ``labels`` through ``log_probs [T, V]`` (forced alignment).

    Returns the greedy path when the labels cannot fit (more labels + repeats than frames).
    """
    T = log_probs.shape[0]
    labels = list(labels)
    ext = [blank_id]
    for l in labels:
        ext += [l, blank_id]
    S = len(ext)
    need = len(labels) + sum(1 for a, b in zip(labels, labels[1:]) if a == b)
    if need > T:
        return log_probs.argmax(dim=-1)
    lp = log_probs.detach().float().cpu()
    ext_t = torch.tensor(ext)
    emit = lp[:, ext_t]                                     # [T, S]
    neg = -float("inf")
    alpha = torch.full((S,), neg)
    alpha[0] = emit[0, 0]
    if S > 1:
        alpha[1] = emit[0, 1]
    # skip transitions s-2 -> s allowed for labels differing from the label two back
    can_skip = torch.zeros(S, dtype=torch.bool)
    for s in range(2, S):
        can_skip[s] = ext[s] != blank_id and ext[s] != ext[s - 2]
    back = torch.zeros(T, S, dtype=torch.long)
    idx = torch.arange(S)
    for t in range(1, T):
        stay = alpha
        step = torch.cat([torch.tensor([neg]), alpha[:-1]])
        skip = torch.cat([torch.tensor([neg, neg]), alpha[:-2]])[:S]  # S = 1: empty labels
        skip = torch.where(can_skip, skip, torch.tensor(neg))
        cand = torch.stack([stay, step, skip])              # [3, S]
        best, arg = cand.max(dim=0)
        back[t] = idx - arg
        alpha = best + emit[t]
    s = S - 1 if S == 1 or alpha[S - 1] >= alpha[S - 2] else S - 2
    path = torch.empty(T, dtype=torch.long)
    for t in range(T - 1, -1, -1):
        path[t] = ext[s]
        s = int(back[t, s]) if t > 0 else s
    return path


def _logsumexp(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


def prefix_beam_search(log_probs: torch.Tensor, beam_width: int = 5, blank_id: int = 0,
                       word_delimiter_id: Optional[int] = None,
                       lm_score: Optional[Callable[[Tuple[int, ...], Tuple[int, ...]], float]] = None,
                       lm_weight: float = 0.5, word_bonus: float = 0.0,
                       prune_top_k: int = 16, token_min_logp: float = -8.0
                       ) -> List[Tuple[List[int], float]]:
    """CTC prefix beam search over ``log_probs [T, V]``.

    Without ``lm_score`` this is a pure acoustic prefix beam search. With it, each completed word
    (a word delimiter following a non-empty word) adds ``lm_weight * lm_score(history, word) +
    word_bonus``, where ``history`` and ``word`` are tuples of label ids. Returns the beams
    ``[(labels, score)]`` best first. Only the ``prune_top_k`` most likely labels of each frame
    are expanded, and of those only labels with log-probability above ``token_min_logp`` (the
    frame's best label is always kept).
    """
    lp = log_probs.detach().float().cpu()
    T, V = lp.shape
    # beam: prefix -> (p_blank, p_nonblank, lm_total) in log domain
    beams = {(): (0.0, -math.inf, 0.0)}

    def words_of(prefix):
        if word_delimiter_id is None:
            return ()
        out, cur = [], []
        for k in prefix:
            if k == word_delimiter_id:
                if cur:
                    out.append(tuple(cur))
                cur = []
            else:
                cur.append(k)
        return tuple(out), tuple(cur)

    def lm_bonus(prefix, c):
        if lm_score is None or word_delimiter_id is None or c != word_delimiter_id:
            return 0.0
        done, cur = words_of(prefix)
        if not cur:
            return 0.0
        return lm_weight * lm_score(tuple(done), cur) + word_bonus

    for t in range(T):
        row = lp[t]
        vals, idx = torch.topk(row, min(prune_top_k, V))
        top = [i for v, i in zip(vals.tolist(), idx.tolist()) if v > token_min_logp] or [idx[0].item()]
        if blank_id not in top:
            top.append(blank_id)
        nxt = defaultdict(lambda: [-math.inf, -math.inf, 0.0])
        for prefix, (pb, pnb, lm) in beams.items():
            total = _logsumexp(pb, pnb)
            for c in top:
                p = float(row[c])
                if c == blank_id:
                    e = nxt[prefix]
                    e[0] = _logsumexp(e[0], total + p)
                    e[2] = lm
                    continue
                last = prefix[-1] if prefix else None
                new = prefix + (c,)
                bonus = lm_bonus(prefix, c)
                e = nxt[new]
                if c == last:
                    e[1] = _logsumexp(e[1], pb + p)        # repeat needs a blank in between
                    s = nxt[prefix]
                    s[1] = _logsumexp(s[1], pnb + p)       # or collapses into the prefix
                    s[2] = lm
                else:
                    e[1] = _logsumexp(e[1], total + p)
                e[2] = lm + bonus
        live = [kv for kv in nxt.items() if _logsumexp(kv[1][0], kv[1][1]) > -math.inf]
        scored = sorted(live, key=lambda kv: _logsumexp(kv[1][0], kv[1][1]) + kv[1][2],
                        reverse=True)[:beam_width]
        beams = {k: tuple(v) for k, v in scored}
    out = [(list(k), _logsumexp(v[0], v[1]) + v[2]) for k, v in beams.items()]
    return sorted(out, key=lambda x: x[1], reverse=True)


class ArpaLM:
    """A word n-gram LM read from an ARPA file (log10 probabilities with back-off).

    ``score(history_words, word)`` returns the natural-log probability of ``word`` (a string)
    after ``history_words``. ``label_scorer(id_to_char)`` adapts it to ``prefix_beam_search``.
    """

    def __init__(self, path: str):
        self.order = 0
        self.prob, self.backoff = {}, {}
        section = 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("\\data\\") or line.startswith("ngram "):
                    continue
                if line.startswith("\\") and line.endswith("-grams:"):
                    section = int(line[1:line.index("-")])
                    self.order = max(self.order, section)
                    continue
                if line == "\\end\\" or section == 0:
                    continue
                parts = line.split()
                n = section
                words = tuple(w.upper() for w in parts[1:1 + n])
                self.prob[words] = float(parts[0]) * math.log(10)
                if len(parts) > 1 + n:
                    self.backoff[words] = float(parts[1 + n]) * math.log(10)
        if not self.prob:
            raise ValueError(f"{path}: no n-grams found; is this an ARPA file?")
        self.unk = self.prob.get(("<UNK>",), -100.0)

    def score(self, history: Sequence[str], word: str) -> float:
        ctx = tuple(w.upper() for w in history)[-(self.order - 1):] if self.order > 1 else ()
        word = word.upper()
        penalty = 0.0
        while True:
            key = ctx + (word,)
            if key in self.prob:
                return penalty + self.prob[key]
            if not ctx:
                return penalty + self.unk
            penalty += self.backoff.get(ctx, 0.0)
            ctx = ctx[1:]

    def label_scorer(self, id_to_char: Callable[[int], str]):
        def scorer(done: Tuple[Tuple[int, ...], ...], cur: Tuple[int, ...]) -> float:
            hist = ["".join(id_to_char(i) for i in w) for w in done]
            return self.score(hist, "".join(id_to_char(i) for i in cur))
        return scorer
