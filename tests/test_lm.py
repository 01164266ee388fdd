"""Word n-gram LM beam search (``tta_brain.asr.lm``: pyctcdecode + KenLM, the ``[lm]`` extra).

The LMs are ARPA files that the tests estimate themselves from a handful of sentences (a back-off
bigram with absolute discounting). Tests that need the extra skip when it is not installed.
"""
import math
import sys
from collections import Counter

import pytest
import torch

from tta_brain.asr.ctc import collapse, prefix_beam_search, viterbi_align
from tta_brain.asr.lm import LM_EXTRA_HINT, LMBeamSearch, arpa_unigrams, require_lm_packages
from tta_brain.lobes.hf_ctc import W2V2_CHAR_VOCAB

try:
    require_lm_packages()
    LM_MISSING = None
except ImportError as err:
    LM_MISSING = str(err)
needs_lm = pytest.mark.skipif(LM_MISSING is not None,
                              reason=f"the [lm] extra is not installed ({LM_MISSING})")

TOKENS = list(W2V2_CHAR_VOCAB)             # blank <pad> = 0, word delimiter | = 4
ID = {t: i for i, t in enumerate(TOKENS)}
BLANK, DELIM = 0, ID["|"]
SENTENCES = ["THE CAT SAT", "THE CAT RAN", "A CAT SAT", "THE CAT SAT ON THE MAT",
             "MY CAR RAN", "MY CAR IS RED", "THE DOG SAT", "A DOG RAN"]


def write_bigram_arpa(sentences, path, discount=0.5, lowercase=False):
    """A back-off bigram LM (absolute discounting) of whitespace-split sentences, as ARPA.

    Every unigram gets a back-off weight (0 for words never seen as a context), as KenLM's
    ``lmplz`` writes them."""
    uni, bi = Counter(), Counter()
    for s in sentences:
        words = ["<s>"] + (s.lower() if lowercase else s).split() + ["</s>"]
        uni.update(words[1:])
        bi.update(zip(words[:-1], words[1:]))
    n = sum(uni.values())
    p1 = {w: c / (n + 1) for w, c in uni.items()}
    p1["<unk>"] = 1 / (n + 1)
    count, types, seen_mass = Counter(), Counter(), Counter()
    for (h, w), c in bi.items():
        count[h] += c
        types[h] += 1
        seen_mass[h] += p1[w]
    bow = {h: discount * types[h] / count[h] / (1 - seen_mass[h]) for h in count}
    lines = ["\\data\\", f"ngram 1={len(p1) + 1}", f"ngram 2={len(bi)}", "", "\\1-grams:",
             f"-99\t<s>\t{math.log10(bow['<s>']):.6f}"]
    for w in sorted(p1):
        lines.append(f"{math.log10(p1[w]):.6f}\t{w}\t{math.log10(bow.get(w, 1.0)):.6f}")
    lines += ["", "\\2-grams:"]
    for (h, w), c in sorted(bi.items()):
        lines.append(f"{math.log10((c - discount) / count[h]):.6f}\t{h} {w}")
    lines += ["", "\\end\\", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


def emissions(spec):
    """Log-probs ``[T, V]`` for ``spec``: a list of {char: prob} (or a char), each one frame of
    that distribution followed by a blank frame; leftover mass spread over the other labels."""
    rows = []
    for item in spec:
        dist = {item: 0.96} if isinstance(item, str) else item
        for d in (dist, {"<pad>": 0.96}):
            row = torch.full((len(TOKENS),), (1 - sum(d.values())) / (len(TOKENS) - len(d)))
            for ch, p in d.items():
                row[ID[ch]] = p
            rows.append(row)
    return torch.stack(rows).log()


def spell(text, ambiguous=None):
    """``text`` as an emission spec; ``ambiguous`` replaces the character marked ``?``."""
    return [ambiguous if ch == "?" else ("|" if ch == " " else ch) for ch in text]


def labels_of(text):
    return [DELIM if ch == " " else ID[ch] for ch in text]


@pytest.fixture
def arpa(tmp_path):
    return write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")


# ----------------------------------------------------------------------------- always run
def test_missing_lm_packages_give_a_one_line_error_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pyctcdecode", None)       # "not installed"
    with pytest.raises(ImportError) as err:
        LMBeamSearch(TOKENS, str(tmp_path / "lm.arpa"))
    msg = str(err.value)
    assert "\n" not in msg
    assert 'pip install -e ".[lm]"' in msg and "[lm] extra" in msg and "pyctcdecode" in msg
    assert LM_EXTRA_HINT in msg


def test_test_arpa_writer_and_unigram_reader(tmp_path):
    path = write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")
    words = arpa_unigrams(path)
    assert sorted(words) == sorted({w for s in SENTENCES for w in s.split()})
    with pytest.raises(ValueError, match="no unigrams"):
        (tmp_path / "x.arpa").write_text("hello\n")
        arpa_unigrams(str(tmp_path / "x.arpa"))


# ----------------------------------------------------------------------------- needs the extra
@needs_lm
def test_kenlm_reads_the_test_lm(arpa):
    import kenlm
    lm = kenlm.Model(arpa)
    assert lm.order == 2
    assert lm.score("THE CAT SAT", bos=True, eos=True) > lm.score("THE CAR SAT", bos=True, eos=True)
    assert lm.score("MY CAR RAN", bos=True, eos=True) > lm.score("MY CAT RAN", bos=True, eos=True)


@needs_lm
@pytest.mark.parametrize("text,acoustic,with_lm", [
    ("THE CA? SAT", "THE CAR SAT", "THE CAT SAT"),     # acoustics: R 0.50 > T 0.46
    ("MY CA? RAN", "MY CAT RAN", "MY CAR RAN"),        # acoustics: T 0.50 > R 0.46
])
def test_lm_changes_the_beam_search_winner(arpa, text, acoustic, with_lm):
    """One character is ambiguous; the acoustics slightly prefer the wrong word, and the bigram
    LM picks the word its context predicts (the same two words, opposite choices)."""
    first, second = ("R", "T") if acoustic.split()[1] == "CAR" else ("T", "R")
    lp = emissions(spell(text, {first: 0.50, second: 0.46}))
    assert prefix_beam_search(lp, 5)[0][0] == labels_of(acoustic)
    search = LMBeamSearch(TOKENS, arpa, blank_id=BLANK, alpha=0.5, beta=1.5)
    beams = search(lp, beam_width=5)
    assert beams[0][0] == labels_of(with_lm)
    assert all(a[1] >= b[1] for a, b in zip(beams, beams[1:]))          # best first
    # a zero LM weight (and no word bonus) gives the acoustic winner back
    plain = LMBeamSearch(TOKENS, arpa, blank_id=BLANK, alpha=0.0, beta=0.0)
    assert plain(lp, beam_width=5)[0][0] == labels_of(acoustic)
    # the LM's labels go into forced alignment like the acoustic search's
    path = viterbi_align(lp, beams[0][0], BLANK)
    assert collapse(path.tolist()) == labels_of(with_lm)


@needs_lm
def test_lowercase_lm_with_uppercase_tokens(tmp_path):
    arpa = write_bigram_arpa(SENTENCES, tmp_path / "lower.arpa", lowercase=True)
    lp = emissions(spell("THE CA? SAT", {"R": 0.50, "T": 0.46}))
    search = LMBeamSearch(TOKENS, arpa)                         # case detected from the LM
    assert search(lp)[0][0] == labels_of("THE CAT SAT")
    assert search.text_to_labels(" the  cat ") == labels_of("THE CAT")


@needs_lm
def test_tokens_as_id_to_token_dict_and_special_tokens(arpa):
    search = LMBeamSearch(dict(enumerate(TOKENS)), arpa)
    assert search.labels[BLANK] == "" and search.labels[DELIM] == " "
    assert search.labels[ID["E"]] == "E"
    specials = [search.labels[ID[t]] for t in ("<s>", "</s>", "<unk>")]
    assert all(len(s) == 1 for s in specials) and len(set(specials)) == 3
    lp = emissions(spell("THE CAT"))
    assert search(lp)[0][0] == labels_of("THE CAT")


@needs_lm
def test_missing_lm_file_and_missing_delimiter(tmp_path, arpa):
    with pytest.raises(FileNotFoundError):
        LMBeamSearch(TOKENS, str(tmp_path / "nope.arpa"))
    with pytest.raises(ValueError, match="word delimiter"):
        LMBeamSearch([t for t in TOKENS if t != "|"], arpa)
