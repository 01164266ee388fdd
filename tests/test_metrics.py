"""The one WER helper (SpeechBrain's edit distance) against jiwer, an independent implementation."""
import math

import jiwer
import pytest

from tta_brain.asr.metrics import corpus_error_rate, error_rate, normalize_text, word_errors

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


def test_counts_and_normalisation():
    e = word_errors("The cat, sat!", "the hat sat on")
    assert (e.n_ref, e.n_err, e.n_sub, e.n_del, e.n_ins) == (3, 2, 1, 0, 1)
    assert normalize_text("  Don't -- STOP.\n") == "DON'T STOP"
    assert math.isnan(error_rate(0, 0)) and error_rate(1, 4) == 25.0
