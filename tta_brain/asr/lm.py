"""CTC beam search with a word n-gram LM: pyctcdecode + KenLM (the optional ``[lm]`` extra).

This is the decoder of the official SGEM code (pyctcdecode's ``BeamSearchDecoderCTC`` with a
KenLM model): shallow fusion of ``alpha * log p_LM(word | history) + beta`` per word, partial
words scored against the LM's unigrams (``unk_score_offset`` for a prefix of no known word),
open vocabulary. Works offline with a local ARPA file (unigrams read from it) or a KenLM binary
(then pass the word list as ``unigrams``, as pyctcdecode asks).

KenLM's bar while it reads an ARPA file is ``show_progress``: SGEM passes the run's
``--noprogressbar`` (:func:`tta_brain.data.prep.progress.shown`).

Install: ``pip install -e ".[lm]"`` (pyctcdecode, kenlm; kenlm builds from source: a C++
compiler is needed).
"""
import gzip
import os
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

__all__ = ["LM_EXTRA_HINT", "require_lm_packages", "arpa_unigrams", "read_word_list",
           "LMBeamSearch"]

LM_EXTRA_HINT = ('the word n-gram LM needs pyctcdecode and kenlm, the optional [lm] extra: '
                 'pip install -e ".[lm]"')


def require_lm_packages():
    """Import pyctcdecode and kenlm, or raise a one-line ImportError naming the ``[lm]`` extra."""
    try:
        import kenlm  # noqa: F401
        import pyctcdecode  # noqa: F401
    except ImportError as err:
        raise ImportError(f"{LM_EXTRA_HINT} (missing: {err.name or err})") from None


def _gzipped(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _open_text(path: str):
    """A text file, read through gzip when it is one (KenLM reads ``.arpa.gz`` as it is); a
    UTF-8 byte order mark is no part of its first word."""
    return (gzip.open(path, "rt", encoding="utf-8-sig") if _gzipped(path)
            else open(path, encoding="utf-8-sig"))


def read_word_list(path: str) -> List[str]:
    """The whitespace-separated words of a word list (``lm_unigrams``: a KenLM binary's words)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"lm_unigrams {path}: no such file")
    with _open_text(path) as f:
        words = f.read().split()
    if not words:
        raise ValueError(f"lm_unigrams {path}: no words in it (one word per line or space)")
    return words


def arpa_unigrams(path: str) -> List[str]:
    """The words of the ``\\1-grams:`` section of an ARPA file, gzipped or not (``<s>``,
    ``</s>``, ``<unk>`` left out)."""
    words, inside = [], False
    with _open_text(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("\\"):
                if inside:
                    break
                inside = line == "\\1-grams:"
                continue
            if inside and line:
                parts = line.split()
                if len(parts) >= 2 and parts[1] not in ("<s>", "</s>", "<unk>"):
                    words.append(parts[1])
    if not words:
        raise ValueError(f"{path}: no unigrams found; is this an ARPA file?")
    return words


class LMBeamSearch:
    """Word-LM CTC beam search over ``log_probs [T, V]`` of a character CTC model.

    ``tokens[i]`` is the string of label ``i`` (as ``lobe.id_to_token``); ``blank_id`` and the
    ``word_delimiter`` token become pyctcdecode's blank and space, other tokens that are not one
    character (``<s>``, ``<unk>``, ...) private characters that no LM word contains. ``lowercase``:
    match the model's (upper-case) letters to a lower-case LM (False: keep the model's case);
    ``None`` decides from the LM's unigrams: a mostly lower-case LM gets the letters in lower
    case, a mostly upper-case one (LibriSpeech's) in upper case, whatever the model's case (a
    binary LM without ``unigrams`` keeps the model's case).

    Calling it returns the beams ``[(labels, score)]`` best first, like
    :func:`tta_brain.asr.ctc.prefix_beam_search`: the label ids of each hypothesis' text (words joined
    by the word delimiter) and pyctcdecode's combined acoustic + LM score.
    """

    def __init__(self, tokens: Union[Sequence[str], dict], lm_path: str, blank_id: int = 0,
                 word_delimiter: str = "|", alpha: float = 0.5, beta: float = 1.5,
                 unigrams: Optional[Union[str, Iterable[str]]] = None,
                 unk_score_offset: float = -10.0, lowercase: Optional[bool] = None,
                 beam_prune_logp: float = -10.0, token_min_logp: float = -5.0,
                 show_progress: bool = True):
        require_lm_packages()
        import kenlm
        from pyctcdecode import Alphabet, BeamSearchDecoderCTC, LanguageModel
        from pyctcdecode.alphabet import verify_alphabet_coverage

        if not os.path.isfile(lm_path):
            raise FileNotFoundError(f"LM file not found: {lm_path}")
        if isinstance(tokens, dict):
            tokens = [tokens.get(i, "") for i in range(max(tokens) + 1)]
        if isinstance(unigrams, str):
            unigrams = read_word_list(unigrams)
        elif unigrams is None and _is_arpa(lm_path):
            unigrams = arpa_unigrams(lm_path)
        unigrams = None if unigrams is None else list(unigrams)
        case = (str.lower if lowercase else None) if lowercase is not None else _lm_case(unigrams)
        labels, self._char_to_id = [], {}
        own = {t for t in tokens if len(t) == 1}     # a letter another token is: its case kept
        self.delimiter_id = None
        for i, tok in enumerate(tokens):
            if i == blank_id:
                label = ""
            elif tok == word_delimiter:
                label, self.delimiter_id = " ", i
            elif len(tok) == 1 and tok.strip():
                label = case(tok) if case else tok
                if len(label) != 1 or label != tok and (label in own or label in self._char_to_id):
                    label = tok   # (a case-sensitive vocabulary; "ß".upper() is "SS"; "ı".upper()
                                  # is "i".upper())
            else:                                   # special or unnamed token
                label = chr(0xE000 + i)
            if label in self._char_to_id or (label == "" and i != blank_id):
                raise ValueError(f"token {i} ({tok!r}): label {label!r} is not unique")
            labels.append(label)
            if label:
                self._char_to_id[label] = i
        if self.delimiter_id is None:
            raise ValueError(f"no word delimiter {word_delimiter!r} among the tokens")
        self.labels, self.lm_path = labels, lm_path
        self.beam_prune_logp, self.token_min_logp = float(beam_prune_logp), float(token_min_logp)
        # pyctcdecode's build_ctcdecoder, with KenLM's reading bar only where bars are shown
        config = kenlm.Config()
        config.show_progress = bool(show_progress)
        try:
            model = kenlm.Model(lm_path, config)
            alphabet = Alphabet.build_alphabet(labels)
            if unigrams is not None:
                verify_alphabet_coverage(alphabet, unigrams)
            self._decoder = BeamSearchDecoderCTC(alphabet, LanguageModel(
                model, unigrams, alpha=float(alpha), beta=float(beta),
                unk_score_offset=float(unk_score_offset)))
        except (OSError, RuntimeError, UnicodeError) as e:     # KenLM's reader: a C++ message
            why = "" if isinstance(e, UnicodeError) else f": {' '.join(str(e).split())[:200]}"
            raise ValueError(f"{lm_path}: KenLM cannot read this LM (it reads ARPA files, "
                             f"gzipped or not, and KenLM binaries){why}") from None

    def text_to_labels(self, text: str) -> List[int]:
        """A decoded text -> label ids (single spaces -> the word delimiter)."""
        return [self.delimiter_id if ch == " " else self._char_to_id[ch]
                for ch in " ".join(text.split())]

    def __call__(self, log_probs: torch.Tensor, beam_width: int = 5) -> List[Tuple[List[int], float]]:
        lp = np.ascontiguousarray(log_probs.detach().float().cpu().numpy())
        beams = self._decoder.decode_beams(lp, beam_width=int(beam_width),
                                           beam_prune_logp=self.beam_prune_logp,
                                           token_min_logp=self.token_min_logp)
        return [(self.text_to_labels(b[0]), float(b[-1])) for b in beams]

    def close(self):
        """Free the LM (pyctcdecode keeps it in a class-level container until cleaned up)."""
        dec = getattr(self, "_decoder", None)
        if dec is not None:
            dec.cleanup()
            self._decoder = None

    def __del__(self):
        try:
            self.close()
        except Exception:                           # interpreter shutdown
            pass


def _is_arpa(path: str) -> bool:
    """An ARPA text file (vs a KenLM binary): its first non-empty line is ``\\data\\``."""
    try:
        with (gzip.open if _gzipped(path) else open)(path, "rb") as f:
            head = f.read(4096)
    except (OSError, EOFError):
        return False
    return head.lstrip().startswith(b"\\data\\")


def _mostly_lowercase(words: Optional[Sequence[str]]) -> bool:
    if not words:
        return False
    lower = sum(w != w.upper() for w in words)
    return lower > len(words) / 2


def _lm_case(words: Optional[Sequence[str]]):
    """``str.lower`` for a mostly lower-case word list, ``str.upper`` for a mostly upper-case
    one, None (the model's case) without words or neither."""
    if _mostly_lowercase(words):
        return str.lower
    if words and sum(w != w.lower() for w in words) > len(words) / 2:
        return str.upper
    return None
