"""The one WER helper (SpeechBrain's edit distance) against jiwer, an independent implementation."""
import math

import jiwer
import pytest

from tta_brain.asr.metrics import (char_errors, corpus_error_rate, error_rate, errors,
                                    normalize_text, official_words, unwritable, word_errors)

PAIRS = [("the cat sat on the mat", "the cat sat on mat"),
         ("a b c d", "a x c d e"),
         ("hello world", ""),
         ("don't stop", "dont stop now"),
         ("one", "one")]


def test_word_and_char_rates_equal_jiwer():
    refs = [normalize_text(r) for r, _ in PAIRS]
    hyps = [normalize_text(h) for _, h in PAIRS]
    assert corpus_error_rate(PAIRS) == pytest.approx(100 * jiwer.wer(refs, hyps))
    assert corpus_error_rate(PAIRS, "char") == pytest.approx(100 * jiwer.cer(refs, hyps))


def test_official_words_count_as_the_official_jiwer_pipeline():
    """The official code's ``wer``: jiwer's RemovePunctuation on both raw texts, then
    ``wer_standardize``; :func:`official_words` of the texts :func:`normalize_text` kept gives
    its counts on LibriSpeech-like text (upper case, apostrophes the only punctuation) and on
    hypotheses whose apostrophes are misplaced or missing."""
    import random
    rng = random.Random(0)
    vocab = ["DON'T", "DONT", "IT'S", "ITS", "IT", "S", "'", "O'ER", "MEN'S", "THE", "A",
             "WE'LL", "WELL", "CAN'T", "CANT", "I'M", "IM", "'TWAS"]
    for _ in range(300):
        ref = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 8)))
        hyp = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 8)))
        want_ref = jiwer.RemovePunctuation()(ref)
        if not jiwer.wer_standardize(want_ref)[0]:
            continue                         # jiwer refuses an empty reference
        want = jiwer.process_words(want_ref, jiwer.RemovePunctuation()(hyp),
                                   reference_transform=jiwer.wer_standardize,
                                   hypothesis_transform=jiwer.wer_standardize)
        e = errors(official_words(ref), official_words(hyp))
        assert (e.n_ref, e.n_err) == (len(want.references[0]),
                                      want.substitutions + want.deletions + want.insertions), \
            (ref, hyp)


def test_counts_and_normalisation():
    e = word_errors("The cat, sat!", "the hat sat on")
    assert (e.n_ref, e.n_err, e.n_sub, e.n_del, e.n_ins) == (3, 2, 1, 0, 1)
    assert normalize_text("  Don't -- STOP.\n") == "DON'T STOP"
    assert math.isnan(error_rate(0, 0)) and error_rate(1, 4) == 25.0


def test_normalisation_keeps_the_letters_of_every_script():
    """Letters outside A-Z were removed: an accented word split in two, a Cyrillic or Japanese
    reference was empty (every utterance skipped as having no transcript)."""
    assert normalize_text("l\u2019été est là!") == "L'ÉTÉ EST LÀ"
    assert normalize_text("l\u2019e\u0301te\u0301") == "L'ÉTÉ"         # combining accents
    assert normalize_text("don\u02bct") == "DON'T"                      # the modifier letter too
    assert normalize_text("Привет, мир!") == "ПРИВЕТ МИР"
    assert normalize_text("日本語 テスト。") == "日本語 テスト"
    assert word_errors("Привет мир", "привет мир").n_err == 0


def test_unwritable_characters_are_those_of_the_normalised_references_only():
    """Case, punctuation and typographic apostrophes are normalised away before the comparison
    (a lower-case ``l’été`` is ``L'ÉTÉ``); what is left outside the alphabet counts, once per
    reference that holds it."""
    abc = set("ABCDEFGHIJKLMNOPQRSTUVWXYZ'")
    assert unwritable(["l\u2019ete, etc.!", "DON'T"], abc) == ([], 0)
    assert unwritable(["l\u2019été", "zoë 2", "ok"], abc) == (["2", "É", "Ë"], 2)
    assert unwritable(["e\u0301"], abc | {"É"}) == ([], 0)        # composed first (NFC)


def test_ascii_normalisation_is_the_one_results_were_scored_with():
    """On ASCII the rule is unchanged (A-Z, 0-9, apostrophes), so earlier runs stay comparable."""
    import random
    import re
    import string
    rng = random.Random(0)
    for _ in range(5000):
        t = "".join(rng.choice(string.printable) for _ in range(rng.randint(0, 30)))
        assert normalize_text(t) == " ".join(re.sub(r"[^A-Z0-9' ]+", " ", t.upper()).split())


def test_character_counts_are_the_edit_distance_of_the_characters():
    """CER counts (rapidfuzz, C++) against SpeechBrain's edit distance on the characters and
    jiwer's CER, on random texts of several scripts with spaces."""
    import random
    rng = random.Random(1)
    alphabet = "AB C'ÉПР日本 "
    refs, hyps = [], []
    for _ in range(300):
        ref = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        hyp = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
        c, w = char_errors(ref, hyp), errors(list(ref), list(hyp))
        assert (c.n_ref, c.n_err) == (w.n_ref, w.n_err) == (len(ref), c.n_sub + c.n_del + c.n_ins)
        refs.append(ref)
        hyps.append(hyp)
    e = char_errors("KITTEN SAT", "SITTING SAT")
    assert (e.n_ref, e.n_err, e.n_sub, e.n_del, e.n_ins) == (10, 3, 2, 0, 1)
    assert char_errors("", "AB").n_ins == 2 and char_errors("AB", "").n_del == 2
    pairs = [(r, h) for r, h in ((normalize_text(r), normalize_text(h))
                                 for r, h in zip(refs, hyps)) if r]
    assert corpus_error_rate(pairs, "char") == pytest.approx(
        100 * jiwer.cer([r for r, _ in pairs], [h for _, h in pairs]))


def test_rates_print_as_percent_or_a_dash_when_there_is_none():
    from tta_brain.run.summary import percent
    assert percent(12.5) == "12.50%" and percent(0) == "0.00%"
    assert percent(None) == "-" and percent(float("nan")) == "-"    # no reference / empty domain


@pytest.mark.parametrize("unit", ["wer", "cer", "words", "WORD", None])
def test_corpus_error_rate_refuses_an_unknown_unit(unit):
    """Any unit but "word" was scored as characters: unit="wer" gave the CER (9.1 here, not 50)."""
    with pytest.raises(ValueError, match="unit must be 'word' or 'char'"):
        corpus_error_rate([("hello world", "hello word")], unit=unit)


def test_importing_tta_brain_leaves_torchs_process_settings_as_they_were():
    """SpeechBrain's import turns TF32 matmuls on and TorchScript's profiling off for the whole
    process (its quirks); a user's script that imports tta-brain's scoring, stream or run modules
    keeps its own settings (tta_brain.quirks)."""
    import subprocess
    import sys
    code = """
import torch
def settings():
    executor = torch._C._jit_set_profiling_executor(True)
    torch._C._jit_set_profiling_executor(executor)
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(), executor)
torch.backends.cudnn.allow_tf32 = False                  # a user's own choices, unlike both
torch.set_float32_matmul_precision("medium")             # PyTorch's and SpeechBrain's
before = settings()
import tta_brain.asr.metrics, tta_brain.run.records, tta_brain.stream, tta_brain.decode
import tta_brain.report.results, tta_brain.hparams, tta_brain.run.envinfo
import speechbrain.utils.quirks as q
assert "allow_tf32" in q.applied_quirks                   # SpeechBrain did apply its quirks
print(before == settings(), before, settings())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "True", out.stdout


def test_the_grid_and_hparams_import_without_torch_and_a_yaml_built_keeps_torchs_settings(
        tmp_path):
    """The grid's module (its --help, its argument errors) and the yaml reader start without
    torch or SpeechBrain (seconds a process); a yaml that imports SpeechBrain, built by
    hparams alone, leaves the user's torch settings as they were."""
    import subprocess
    import sys
    code = """
import sys
import tta_brain.grid, tta_brain.hparams, tta_brain.run.identity
print(sorted(m for m in ("torch", "speechbrain") if m in sys.modules))
import torch
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("medium")
before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
          torch.get_float32_matmul_precision())
from tta_brain import hparams
built = hparams.Resolved("x.yaml", "s: !name:speechbrain.utils.metric_stats.ErrorRateStats",
                         {}).build()
import speechbrain.utils.quirks as q
assert "allow_tf32" in q.applied_quirks and built["s"].__name__ == "ErrorRateStats"
print(before == (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                 torch.get_float32_matmul_precision()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout


def test_corpus_error_rate_normalises_both_sides():
    """Pairs are scored after normalize_text: case, punctuation and curly apostrophes are no
    errors; pooled over the pairs (1 substitution in 10 reference words: 10 %)."""
    pairs = [("Hello, World!", "hello world"), ("Don\u2019t  stop now.", "DON'T STOP NOW")]
    assert corpus_error_rate(pairs) == 0.0
    assert corpus_error_rate(pairs + [("one two", "one three"), ("a b c", "A B C")]) == 100.0 * 1 / 10
    # a reference with no words left adds its hypothesis' words as insertions, no reference word
    assert corpus_error_rate(pairs + [("?!", "extra words")]) == 100.0 * 2 / 5
    # the hypothesis is normalised as the reference is (a tokenizer's decoder may write
    # punctuation and typographic apostrophes): only ITS for IT'S is an error, as jiwer counts
    punct = [("Don't stop now.", "don\u2019t, stop-now!"), ("it\u02bcs OK", "its ok")]
    assert corpus_error_rate(punct) == pytest.approx(100 * jiwer.wer(
        ["DON'T STOP NOW", "IT'S OK"], ["DON'T STOP NOW", "ITS OK"])) == 100.0 * 1 / 5
