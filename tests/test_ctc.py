"""CTC decoding: greedy collapse, Viterbi forced alignment, prefix beam search, ARPA n-gram LM."""
import math
from itertools import product

import pytest
import torch

from tta_brain.ctc import ArpaLM, collapse, greedy_path, prefix_beam_search, viterbi_align

BLANK = 0


def path_score(log_probs, path):
    return sum(float(log_probs[t, int(k)]) for t, k in enumerate(path))


def rand_log_probs(T, V, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(T, V, generator=g)).log_softmax(-1)


# ----------------------------------------------------------------------------- greedy
def test_collapse_merges_repeats_and_drops_blanks():
    assert collapse([0, 5, 5, 0, 5, 6, 6, 0]) == [5, 5, 6]
    assert collapse([1, 1, 1]) == [1]
    assert collapse([0, 0, 0]) == []
    assert collapse([]) == []
    assert collapse(torch.tensor([2, 0, 2, 2, 3])) == [2, 2, 3]
    assert collapse([3, 3, 1, 3], blank_id=3) == [1]


def test_greedy_path_batch_and_single():
    x = torch.tensor([[[0.1, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    assert greedy_path(x).tolist() == [[1, 0, 2]]
    assert greedy_path(x[0]).tolist() == [1, 0, 2]


# ----------------------------------------------------------------------------- viterbi
def valid_ctc_path(path, labels):
    return len(path) > 0 and collapse(list(path)) == list(labels)


@pytest.mark.parametrize("labels,T,seed", [
    ([1, 2], 6, 0), ([1, 1], 6, 1), ([2, 2, 2], 8, 2), ([1, 2, 1, 3], 9, 3), ([3], 4, 4),
    ([], 5, 5), ([1, 1], 3, 6),  # tight: exactly label + blank + label
])
def test_viterbi_returns_valid_path(labels, T, seed):
    lp = rand_log_probs(T, 4, seed)
    path = viterbi_align(lp, labels)
    assert path.shape == (T,)
    assert valid_ctc_path(path.tolist(), labels)


@pytest.mark.parametrize("labels,T,V,seed", [
    ([1, 2], 5, 3, 0), ([1, 1], 5, 3, 1), ([2], 6, 3, 2), ([1, 2, 1], 6, 3, 3),
    ([2, 2], 4, 3, 4), ([1, 3, 3], 6, 4, 5),
])
def test_viterbi_is_max_score_path_by_brute_force(labels, T, V, seed):
    lp = rand_log_probs(T, V, seed, scale=3.0)
    best = max((p for p in product(range(V), repeat=T) if collapse(list(p)) == labels),
               key=lambda p: path_score(lp, p))
    path = viterbi_align(lp, labels)
    assert valid_ctc_path(path.tolist(), labels)
    assert path_score(lp, path.tolist()) == pytest.approx(path_score(lp, best), abs=1e-5)
    assert path.tolist() == list(best)  # random scores: the maximum is unique


def test_viterbi_overlong_labels_fall_back_to_greedy():
    lp = rand_log_probs(3, 4, 7)
    assert viterbi_align(lp, [1, 1, 2]).tolist() == lp.argmax(-1).tolist()  # needs 4 frames


# ----------------------------------------------------------------------------- beam search
def test_prefix_beam_search_beats_greedy_by_summing_paths():
    """Classic case: p(blank)=0.6, p(a)=0.4 on both frames. Greedy path 'blank blank' gives ''
    (prob 0.36) but the label 'a' has prob 0.4*0.4 + 0.4*0.6 + 0.6*0.4 = 0.64."""
    lp = torch.tensor([[0.6, 0.4], [0.6, 0.4]]).log()
    assert collapse(greedy_path(lp)) == []
    beams = prefix_beam_search(lp, beam_width=4)
    assert beams[0][0] == [1]
    assert beams[0][1] == pytest.approx(math.log(0.64), abs=1e-6)
    assert beams[1][0] == [] and beams[1][1] == pytest.approx(math.log(0.36), abs=1e-6)


def test_prefix_beam_search_scores_are_exact_label_probabilities():
    """With a beam wide enough to keep everything, each beam's score is log p(labels|x) (the
    CTC forward probability), checked by enumeration of all frame paths."""
    T, V = 4, 3
    lp = rand_log_probs(T, V, 8, scale=1.0)
    probs = {}
    for p in product(range(V), repeat=T):
        key = tuple(collapse(list(p)))
        probs[key] = probs.get(key, 0.0) + math.exp(path_score(lp, p))
    beams = prefix_beam_search(lp, beam_width=1000, prune_top_k=V, token_min_logp=-1e9)
    # (unreachable prefixes such as 'a a a a' in 4 frames may be listed with score -inf)
    beams = [(lab, sc) for lab, sc in beams if sc > -math.inf]
    assert len(beams) == len(probs)
    for labels, score in beams:
        assert score == pytest.approx(math.log(probs[tuple(labels)]), abs=1e-5)
    assert tuple(beams[0][0]) == max(probs, key=probs.get)


def test_prefix_beam_search_repeated_label_needs_blank():
    # a a (no blank between) is one 'a'; a blank a is 'a a'
    lp = torch.tensor([[0.01, 0.98, 0.01], [0.98, 0.01, 0.01], [0.01, 0.98, 0.01]]).log()
    assert prefix_beam_search(lp)[0][0] == [1, 1]
    lp = torch.tensor([[0.01, 0.98, 0.01], [0.01, 0.98, 0.01], [0.01, 0.98, 0.01]]).log()
    assert prefix_beam_search(lp)[0][0] == [1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_beam_search_equals_greedy_on_peaky_posteriors(seed):
    g = torch.Generator().manual_seed(seed)
    T, V = 40, 6
    # random path with runs, blanks and repeated labels separated by blanks
    path = torch.randint(0, V, (T,), generator=g)
    path[::3] = BLANK
    logits = torch.full((T, V), -10.0)
    logits[torch.arange(T), path] = 10.0
    logits += 0.1 * torch.randn(T, V, generator=g)
    lp = logits.log_softmax(-1)
    beams = prefix_beam_search(lp, beam_width=5)
    assert beams[0][0] == collapse(greedy_path(lp))


# ----------------------------------------------------------------------------- ARPA LM
ARPA = """
\\data\\
ngram 1=5
ngram 2=3
ngram 3=1

\\1-grams:
-1.0\t<unk>
-0.5\tA\t-0.3
-0.7\tb\t-0.2
-0.9\tC\t-0.1
-1.2\t</s>

\\2-grams:
-0.2\tA B\t-0.05
-0.4\tB A
-0.6\tA C

\\3-grams:
-0.1\tA B A

\\end\\
"""

LN10 = math.log(10)


@pytest.fixture
def arpa_path(tmp_path):
    p = tmp_path / "lm.arpa"
    p.write_text(ARPA, encoding="utf-8")
    return str(p)


def test_arpa_lm_reads_probabilities_and_applies_backoff(arpa_path):
    lm = ArpaLM(arpa_path)
    assert lm.order == 3
    # explicit n-grams, any case
    assert lm.score([], "a") == pytest.approx(-0.5 * LN10)
    assert lm.score(["A"], "B") == pytest.approx(-0.2 * LN10)
    assert lm.score(["a", "b"], "a") == pytest.approx(-0.1 * LN10)
    # missing bigram (C, A): backoff(C) + p(A)
    assert lm.score(["C"], "A") == pytest.approx((-0.1 - 0.5) * LN10)
    # missing trigram (B, A, C)? context is the last order-1 = 2 words: (B, A) unseen as a
    # context -> backoff 0, then bigram (A, C) exists
    assert lm.score(["X", "B", "A"], "C") == pytest.approx(-0.6 * LN10)
    # missing trigram (A, B, C): backoff(A B) + missing bigram (B, C): backoff(B) + p(C)
    assert lm.score(["A", "B"], "C") == pytest.approx((-0.05 - 0.2 - 0.9) * LN10)
    # unknown word -> <unk>, after backing off
    assert lm.score(["A"], "ZZZ") == pytest.approx((-0.3 - 1.0) * LN10)


def test_arpa_lm_rejects_non_arpa(tmp_path):
    p = tmp_path / "x.arpa"
    p.write_text("hello world\n")
    with pytest.raises(ValueError, match="no n-grams"):
        ArpaLM(str(p))


def test_lm_changes_the_beam_search_winner(tmp_path):
    """Acoustics slightly prefer the word 'A' over 'B'; an LM that strongly prefers 'B' flips
    the winner. Labels: 0 blank, 1 '|', 2 'A', 3 'B'."""
    chars = {1: "|", 2: "A", 3: "B"}
    lp = torch.tensor([[0.02, 0.02, 0.52, 0.44],
                       [0.02, 0.96, 0.01, 0.01]]).log()
    plain = prefix_beam_search(lp, beam_width=5, word_delimiter_id=1)
    assert plain[0][0] == [2, 1]
    p = tmp_path / "lm.arpa"
    p.write_text("\\data\\\nngram 1=3\n\n\\1-grams:\n-3.0\tA\n-0.1\tB\n-5.0\t<unk>\n\n\\end\\\n")
    lm = ArpaLM(str(p))
    scorer = lm.label_scorer(lambda i: chars.get(i, ""))
    assert scorer((), (3,)) == pytest.approx(-0.1 * LN10)
    with_lm = prefix_beam_search(lp, beam_width=5, word_delimiter_id=1, lm_score=scorer,
                                 lm_weight=0.5)
    assert with_lm[0][0] == [3, 1]
    # score = acoustic log-prob + lm_weight * lm
    ac = math.log(0.44 * 0.96)
    assert with_lm[0][1] == pytest.approx(ac + 0.5 * -0.1 * LN10, abs=1e-4)
    # a zero LM weight gives the acoustic winner back
    zero = prefix_beam_search(lp, beam_width=5, word_delimiter_id=1, lm_score=scorer, lm_weight=0.0)
    assert zero[0][0] == [2, 1]
