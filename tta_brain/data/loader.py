"""A stream manifest read for decoding: its rows checked and, in order, each turned into the
utterance's waveform or the reason to skip it (missing / empty / corrupt audio, NaN or inf
samples, no transcript, too long, too short for the model, shorter than the manifest says).

``StreamLoader.prefetch`` reads the next rows in a background thread while the current one is
decoded (the decode loop's default), so that the device does not wait for the disk between
utterances; it yields exactly what ``iterate`` yields.
"""
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional

import soundfile as sf
import torch

from tta_brain.data.audio import AudioError, load_audio
from tta_brain.data.manifest import read_header, read_manifest, validate_manifest
from tta_brain.asr.metrics import normalize_text

logger = logging.getLogger(__name__)

__all__ = ["STREAM_REQUIRED", "load_stream", "Utterance", "StreamLoader", "boundaries",
           "too_short"]

#: Columns a stream manifest must have (``domain``, ``segment``, ``position`` are optional; with
#: ``position``, rows must be in order 0..n-1).
STREAM_REQUIRED = ("ID", "duration", "wav", "wrd")


def load_stream(path, data_root=None) -> List[Dict]:
    """Validate a stream manifest and read it (``$data_root`` replaced).

    Raises :class:`ManifestError` naming the file and the problem: missing file or columns, no
    rows, positions out of order, ``$data_root`` without a value. A manifest with ``domain`` but
    no ``segment`` column gets its segments from the domain blocks.
    """
    header = read_header(path)
    required = STREAM_REQUIRED + (("position",) if "position" in header else ())
    validate_manifest(path, required=required, stream=True)
    lines = []
    rows = read_manifest(path, replacements={"data_root": data_root or ""}, lines=lines)
    if "domain" in header and "segment" in header:
        inside = next((i for i in range(1, len(rows)) if rows[i]["domain"] != rows[i - 1]["domain"]
                       and rows[i]["segment"] == rows[i - 1]["segment"]), None)
        if inside is not None:       # the oracle reset and boundary detection follow segment
            logger.warning("%s:%d: the domain changes (%s -> %s) within segment %s: the oracle "
                           "reset and the report's boundaries follow the segment column, its "
                           "per-domain error rates the domain column", path, lines[inside],
                           rows[inside - 1]["domain"], rows[inside]["domain"],
                           rows[inside]["segment"])
    if "domain" in header and "segment" not in header:
        # segment = the index of the contiguous domain block (the column's definition): a
        # manifest of one's own with domains but no segments still has its true boundaries
        segment = 0
        for i, row in enumerate(rows):
            segment += i > 0 and row["domain"] != rows[i - 1]["domain"]
            row["segment"] = str(segment)
        if segment:
            logger.info("%s: no segment column: %d domain blocks from its domain column", path,
                        segment + 1)
    return rows


def too_short(method) -> Optional[Callable[[int], Optional[str]]]:
    """samples -> why audio of that length is too short for ``method``'s model (None: long
    enough), or None when the method has no lobe that says (no check). Too short: no output frame;
    or, for a method adapting in train mode (AWMC; SDPL's ``train_mode``) on a model whose
    SpecAugment masks time spans in training (wav2vec2's ``mask_time_prob`` > 0), fewer frames
    than one span (``mask_time_length``), which transformers refuses with an error."""
    lobe = getattr(method, "lobe", None)
    out_len = getattr(lobe, "output_lengths", None)
    if out_len is None:
        return None
    cfg = getattr(getattr(lobe, "model", None), "config", None)
    need = 1
    if (getattr(method, "train_mode", False) and getattr(cfg, "apply_spec_augment", False)
            and float(getattr(cfg, "mask_time_prob", 0) or 0) > 0):
        need = max(1, int(getattr(cfg, "mask_time_length", 1)))

    def why(n: int) -> Optional[str]:
        frames = int(out_len(torch.tensor(n)))
        if frames >= need:
            return None
        if frames < 1:
            return f"{n} samples give no output frame"
        return (f"{n} samples give {frames} output frames, fewer than the {need} of one "
                f"SpecAugment time mask, which the model draws in train mode")
    return why


def boundaries(rows: List[Dict]) -> List[int]:
    """Positions where the manifest's ``segment`` changes (the true domain boundaries)."""
    segs = [int(r.get("segment") or 0) for r in rows]
    return [int(rows[i].get("position") or i) for i in range(1, len(rows)) if segs[i] != segs[i - 1]]


def _header_seconds(path) -> Optional[float]:
    """The length of the audio file ``path`` in seconds by its header (no samples read), or None
    where there is no regular file or its header cannot be read (``load_audio`` says why)."""
    try:
        if not os.path.isfile(path):
            return None
        info = sf.info(str(path))
    except Exception:       # noqa: BLE001 - libsndfile's errors: load_audio names them
        return None
    return info.frames / info.samplerate if info.samplerate and info.frames > 0 else None


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

    ``max_duration`` (s, 0 = no limit), ``sample_rate`` and ``too_short`` (samples -> why that
    is too short for the method's model, or None: :func:`too_short`; None = no check).
    """

    def __init__(self, rows: List[Dict], max_duration: float = 20.0, sample_rate: int = 16000,
                 too_short: Optional[Callable[[int], Optional[str]]] = None):
        self.rows, self.max_duration, self.sr = rows, max_duration, sample_rate
        self.too_short = too_short
        self.warned = set()     # conversions logged: once a run's stream (a run's own log.txt)

    def __len__(self):
        return len(self.rows)

    def iterate(self, start: int = 0) -> Iterator[Utterance]:
        for pos in range(start, len(self.rows)):
            yield self.load(pos)

    def prefetch(self, start: int = 0, depth: int = 2) -> Iterator[Utterance]:
        """:meth:`iterate` from ``start``, with up to ``depth`` rows read ahead in a background
        thread (``depth`` 0: no thread). The same utterances in the same order.

        The thread only reads and checks audio on the CPU (no device work, so it cannot disturb a
        CUDA graph capture of the main thread). An exception raised while reading a row (other
        than the per-row problems ``load`` turns into a skip reason) is raised again here, at
        that row, as the synchronous loop would raise it. Closing the generator (or leaving the
        loop) stops and joins the thread; a thread that dies without handing over its row is an
        error, never a hang.
        """
        if depth <= 0:
            yield from self.iterate(start)
            return
        handoff: "queue.Queue" = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def work():
            for pos in range(start, len(self.rows)):
                if stop.is_set():
                    return
                try:
                    item = (pos, self.load(pos), None)
                except BaseException as e:         # noqa: BLE001 - handed to the consumer
                    item = (pos, None, e)
                if not put(item) or item[2] is not None:
                    return

        thread = threading.Thread(target=work, name=f"tta-prefetch@{start}", daemon=True)
        thread.start()
        try:
            for pos in range(start, len(self.rows)):
                while True:
                    try:
                        got, utt, err = handoff.get(timeout=0.2)
                        break
                    except queue.Empty:
                        if not thread.is_alive() and handoff.empty():
                            raise RuntimeError(f"the stream prefetch thread stopped before row "
                                               f"{pos} ({self.rows[pos].get('ID', '')}) without "
                                               f"an error") from None
                if got != pos:                      # cannot happen: one producer, in order
                    raise RuntimeError(f"stream prefetch: row {got} arrived for row {pos}")
                if err is not None:
                    if hasattr(err, "add_note"):
                        err.add_note(f"(raised while reading stream row {pos}, ID "
                                     f"{self.rows[pos].get('ID', '')!r}, in the prefetch thread)")
                    raise err
                yield utt
        finally:
            stop.set()
            while True:                             # unblock a producer waiting on a full queue
                try:
                    handoff.get_nowait()
                except queue.Empty:
                    break
            thread.join(timeout=10)

    def load(self, pos: int) -> Utterance:
        row = self.rows[pos]
        utt = Utterance(pos, int(row.get("position") or pos), row, 0.0)
        utt.wav, utt.reason = self._audio(utt, row)
        return utt

    def manifest_reason(self, row: Dict) -> Optional[str]:
        """Why ``row`` is skipped on its manifest alone (before its audio is read), or None."""
        if not normalize_text(row.get("wrd") or ""):
            return "empty transcript (wrd)"
        if not str(row.get("wav") or "").strip():
            return "empty wav path"
        try:
            dur = float(row.get("duration") or 0)
        except ValueError:
            return f"bad duration {row.get('duration')!r}"
        if self.max_duration and dur > self.max_duration:
            return f"longer than max_duration ({dur:g} s > {self.max_duration:g} s)"
        return None

    def _audio(self, utt, row):
        max_dur, sr = self.max_duration, self.sr
        why = self.manifest_reason(row)
        if why:
            return None, why
        utt.duration = dur = float(row.get("duration") or 0)
        said = f"the manifest says {dur:g} s" if dur else "the manifest gives no duration"
        head = _header_seconds(row["wav"]) if max_dur else None
        if head is not None and head > max_dur:
            # before reading it: a long recording without a duration (an hour at 48 kHz in
            # stereo is 1.4 GB as float32, and its resampling more) is not read to be skipped
            return None, (f"{row['wav']}: longer than max_duration ({head:g} s > {max_dur:g} s; "
                          f"{said})")
        try:
            wav = load_audio(row["wav"], sr, self.warned)
        except AudioError as e:
            return None, str(e)
        n = wav.shape[-1]
        if max_dur and n / sr > max_dur:
            return None, (f"{row['wav']}: longer than max_duration ({n / sr:g} s > "
                          f"{max_dur:g} s; {said})")
        if dur > 0 and abs(n / sr - dur) > max(0.1, 0.1 * dur):
            # libsndfile reads a truncated file without complaint; the manifest knows better
            return None, (f"{row['wav']}: {n / sr:.2f} s of audio but the manifest says "
                          f"{dur:.2f} s (truncated or replaced file?)")
        why = self.too_short(n) if self.too_short is not None else None
        if why:
            return None, f"{row['wav']}: too short for the model ({why})"
        if not dur:                  # an empty (or 0) duration cell: the audio's own length
            utt.duration = n / sr
        return wav, None
