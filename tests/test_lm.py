"""Word n-gram LM beam search (``tta_brain.asr.lm``: pyctcdecode + KenLM, the ``[lm]`` extra).

The LMs are ARPA files that the tests estimate themselves from a handful of sentences (a back-off
bigram with absolute discounting). Tests that need the extra skip when it is not installed.
"""
import gzip
import itertools
import json
import math
import shutil
import sys
from collections import Counter

import pytest
import torch

from tta_brain.asr.ctc import collapse, prefix_beam_search, viterbi_align
from tta_brain import hparams
from tta_brain.asr.lm import (LM_EXTRA_HINT, LMBeamSearch, arpa_unigrams, read_word_list,
                              require_lm_packages)
from tta_brain.run import identity
from tta_brain.lobes.hf_ctc import W2V2_CHAR_VOCAB
from tta_brain.methods.sgem import best_path

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


def test_word_lists_and_gzipped_arpa_files_are_read_or_named(tmp_path):
    path = write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")
    with open(path, "rb") as f, gzip.open(tmp_path / "lm.arpa.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    assert arpa_unigrams(str(tmp_path / "lm.arpa.gz")) == arpa_unigrams(path)
    (tmp_path / "words.txt").write_text("THE CAT\nSAT\n")
    assert read_word_list(str(tmp_path / "words.txt")) == ["THE", "CAT", "SAT"]
    (tmp_path / "empty.txt").write_text("\n")        # was pyctcdecode's ZeroDivisionError
    with pytest.raises(ValueError, match=f"^lm_unigrams {tmp_path}/empty.txt: no words in it"):
        read_word_list(str(tmp_path / "empty.txt"))
    with pytest.raises(FileNotFoundError, match=f"^lm_unigrams {tmp_path}/no.txt: no such file$"):
        read_word_list(str(tmp_path / "no.txt"))


def test_a_word_list_saved_with_a_byte_order_mark_reads_its_first_word(tmp_path):
    """A word list from an editor that writes a UTF-8 BOM (Windows' Notepad), CRLF line ends:
    its first word was read as '\\ufeffTHE', a word no hypothesis spells, so the LM scored THE
    as out of vocabulary, silently."""
    (tmp_path / "words.txt").write_bytes("\ufeffTHE CAT\r\nSAT\r\n".encode("utf-8"))
    assert read_word_list(str(tmp_path / "words.txt")) == ["THE", "CAT", "SAT"]
    with gzip.open(tmp_path / "words.txt.gz", "wb") as g:
        g.write("\ufeffTHE\n".encode("utf-8"))
    assert read_word_list(str(tmp_path / "words.txt.gz")) == ["THE"]


@pytest.mark.parametrize("values,expected", [
    ({"lm_unigrams": "w.txt", "lm_path": None}, "lm_unigrams = 'w.txt' without lm_path: the word "
     "list belongs to a KenLM binary given as lm_path"),
    ({"lm_path": "lm.arpa", "beam_width": 1}, "lm_path = 'lm.arpa' with beam_width = 1: a beam of "
     "1 is the greedy path and the LM would not be used; use beam_width > 1 or no lm_path"),
])
def test_an_lm_setting_that_would_be_ignored_is_refused(values, expected):
    """Both decoded as if the setting were not there (the LM was loaded, then never asked)."""
    with pytest.raises(hparams.HparamsError) as err:
        hparams.check(hparams.find("sgem"), values)
    assert str(err.value) == f"{hparams.find('sgem')}: {expected}"
    hparams.check(hparams.find("sgem"), {"lm_path": "lm.arpa", "beam_width": 2})


def test_an_lm_counts_by_its_content_in_the_run_fingerprint(tmp_path):
    """A finished run is redone when its LM file changes, not when the same LM moves (the LM
    counted by its path: another LM under the same name was skipped as finished); a run
    fingerprinted by path before matches what that path holds now."""
    stream = tmp_path / "s.csv"
    stream.write_text("id\n")
    lm = write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")
    hp = {"lm_path": lm, "lm_unigrams": None, "steps": 1}
    before = identity.fingerprint(hp, stream, 1)
    moved = tmp_path / "moved.arpa"
    shutil.copy(lm, moved)
    assert identity.differences(before, identity.fingerprint({**hp, "lm_path": str(moved)},
                                                             stream, 1)) == []
    write_bigram_arpa(SENTENCES[:4], tmp_path / "lm.arpa")          # another LM, same name
    after = identity.fingerprint(hp, stream, 1)
    assert [d.split(":")[0] for d in identity.differences(before, after)] == ["hparams.lm_path"]
    older = json.loads(json.dumps(before))
    older["hparams"]["lm_path"] = lm                                 # as runs recorded it
    assert identity.differences(older, after) == []
    assert identity.differences(older, identity.fingerprint(
        {**hp, "lm_path": str(moved)}, stream, 1)) != []


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
def test_uppercase_lm_with_lowercase_tokens(arpa):
    """A model with a lower-case vocabulary (many hub fine-tunes) and an upper-case LM
    (LibriSpeech's 4-gram): the letters meet the LM's words in its case (they were kept lower
    case, every word was unknown to the LM, and the LM only penalised)."""
    lower = [t.lower() if len(t) == 1 else t for t in TOKENS]
    lp = emissions(spell("THE CA? SAT", {"R": 0.50, "T": 0.46}))
    search = LMBeamSearch(lower, arpa)
    assert search.labels[ID["E"]] == "E"
    assert search(lp)[0][0] == labels_of("THE CAT SAT")
    assert LMBeamSearch(lower, arpa, lowercase=False).labels[ID["E"]] == "e"   # as asked
    # a case-sensitive vocabulary (e before E): every letter keeps its own case (the
    # lower-case twin took 'E' and the real E was "not unique")
    both = TOKENS[:5] + [t.lower() for t in TOKENS if len(t) == 1 and t.isalpha()] + TOKENS[5:]
    search = LMBeamSearch(both, arpa)
    assert [search.labels[both.index(c)] for c in "eE"] == ["e", "E"]


@needs_lm
def test_tokens_as_id_to_token_dict_and_special_tokens(arpa):
    search = LMBeamSearch(dict(enumerate(TOKENS)), arpa)
    assert search.labels[BLANK] == "" and search.labels[DELIM] == " "
    assert search.labels[ID["E"]] == "E"
    specials = [search.labels[ID[t]] for t in ("<s>", "</s>", "<unk>")]
    assert all(len(s) == 1 for s in specials) and len(set(specials)) == 3
    lp = emissions(spell("THE CAT"))
    assert search(lp)[0][0] == labels_of("THE CAT")
    # an id the dict lacks is an unnamed token: the ids after it keep theirs (Z, the last, too)
    gap = LMBeamSearch({i: t for i, t in enumerate(TOKENS) if t != "<unk>"}, arpa)
    assert len(gap.labels) == len(TOKENS) and gap.labels[ID["Z"]] == "Z"


@needs_lm
def test_missing_lm_file_and_missing_delimiter(tmp_path, arpa):
    with pytest.raises(FileNotFoundError):
        LMBeamSearch(TOKENS, str(tmp_path / "nope.arpa"))
    with pytest.raises(ValueError, match="word delimiter"):
        LMBeamSearch([t for t in TOKENS if t != "|"], arpa)


@needs_lm
def test_a_gzipped_arpa_decodes_as_the_arpa_and_unreadable_lms_are_one_line(tmp_path):
    """KenLM reads ``.arpa.gz``: its words and case are read through gzip too (it was taken
    for a binary: no unigrams, the model's case against a lower-case LM, other transcripts)."""
    path = write_bigram_arpa(SENTENCES, tmp_path / "lower.arpa", lowercase=True)
    with open(path, "rb") as f, gzip.open(tmp_path / "lower.arpa.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    plain, gz = LMBeamSearch(TOKENS, path), LMBeamSearch(TOKENS, str(tmp_path / "lower.arpa.gz"))
    assert gz.labels == plain.labels and gz.labels[ID["E"]] == "e"
    torch.manual_seed(0)
    for _ in range(3):
        lp = torch.randn(60, len(TOKENS)).log_softmax(-1)
        assert gz(lp) == plain(lp)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ValueError, match=f"^{junk}: KenLM cannot read this LM "):
        LMBeamSearch(TOKENS, str(junk))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="lm_unigrams .*empty.txt: no words"):
        LMBeamSearch(TOKENS, path, unigrams=str(tmp_path / "empty.txt"))


@needs_lm
def test_kenlms_reading_bar_follows_noprogressbar(tmp_path, tiny_model_dir, capfd, monkeypatch):
    """SGEM with an ARPA LM through ``decode``: KenLM's reading bar (its C++ stderr) was printed
    whatever the run's ``--noprogressbar`` said; now only where progress bars are shown. The
    transcripts are the same either way."""
    import csv

    import soundfile as sf

    from fake_corpora import fake_speech
    from tta_brain import decode
    from tta_brain.data.prep import progress
    monkeypatch.delenv(progress.ENV, raising=False)
    arpa = write_bigram_arpa(SENTENCES, tmp_path / "lm.arpa")
    sf.write(tmp_path / "a.wav", fake_speech(0.4, seed=0), 16000, subtype="PCM_16")
    stream = tmp_path / "s.csv"
    with open(stream, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "duration", "wav", "spk_id", "wrd", "domain", "segment", "position"])
        w.writerow(["a", "0.400", str(tmp_path / "a.wav"), "s", "THE CAT", "d", 0, 0])
    bar = "----5---10---15"
    printed, hyps = {}, {}
    for quiet in (True, False):
        out = tmp_path / f"exp_{quiet}"
        capfd.readouterr()
        decode.main(["sgem", f"--source={tiny_model_dir}", f"--stream_csv={stream}",
                     f"--output_folder={out}", f"--lm_path={arpa}", "--steps=1",
                     "--ckpt_every=0"] + (["--noprogressbar"] if quiet else []))
        got = capfd.readouterr()
        printed[quiet] = got.out + got.err
        assert progress.shown()                 # bars are off only while the run is built
        hyps[quiet] = (out / "transcripts.csv").read_text()
    assert bar in printed[False]
    assert bar not in printed[True]
    assert hyps[True] == hyps[False]


# ------------------------------------------- the decode against expectations derived apart
# (an exhaustive search over every frame path of a tiny vocabulary, pyctcdecode called
# directly, the greedy path; mutation audit of the LM path: each test names the mutants it kills)
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
    such unigrams were dropped from the decoder's word list. Kills ``len(parts) >= 2`` ->
    ``> 2``."""
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


@needs_lm
def test_a_letter_whose_case_is_another_tokens_keeps_its_own_label(arpa):
    """Turkish dotless "ı" and "i" are both "I" in upper case: "i" meets the upper-case LM as "I",
    "ı" keeps its own label (both were "I": "not unique"). Kills the ``label in
    self._char_to_id`` guard dropped."""
    lower = [t.lower() if len(t) == 1 else t for t in TOKENS] + ["\u0131"]
    search = LMBeamSearch(lower, arpa)
    assert search.labels[ID["I"]] == "I" and search.labels[-1] == "\u0131"


@needs_lm
def test_the_blank_need_not_be_label_0(arpa):
    """``blank_id`` is pyctcdecode's blank wherever the vocabulary has it (here last, the
    emissions' columns moved alike); the search's labels are the model's ids. Kills the blank
    taken as label 0."""
    order = list(range(1, len(TOKENS))) + [BLANK]                  # <pad> last
    tokens = [TOKENS[i] for i in order]
    new_id = {old: new for new, old in enumerate(order)}
    search = LMBeamSearch(tokens, arpa, blank_id=len(tokens) - 1)
    assert search.labels[-1] == "" and search.labels[new_id[DELIM]] == " "
    lp = emissions(spell("THE CAT"))[:, order]
    assert search(lp)[0][0] == [new_id[i] for i in labels_of("THE CAT")]


@needs_lm
def test_an_arpa_file_after_empty_lines_is_read_as_one(tmp_path):
    """KenLM reads an ARPA file that begins with empty lines: its words, hence its case, are
    read too (taken for a binary: the model's upper case against a lower-case LM). Kills the
    ``lstrip`` of the ARPA check dropped."""
    path = write_bigram_arpa(SENTENCES, tmp_path / "lower.arpa", lowercase=True)
    padded = tmp_path / "padded.arpa"
    padded.write_text("\n\n" + open(path).read())
    assert LMBeamSearch(TOKENS, str(padded), show_progress=False).labels[ID["E"]] == "e"


@needs_lm
def test_closing_the_search_frees_its_lm(arpa):
    """pyctcdecode keeps every decoder's LM in a class-level container until ``cleanup``:
    ``close`` (and the search's deletion) gives it back, or each run of a process (a sweep, a
    grid worker) would keep its LM. Kills ``close`` without the cleanup."""
    from pyctcdecode.decoder import BeamSearchDecoderCTC
    held = len(BeamSearchDecoderCTC.model_container)
    search = LMBeamSearch(TOKENS, arpa, show_progress=False)
    assert len(BeamSearchDecoderCTC.model_container) == held + 1
    search.close()
    assert len(BeamSearchDecoderCTC.model_container) == held and search._decoder is None
    search = LMBeamSearch(TOKENS, arpa, show_progress=False)
    del search
    assert len(BeamSearchDecoderCTC.model_container) == held


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
