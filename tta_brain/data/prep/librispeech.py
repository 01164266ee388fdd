"""LibriSpeech split -> utterance manifest.

Expected layout (the official tarballs unpacked under ``root``)::

    <root>/LibriSpeech/<split>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac
    <root>/LibriSpeech/<split>/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt

``root`` may also be the ``LibriSpeech`` folder itself. Each ``.trans.txt`` line is
``<utterance id> <TRANSCRIPT>``. The manifest has ``ID,duration,wav,spk_id,wrd`` with the
utterance id, the duration in seconds from the file header, the audio path (``$data_root/...`` if
``data_root`` is given and contains the audio, else absolute), the speaker id and the transcript.

The manifest is content keyed: its cache record (``<out>.opts.json``, see
:mod:`tta_brain.data.cache`) holds the options and the SHA-1 of every ``.trans.txt`` and ``.flac``
file of the split (durations come from the audio), so an edited transcript or a replaced, added or
removed audio file rewrites it (the log says which). Hashes are cached by ``stat`` in
``.sha1_cache.json`` next to the manifest: after the first run a check only lists and ``stat`` s
the files.
"""
import logging
from pathlib import Path

from ..cache import manifest_inputs, save_record
from ..manifest import audio_duration, to_placeholder, write_manifest

logger = logging.getLogger(__name__)

DEFAULT_SPLIT = "test-other"


def find_split_dir(root, split=DEFAULT_SPLIT):
    """The folder holding the split's speaker folders; actionable error if it does not exist."""
    if not root:
        raise FileNotFoundError(
            "LibriSpeech location not set: set LIBRISPEECH=/path/to/dir (the folder containing "
            f"LibriSpeech/{split}) in the environment or in the recipe's db.sh")
    root = Path(root)
    candidates = [root / "LibriSpeech" / split, root / split]
    for cand in candidates:
        if cand.is_dir():
            return cand
    raise FileNotFoundError(
        f"LibriSpeech split {split!r} not found (looked for {candidates[0]} and {candidates[1]}); "
        f"set LIBRISPEECH=... to the folder that contains LibriSpeech/{split} "
        "(download and unpack the split from https://www.openslr.org/12)")


def read_transcripts(split_dir):
    """``{utterance id: transcript}`` from all ``*.trans.txt`` files under ``split_dir``."""
    texts, where = {}, {}
    for trans in sorted(Path(split_dir).glob("*/*/*.trans.txt")):
        try:
            lines = trans.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as err:
            raise ValueError(f"{trans}: not UTF-8 text ({err.reason} at byte {err.start}); "
                             "LibriSpeech transcripts are ASCII: is the file damaged?") from None
        for line_no, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue
            utt, _, text = line.partition(" ")
            if not text.strip():
                hint = " (the ID and its text are separated by one space)" if "\t" in line else ""
                raise ValueError(f"{trans}:{line_no}: no transcript for {utt}{hint}")
            if utt in texts:     # the last one would silently win
                raise ValueError(f"{trans}:{line_no}: a second transcript of {utt} "
                                 f"(the first: {where[utt]})")
            texts[utt] = " ".join(text.split())
            where[utt] = f"{trans}:{line_no}"
    return texts


def audio_by_id(audio_files):
    """``{utterance id: flac path}``; two files of one ID (e.g. a copy in another chapter
    folder) are refused, naming both, rather than one of them silently kept."""
    audio = {}
    for path in audio_files:
        if path.stem in audio:
            raise ValueError(f"two audio files of utterance {path.stem}: {audio[path.stem]} and "
                             f"{path}; remove one")
        audio[path.stem] = path
    return audio


def prepare_librispeech(root, out_csv, split=DEFAULT_SPLIT, data_root=None, skip_existing=True):
    """Write the manifest of ``split`` to ``out_csv``; returns the path.

    Skipped when ``out_csv`` exists and was made with the same options from files with the same
    content (see the module docstring). Raises ``FileNotFoundError`` (with what to set) when the
    split folder is missing, and ``ValueError`` when audio and transcripts do not match.
    """
    split_dir = find_split_dir(root, split)
    out_csv = Path(out_csv)
    options = {"root": str(Path(root).resolve()), "split": split,
               "data_root": str(Path(data_root).resolve()) if data_root else None}
    trans_files = sorted(split_dir.glob("*/*/*.trans.txt"))
    audio_files = sorted(split_dir.glob("*/*/*.flac"))
    inputs, redo = manifest_inputs(out_csv, options, trans_files + audio_files, split_dir, "librispeech",
                                   skip_existing)
    if not redo:
        return out_csv
    texts = read_transcripts(split_dir)
    audio = audio_by_id(audio_files)
    if not audio:
        raise FileNotFoundError(f"no .flac files under {split_dir}")
    no_text = sorted(set(audio) - set(texts))
    no_audio = sorted(set(texts) - set(audio))
    if no_text or no_audio:
        raise ValueError(f"{split_dir}: {len(no_text)} audio file(s) without transcript "
                         f"{no_text[:3]} and {len(no_audio)} transcript(s) without audio "
                         f"{no_audio[:3]}; is the split completely unpacked?")
    rows = []
    for utt in sorted(audio):
        path = audio[utt]
        rows.append({
            "ID": utt,
            "duration": round(audio_duration(path), 4),
            "wav": to_placeholder(path, data_root),
            "spk_id": utt.split("-")[0],
            "wrd": texts[utt],
        })
    write_manifest(out_csv, rows)
    save_record(out_csv, "librispeech", options, inputs=inputs)
    logger.info("wrote %d utterances of %s to %s", len(rows), split, out_csv)
    return out_csv
