"""A stream manifest read for decoding: its rows checked and, in order, each turned into the
utterance's waveform or the reason to skip it (missing / empty / corrupt audio, NaN or inf
samples, no transcript, too long, too short for the model, shorter than the manifest says)."""
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import torch

from tta_brain.data.audio import AudioError, load_audio
from tta_brain.data.manifest import read_header, read_manifest, validate_manifest
from tta_brain.metrics import normalize_text

__all__ = ["STREAM_REQUIRED", "load_stream", "Utterance", "StreamLoader", "boundaries"]

#: Columns a stream manifest must have (``domain``, ``segment``, ``position`` are optional; with
#: ``position``, rows must be in order 0..n-1).
STREAM_REQUIRED = ("ID", "duration", "wav", "wrd")


def load_stream(path, data_root=None) -> List[Dict]:
    """Validate a stream manifest and read it (``$data_root`` replaced).

    Raises :class:`ManifestError` naming the file and the problem: missing file or columns, no
    rows, positions out of order, ``$data_root`` without a value.
    """
    header = read_header(path)
    required = STREAM_REQUIRED + (("position",) if "position" in header else ())
    validate_manifest(path, required=required)
    return read_manifest(path, replacements={"data_root": data_root or ""})


def boundaries(rows: List[Dict]) -> List[int]:
    """Positions where the manifest's ``segment`` changes (the true domain boundaries)."""
    segs = [int(r.get("segment") or 0) for r in rows]
    return [int(rows[i].get("position") or i) for i in range(1, len(rows)) if segs[i] != segs[i - 1]]


@dataclass
class Utterance:
    """One stream row: ``wav`` to decode, or ``reason`` why it is skipped."""
    index: int               # row index in the manifest
    position: int
    row: Dict
    duration: float
    wav: Optional[torch.Tensor] = None
    reason: Optional[str] = None

    @property
    def id(self) -> str:
        return self.row["ID"]

    @property
    def domain(self) -> str:
        return self.row.get("domain", "")

    @property
    def segment(self) -> int:
        return int(self.row.get("segment") or 0)


class StreamLoader:
    """Walks the rows from ``start`` and yields :class:`Utterance` objects.

    ``max_duration`` (s, 0 = no limit), ``sample_rate`` and ``frames`` (samples -> output frames
    of the model, to reject audio too short for it; None = no check).
    """

    def __init__(self, rows: List[Dict], max_duration: float = 20.0, sample_rate: int = 16000,
                 frames: Optional[Callable[[int], int]] = None):
        self.rows, self.max_duration, self.sr, self.frames = rows, max_duration, sample_rate, frames

    def __len__(self):
        return len(self.rows)

    def iterate(self, start: int = 0) -> Iterator[Utterance]:
        for pos in range(start, len(self.rows)):
            yield self.load(pos)

    def load(self, pos: int) -> Utterance:
        row = self.rows[pos]
        utt = Utterance(pos, int(row.get("position") or pos), row, 0.0)
        utt.wav, utt.reason = self._audio(utt, row)
        return utt

    def _audio(self, utt, row):
        max_dur, sr = self.max_duration, self.sr
        if not normalize_text(row.get("wrd") or ""):
            return None, "empty transcript (wrd)"
        if not str(row.get("wav") or "").strip():
            return None, "empty wav path"
        try:
            utt.duration = dur = float(row.get("duration") or 0)
        except ValueError:
            return None, f"bad duration {row.get('duration')!r}"
        if max_dur and dur > max_dur:
            return None, f"longer than max_duration ({dur:.1f} s > {max_dur:.1f} s)"
        try:
            wav = load_audio(row["wav"], sr)
        except AudioError as e:
            return None, str(e)
        n = wav.shape[-1]
        if max_dur and n / sr > max_dur:
            return None, (f"{row['wav']}: longer than max_duration ({n / sr:.1f} s > "
                          f"{max_dur:.1f} s; the manifest says {dur:.1f} s)")
        if dur > 0 and abs(n / sr - dur) > max(0.1, 0.1 * dur):
            # libsndfile reads a truncated file without complaint; the manifest knows better
            return None, (f"{row['wav']}: {n / sr:.2f} s of audio but the manifest says "
                          f"{dur:.2f} s (truncated or replaced file?)")
        if self.frames is not None and self.frames(n) < 1:
            return None, f"{row['wav']}: too short for the model ({n} samples give no output frame)"
        return wav, None
