"""SGEM's pseudo path and its word-LM decode, against expectations derived apart from the code
under test: an exhaustive search over every frame path of a tiny vocabulary, pyctcdecode called
directly, and the greedy path (mutation audit of the LM path: each test names the mutants it
kills)."""
import itertools
import math

import pytest
import torch

from test_lm import (ID, SENTENCES, TOKENS, emissions, labels_of, needs_lm, spell,
                     write_bigram_arpa)
from tta_brain.asr.ctc import collapse, prefix_beam_search, viterbi_align
from tta_brain.asr.lm import arpa_unigrams
from tta_brain.methods.sgem import best_path


def exhaustive(lp):
    """Every frame path of ``lp [T, V]`` (blank 0): labelling -> (log p(labelling), its most
    probable path)."""
    T, V = lp.shape
    total, best = {}, {}
    for path in itertools.product(range(V), repeat=T):
        s = float(sum(lp[t, k] for t, k in enumerate(path)))
        key = tuple(collapse(list(path)))
        total[key] = float(torch.logaddexp(torch.tensor(total.get(key, -math.inf)),
                                           torch.tensor(s)))
        if key not in best or s > best[key][0]:
            best[key] = (s, path)
    return {k: (v, best[k][1]) for k, v in total.items()}


# ----------------------------------------------------------------------------- no LM
def test_a_beam_of_one_is_the_greedy_path():
    """``beam_width: 1`` is the official code's greedy argmax (the module docstring). Here a
    width-1 prefix search keeps [a] (0.6 * 0.3 + 0.6 * 0.3 = 0.36) where the greedy path reads
    a b. Kills ``beam_width <= 1`` -> ``< 1``."""
    probs = torch.tensor([[0.4, 0.6, 1e-6], [0.3, 0.3, 0.4]])
    logits = probs.log()[None]
    assert collapse(logits[0].argmax(-1).tolist()) == [1, 2]
    assert prefix_beam_search(logits[0].log_softmax(-1), 1)[0][0] == [1]
    assert torch.equal(best_path(logits, 1, 0), logits.argmax(-1))
    assert torch.equal(best_path(logits, 0, 0), logits.argmax(-1))


@pytest.mark.parametrize("seed", range(12))
def test_the_pseudo_path_is_the_best_labelling_on_its_best_frame_path(seed):
    """Without an LM the pseudo path is the most probable labelling (summed over its frame
    paths) on its most probable frame path, found here by enumerating all 3**5 paths. A beam of
    64 holds every prefix of 5 frames of 2 labels, so the search is exact. The logits are
    unnormalised (shifted by -100, as a model's may be): they are scored as log-probabilities.
    Kills: the worst beam taken ([-1]), a beam of 2 in place of beam_width (seed 4), the beam
    search run on the raw logits (seeds 2, 9: token_min_logp pruned all but the best label),
    the labels aligned reversed."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 5, 3, generator=g) * 1.5 - 100.0
    found = exhaustive(logits[0].log_softmax(-1))
    ranked = sorted(found, key=lambda k: -found[k][0])
    want = ranked[0]
    assert found[want][0] - found[ranked[1]][0] > 0.02          # no near tie
    path = best_path(logits, 64, 0)
    assert path.shape == (1, 5)
    assert tuple(path[0].tolist()) == found[want][1]


def test_the_beam_search_keeps_each_frames_best_label_in_a_large_vocabulary():
    """"The frame's best label is always kept" (prefix_beam_search's docstring), also where a
    vocabulary of 8000 puts every label below token_min_logp (-8 > log(1/8000)): the frame's
    best label was dropped and the frame read as a blank. Kills ``clamp_(min=1)`` -> 0."""
    V = 8000
    lp = torch.zeros(3, V)
    lp[0, 7] = lp[2, 9] = 30.0                # frames 0 and 2: clear labels
    lp[1, 5] = 0.3                            # frame 1: label 5, 1.35x any other, p ~ 1.7e-4,
    lp[1, [0, 7, 9]] = -30.0                  # more than the blank and 7 and 9 (their merges)
    lp = lp.log_softmax(-1)
    assert float(lp[1].max()) < -8.0
    assert prefix_beam_search(lp, 5)[0][0] == [7, 5, 9]


# ----------------------------------------------------------------------------- with the LM
def test_arpa_unigrams_without_a_backoff_weight_are_words_too(tmp_path):
    """ARPA's back-off weight is optional (SRILM leaves a zero one out; a 1-gram LM has none):
    such unigrams were dropped from the decoder's word list. Kills ``len(parts) >= 2`` -> ``> 2``."""
    path = tmp_path / "lm.arpa"
    path.write_text("\\data\\\nngram 1=5\n\n\\1-grams:\n-1.0\t<s>\t-0.3\n-0.5\tTHE\n"
                    "-0.7\tCAT\t-0.2\n-0.9\tSAT\n-1.0\t</s>\n\n\\end\\\n")
    assert arpa_unigrams(str(path)) == ["THE", "CAT", "SAT"]


@needs_lm
def test_the_lm_case_as_asked_and_of_a_mixed_lm(tmp_path):
    """``lowercase=True``: the letters in lower case (they were upper-cased); an LM as much
    lower as upper case is "neither" (the docstring): the model's case. Kills ``str.lower if
    lowercase`` -> ``str.upper``, ``lower > n / 2`` -> ``>=``, the upper-case test dropped."""
    from tta_brain.asr.lm import LMBeamSearch
    upper = write_bigram_arpa(SENTENCES, tmp_path / "upper.arpa")
    assert LMBeamSearch(TOKENS, upper, lowercase=True).labels[ID["E"]] == "e"
    mixed = write_bigram_arpa(["the CAT", "sat ON"], tmp_path / "mixed.arpa")
    assert sorted(arpa_unigrams(mixed)) == ["CAT", "ON", "sat", "the"]
    lower_tokens = [t.lower() if len(t) == 1 else t for t in TOKENS]
    assert LMBeamSearch(TOKENS, mixed).labels[ID["E"]] == "E"
    assert LMBeamSearch(lower_tokens, mixed).labels[ID["E"]] == "e"


@needs_lm
def test_a_letter_whose_upper_case_is_two_letters_keeps_its_own_label(tmp_path):
    """"ß".upper() is "SS": the letter keeps its own label, and a frame of it decodes to it,
    not to S S. Kills the ``len(label) != 1`` guard dropped."""
    from tta_brain.asr.lm import LMBeamSearch
    arpa = write_bigram_arpa(SENTENCES + ["STRASSE"], tmp_path / "lm.arpa")
    tokens = TOKENS + ["ß"]
    search = LMBeamSearch(tokens, arpa)
    assert search.labels[-1] == "ß"
    lp = torch.full((3, len(tokens)), 0.01 / (len(tokens) - 1))
    lp[0, -1] = lp[2, -1] = 0.99                                   # ß, ß with a blank between
    lp[1, 0] = 0.99
    lp[1, -1] = 0.01 / (len(tokens) - 1)
    assert search(lp.log(), 5)[0][0] == [len(tokens) - 1, len(tokens) - 1]


def pyctcdecode_beams(arpa, lp, alpha, beta, unk, beam_width, prune, token_min):
    """The beams of pyctcdecode's own decoder: letters as they are, blank "", delimiter " ",
    the special tokens private characters."""
    import pyctcdecode
    labels = ["" if t == "<pad>" else " " if t == "|" else t if len(t) == 1 else chr(0xE000 + i)
              for i, t in enumerate(TOKENS)]
    dec = pyctcdecode.build_ctcdecoder(labels, kenlm_model_path=arpa, alpha=alpha, beta=beta,
                                       unk_score_offset=unk)
    try:
        return [(b[0], b[-1]) for b in dec.decode_beams(
            lp.numpy(), beam_width=beam_width, beam_prune_logp=prune, token_min_logp=token_min)]
    finally:
        dec.cleanup()


@needs_lm
@pytest.mark.parametrize("seed", range(2))
def test_lm_beams_are_pyctcdecodes_with_the_same_settings(tmp_path, seed):
    """The beams (texts, combined scores) of LMBeamSearch are pyctcdecode's own decoder's with
    the same LM weight, word bonus, unknown-word offset and prunings. Kills alpha and beta
    swapped, the unknown-word offset's sign flipped, beam_prune_logp and token_min_logp
    swapped."""
    from tta_brain.asr.lm import LMBeamSearch
    arpa = write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(40, len(TOKENS), generator=g) * 2.5).log_softmax(-1)
    alpha, beta, unk = 0.3, 2.0, -7.0
    search = LMBeamSearch(TOKENS, arpa, alpha=alpha, beta=beta, unk_score_offset=unk,
                          beam_prune_logp=-10.0, token_min_logp=-5.0)
    want = pyctcdecode_beams(arpa, lp, alpha, beta, unk, 8, -10.0, -5.0)
    got = search(lp, beam_width=8)
    assert got == [(search.text_to_labels(text), pytest.approx(score)) for text, score in want]
    search.close()


@needs_lm
def test_sgems_pseudo_path_aligns_the_lm_searchs_winner(make, tmp_path):
    """SGEM with ``lm_path``: the pseudo path is the forced alignment of the word-LM search's
    best hypothesis, with ``lm_weight`` as the LM weight and ``word_bonus`` per word. Kills: the
    LM not passed to the search, the worst LM beam taken, lm_weight and word_bonus swapped,
    a beam of 2 in place of beam_width, lm_unigrams not passed on."""
    arpa = write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")
    logits = emissions(spell("THE CA? SAT", {"R": 0.50, "T": 0.46}))[None]
    acoustic, with_lm = labels_of("THE CAR SAT"), labels_of("THE CAT SAT")
    m = make("sgem", lm_path=arpa, lm_weight=0.5, word_bonus=1.5, beam_width=5)
    assert collapse(m.pseudo_path(logits)[0].tolist()) == with_lm
    # no LM weight (a word bonus only): the acoustic winner
    m = make("sgem", lm_path=arpa, lm_weight=0.0, word_bonus=1.5, beam_width=5)
    assert collapse(m.pseudo_path(logits)[0].tolist()) == acoustic
    # the path is the alignment of the search's best beam at the method's beam width
    m = make("sgem", lm_path=arpa, beam_width=6)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 30, len(TOKENS), generator=g) * 3.0
        lp = x[0].log_softmax(-1)
        best = m.lm_search(lp, 6)[0][0]
        assert torch.equal(m.pseudo_path(x), viterbi_align(lp, best, 0)[None]), seed
    # a word list (a KenLM binary's words): words outside it are unknown to the search
    words = tmp_path / "words.txt"
    words.write_text("\n".join(sorted({w for s in SENTENCES for w in s.split()} - {"CAT"})))
    m = make("sgem", lm_path=arpa, lm_unigrams=str(words), beam_width=5)
    assert collapse(m.pseudo_path(logits)[0].tolist()) == acoustic
