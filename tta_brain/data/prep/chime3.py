"""CHiME-3 evaluation set (et05, enhanced single-channel audio) -> utterance manifest.

Expected layout under the CHiME-3 root (as distributed, and as the Dynamic-SUTA code reads it)::

    <CHIME3>/data/audio/16kHz/enhanced/et05_bus_real/F05_440C0201_BUS.wav
    <CHIME3>/data/audio/16kHz/enhanced/et05_bus_simu/F05_440C0201_BUS.wav
    ...                                 et05_{bus,caf,ped,str}_{real,simu}/
    <CHIME3>/data/transcriptions/et05_bus_real/F05_440C0201_BUS.trn     one line "<ID> <TEXT>"
    <CHIME3>/data/transcriptions/et05_real.trn_all, et05_simu.trn_all    lines "<ID> <TEXT>"

Transcripts come from the per-utterance ``.trn`` file of the same split and name (what the official
code does); when it is missing, from any ``*.trn_all`` file in ``data/transcriptions``. The audio
folder can be changed (``audio_subdir``) to decode another enhancement's output with the same
structure. Audio file names may carry a suffix after the first dot (``X.CH5.wav``); the part before
it is the utterance name.

Splits: by default the seven used by the official code, ``{bus,caf,str}_{real,simu}`` and
``ped_simu`` (``ped_real`` is left out there); ``include_ped_real=True`` adds it (all eight).
The manifest has ``ID,duration,wav,spk_id,wrd,domain``: ``ID = <name>_<REAL|SIMU>`` (real and
simulated files share names, as in the Kaldi recipe), ``spk_id`` the speaker prefix (``F05``),
``domain`` the split without the set prefix (``bus_real``).

Text clean-up (``clean_text=True``, a documented difference from the official code, which uses the
raw line): WSJ verbalised punctuation tokens (``.PERIOD``, ``,COMMA``, ``"DOUBLE-QUOTE``: tokens
that start with a character other than a letter, digit or apostrophe) and bracketed markers
(``<NOISE>``, ``[...]``) are dropped, as they are not spoken words.

The manifest is content keyed, as the LibriSpeech one: its cache record holds the options and the
SHA-1 of every audio file of the chosen splits, their ``.trn`` files and the ``*.trn_all`` files,
so a changed transcript or audio file rewrites it (the log says which).
"""
import logging
import re
from collections import Counter
from pathlib import Path

from ..cache import manifest_inputs, save_record
from ..manifest import audio_duration, to_placeholder, write_manifest

logger = logging.getLogger(__name__)

ENVIRONMENTS = ("bus", "caf", "ped", "str")
DEFAULT_SPLITS = ("bus_real", "bus_simu", "caf_real", "caf_simu", "ped_simu",
                  "str_real", "str_simu")
ALL_SPLITS = tuple(f"{e}_{t}" for e in ENVIRONMENTS for t in ("real", "simu"))
AUDIO_SUBDIR = "data/audio/16kHz/enhanced"
TRANSCRIPT_SUBDIR = "data/transcriptions"
_NON_WORD = re.compile(r"^[^A-Za-z0-9']")  # also catches <NOISE> and [...] markers


def default_splits(include_ped_real=False):
    """The split names decoded by default (7), or all 8 with ``include_ped_real``."""
    return ALL_SPLITS if include_ped_real else DEFAULT_SPLITS


def clean_transcript(text, dropped=None):
    """Drop verbalised punctuation and bracketed markers; collapse whitespace. ``dropped`` (a
    ``Counter``) counts the tokens removed."""
    kept = []
    for tok in text.split():
        if not _NON_WORD.match(tok):
            kept.append(tok)
        elif dropped is not None:
            dropped[tok] += 1
    return " ".join(kept)


def find_root(root):
    """The CHiME-3 root (holding ``data/``); accepts the root itself or its parent."""
    if not root:
        raise FileNotFoundError("CHiME-3 location not set: set CHIME3=/path/to/CHiME3 (the folder "
                                "that contains data/audio/16kHz/enhanced) in the environment or "
                                "in recipes/chime3/db.sh")
    root = Path(root)
    for cand in (root, root / "CHiME3"):
        if (cand / "data").is_dir():
            return cand
    raise FileNotFoundError(f"CHiME-3 not found at {root} (no data/ folder); set CHIME3=... to the "
                            "folder that contains data/audio/16kHz/enhanced/et05_*")


def _read_id_text(path):
    """``{ID: text}`` from a file of ``<ID> <TEXT>`` lines."""
    out = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:   # a replaced byte would become a space at scoring
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); the "
                         "CHiME-3 transcripts are ASCII: is the file damaged?") from None
    for line in text.splitlines():
        utt, text = (line.split(None, 1) + ["", ""])[:2]   # a tab after the ID too (was: the
        if utt:                                             # ID and the first word, one key)
            out[utt] = text.strip()
    return out


def _pooled_transcripts(trans_root, set_name, kind):
    """``{ID: text}`` from ``*.trn_all`` files, ``<set>_<kind>.trn_all`` taking precedence."""
    files = sorted(Path(trans_root).glob("*.trn_all"))
    preferred = Path(trans_root) / f"{set_name}_{kind}.trn_all"
    out = {}
    for f in [f for f in files if f != preferred] + ([preferred] if preferred.is_file() else []):
        out.update(_read_id_text(f))
    return out


def prepare_chime3(root, out_csv, splits=None, include_ped_real=False, data_root=None,
                   audio_subdir=AUDIO_SUBDIR, clean_text=True, set_name="et05",
                   skip_existing=True):
    """Write the manifest of the CHiME-3 ``set_name`` splits to ``out_csv``; returns the path.

    ``data_root`` (usually the CHiME-3 root) makes ``wav`` use ``$data_root``. Skipped when the
    output exists with the same options and its input files have the same content. Raises
    ``FileNotFoundError`` naming what is missing.
    """
    root = find_root(root)
    splits = list(splits) if splits else list(default_splits(include_ped_real))
    options = {"root": str(root.resolve()), "splits": splits, "audio_subdir": audio_subdir,
               "clean_text": bool(clean_text), "set": set_name,
               "data_root": str(Path(data_root).resolve()) if data_root else None}
    out_csv = Path(out_csv)
    audio_root = root / audio_subdir
    trans_root = root / TRANSCRIPT_SUBDIR
    files = sorted(trans_root.glob("*.trn_all"))
    for split in splits:
        files += sorted((audio_root / f"{set_name}_{split}").glob("*.wav"))
        files += sorted((trans_root / f"{set_name}_{split}").glob("*.trn"))
    inputs, redo = manifest_inputs(out_csv, options, files, root, "chime3",
                                   skip_existing)
    if not redo:
        return out_csv
    pooled = {}  # {"real"/"simu": {ID: text}} from *.trn_all, read on first need
    rows, wav_of, no_text = [], {}, []
    dropped, touched = Counter(), 0   # tokens clean_text removed, references it changed
    for split in splits:
        folder = audio_root / f"{set_name}_{split}"
        wavs = sorted(folder.glob("*.wav"))
        if not wavs:
            there = sorted(p.name[len(set_name) + 1:] for p in audio_root.glob(f"{set_name}_*")
                           if p.is_dir() and any(p.glob("*.wav")))
            if not folder.is_dir() and there:     # a misspelt split
                raise FileNotFoundError(f"no split {split!r}: {audio_root} has "
                                        f"{', '.join(there)}")
            raise FileNotFoundError(f"no .wav files in {folder}; is CHIME3 the CHiME-3 root and "
                                    f"does it hold the enhanced audio ({audio_subdir})?")
        kind = split.rsplit("_", 1)[-1].upper()
        for wav in wavs:
            name = wav.name.split(".")[0]
            trn = trans_root / f"{set_name}_{split}" / f"{name}.trn"
            if trn.is_file():
                text = next(iter(_read_id_text(trn).values()), "")
            else:
                if kind not in pooled:
                    pooled[kind] = _pooled_transcripts(trans_root, set_name, kind.lower())
                if name not in pooled[kind]:
                    raise FileNotFoundError(f"no transcript for {wav}: neither {trn} nor an entry "
                                            f"{name!r} in {trans_root}/*.trn_all")
                text = pooled[kind][name]
            if clean_text:
                before = sum(dropped.values())
                text = clean_transcript(text, dropped)
                touched += sum(dropped.values()) > before
            utt = f"{name}_{kind}"
            if utt in wav_of:    # e.g. X.wav and X.CH5.wav: one ID, two recordings
                raise ValueError(f"two audio files of utterance {utt}: {wav_of[utt]} and {wav}; "
                                 f"keep one (the ID is the file name up to its first dot)")
            wav_of[utt] = wav
            if not text:
                no_text.append(utt)
            rows.append({
                "ID": utt,
                "duration": round(audio_duration(wav), 4),
                "wav": to_placeholder(wav, data_root),
                "spk_id": name.split("_")[0],
                "wrd": text,
                "domain": split,
            })
    if no_text:
        logger.warning("%d utterance(s) with an empty transcript%s (decode skips them, listed in "
                       "its rejects.csv): %s", len(no_text),
                       " once markers are dropped" if clean_text else "",
                       ", ".join(no_text[:5]) + (" ..." if len(no_text) > 5 else ""))
    if dropped:     # what the official code (raw line) would score and these references do not
        logger.info("removed %d token(s) from %d of %d references (%s); --keep_raw_text keeps "
                    "them, as the official code does", sum(dropped.values()), touched, len(rows),
                    ", ".join(f"{tok} x{n}" for tok, n in dropped.most_common(8))
                    + (" ..." if len(dropped) > 8 else ""))
    write_manifest(out_csv, rows)
    save_record(out_csv, "chime3", options, inputs=inputs)
    logger.info("wrote %d CHiME-3 %s utterances (%s) to %s", len(rows), set_name,
                ", ".join(splits), out_csv)
    return out_csv
