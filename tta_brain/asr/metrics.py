"""Text normalisation and error counts: the one WER/CER helper of the toolkit (SpeechBrain's edit
distance underneath)."""
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Sequence, Tuple

from rapidfuzz.distance import Levenshtein
from tta_brain import quirks  # noqa: F401  (first: SpeechBrain without its torch quirks)
from speechbrain.utils.edit_distance import wer_details_for_batch

__all__ = ["normalize_text", "official_words", "Errors", "errors", "word_errors", "char_errors",
           "error_rate", "corpus_error_rate"]


#: Apostrophes other than ASCII's, read as it (``don’t`` is ``DON'T``).
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'"})


def normalize_text(text: str) -> str:
    """Upper case, every character but letters and digits (of any script) and apostrophes a
    space, white space collapsed; composed (NFC) first, so an accent typed as a combining mark is
    the same letter. ASCII text: A-Z, 0-9 and ``'`` kept, as before; other scripts keep their
    letters (they were removed: a Cyrillic reference was empty, so its utterance skipped)."""
    text = unicodedata.normalize("NFC", str(text)).translate(_APOSTROPHES).upper()
    return " ".join(re.sub(r"[^\w']+|_", " ", text).split())


def unwritable(refs: Iterable[str], alphabet: Iterable[str]) -> Tuple[list, int]:
    """The characters of the normalised references ``refs`` (:func:`normalize_text`) that are
    not in ``alphabet`` (what the model can write, normalised alike), sorted, and how many of the
    references hold one: each word holding one is an error whatever the hypothesis."""
    have, missing, n = set(alphabet) | {" "}, set(), 0
    for ref in refs:
        out = set(normalize_text(ref)) - have
        if out:
            missing |= out
            n += 1
    return sorted(missing), n


def official_words(text: str) -> list:
    """The words the official Dynamic-SUTA code scores of a text that :func:`normalize_text`
    gave: its jiwer pipeline deletes punctuation (``RemovePunctuation``: every Unicode P
    character, the apostrophe included; ``DON'T`` is ``DONT``) before the words are split, where
    :func:`normalize_text` keeps apostrophes. Exact for text whose only punctuation is the
    apostrophe (LibriSpeech's); other punctuation (a hyphen) was already a word break."""
    return normalize_text(text).replace("'", "").split()


@dataclass(frozen=True)
class Errors:
    """Edit-distance counts of one hypothesis against its reference."""
    n_ref: int
    n_err: int
    n_sub: int
    n_del: int
    n_ins: int


def errors(ref: Sequence, hyp: Sequence) -> Errors:
    """Counts between two token sequences (words, characters, label ids)."""
    d = wer_details_for_batch(["_"], [list(ref)], [list(hyp)])[0]
    return Errors(d["num_ref_tokens"], d["num_edits"], d["substitutions"], d["deletions"],
                  d["insertions"])


def word_errors(ref: str, hyp: str) -> Errors:
    """Word counts after :func:`normalize_text` of both sides."""
    return errors(normalize_text(ref).split(), normalize_text(hyp).split())


def char_errors(ref: str, hyp: str) -> Errors:
    """Character counts of two normalised texts, spaces counted as characters (jiwer's CER).
    rapidfuzz's Levenshtein (C++): the same edit count as :func:`errors` on the characters, in
    microseconds instead of milliseconds a sentence, so every summary and report has it."""
    tags = [op.tag for op in Levenshtein.editops(ref, hyp)]
    return Errors(len(ref), len(tags), tags.count("replace"), tags.count("delete"),
                  tags.count("insert"))


def error_rate(n_err: float, n_ref: float) -> float:
    """100 * errors / reference tokens (nan without reference tokens)."""
    return 100.0 * n_err / n_ref if n_ref else math.nan


def corpus_error_rate(pairs: Iterable[Tuple[str, str]], unit: str = "word") -> float:
    """Pooled WER (``unit="word"``) or CER (``"char"``, spaces kept as characters) in % of
    normalised (reference, hypothesis) pairs. Another ``unit`` is a one-line ValueError (any
    other string was scored as characters: ``unit="wer"`` gave the CER)."""
    if unit not in ("word", "char"):
        raise ValueError(f"corpus_error_rate: unit must be 'word' or 'char', got {unit!r}")
    n_err = n_ref = 0
    for ref, hyp in pairs:
        ref, hyp = normalize_text(ref), normalize_text(hyp)
        e = errors(ref.split(), hyp.split()) if unit == "word" else char_errors(ref, hyp)
        n_err, n_ref = n_err + e.n_err, n_ref + e.n_ref
    return error_rate(n_err, n_ref)
