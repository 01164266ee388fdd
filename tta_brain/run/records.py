"""The run record: the per-utterance files of one experiment folder, their columns and types. The
only module that reads or writes them (the Brain writes, the report and the plots read).

    transcripts.csv  one row per decoded utterance (:class:`Transcript`)
    rejects.csv      skipped utterances and why (:class:`Reject`)
    resets.csv       resets (:class:`Reset`): position = the stream row the reset model decodes
                     from (a skipped row's when the reset falls on one: the reset column of
                     transcripts.csv marks the first utterance decoded after it)
    lii.csv          LII values of the dynamic reset (:class:`Lii`)
    memory.csv       process memory along the stream (:class:`Memory`)
    wer.txt          SpeechBrain ``ErrorRateStats`` with per-utterance alignments

``summary.json`` is :mod:`tta_brain.run.summary`'s; the folder as a whole (the typed :class:`Run` the
report reads, clearing it for ``--overwrite``) is :mod:`tta_brain.run.folder`'s.
"""
import csv
import functools
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from tta_brain import quirks  # noqa: F401  (first: SpeechBrain without its torch quirks)
from speechbrain.utils.metric_stats import ErrorRateStats

from tta_brain.data.manifest import first_non_utf8_line

__all__ = ["Transcript", "Reject", "Reset", "Lii", "Memory", "RecordWriter", "RecordError",
           "CSV_FILES", "read_transcripts", "read_rejects", "read_resets", "read_lii",
           "read_memory", "rows_done", "decoded_rows", "write_wer_file"]


class RecordError(ValueError):
    """A record file that is missing, cut short or not in this version's format."""


@dataclass(slots=True)
class Transcript:
    position: int
    ID: str
    domain: str
    segment: int
    duration: float
    ref: str
    hyp: str
    n_words: int
    n_err: int
    n_sub: int
    n_del: int
    n_ins: int
    reset: int = 0          # 1: the first utterance decoded after a reset


@dataclass(slots=True)
class Reject:
    position: int
    ID: str
    wav: str
    reason: str


@dataclass(slots=True)
class Reset:
    position: int           # the row the reset model decodes from (may be a skipped row)
    ID: str
    reason: str
    trigger: int            # the utterance whose processing caused it


@dataclass(slots=True)
class Lii:
    position: int
    lii: float
    stage: str              # construction | detection


@dataclass(slots=True)
class Memory:
    position: int           # the last utterance decoded before the sample
    rss_mb: float           # resident set size of the process (MiB)
    cuda_mb: float          # memory held by torch's CUDA tensors (MiB; 0 on CPU)

    @classmethod
    def sample(cls, position: int, device="cpu") -> "Memory":
        """This process's memory now (RSS from ``/proc/self/status``, else ``ru_maxrss``)."""
        rss = None
        try:
            with open("/proc/self/status") as f:
                rss = next((int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmRSS:")), None)
        except OSError:
            pass
        if rss is None:     # not Linux: the peak (ru_maxrss: kB on Linux, bytes on macOS)
            import resource
            import sys
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            rss = peak / 2 ** 20 if sys.platform == "darwin" else peak / 1024
        cuda = 0.0
        if str(device).startswith("cuda"):
            import torch
            cuda = torch.cuda.memory_allocated(device) / 2 ** 20
        return cls(int(position), round(rss, 2), round(cuda, 2))


CSV_FILES = {"transcripts": Transcript, "rejects": Reject, "resets": Reset, "lii": Lii,
             "memory": Memory}
#: Record files newer than some checkpoints: resuming from a checkpoint without their offset
#: starts them anew instead of refusing the resume.
ADDED_LATER = ("memory",)


def _columns(cls) -> List[str]:
    return [name for name, _ in _spec(cls)]


@functools.lru_cache(maxsize=None)
def _spec(cls):
    """``(name, type)`` of each field of a record class (asked once per class, not per row)."""
    return tuple((f.name, f.type) for f in fields(cls))


def _parse(cls, row: Dict[str, str], path, line: int, header=()):
    out = {}
    for name, kind in _spec(cls):
        value = row.get(name)
        if value is None and name in header:        # the header has it, the row stops before it
            given = sum(v is not None for k, v in row.items() if k is not None)
            raise RecordError(f"{path}:{line}: {given} of the header's {len(header)} fields, "
                              f"no '{name}' (the line is cut short)")
        if value is None:
            raise RecordError(f"{path}:{line}: no '{name}' (not a {cls.__name__} record of "
                              f"this tta_brain version)")
        try:
            out[name] = kind(value) if kind in (int, float) else value
        except ValueError:
            raise RecordError(f"{path}:{line}: {name} {value!r} is not {kind.__name__}") from None
    return cls(**out)


def _read(folder, name: str) -> list:
    path = Path(folder) / f"{name}.csv"
    if not path.is_file():
        raise RecordError(f"{path}: missing")
    cls = CSV_FILES[name]
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:   # every writer starts with the header
                raise RecordError(f"{path}: empty, without even its header line (cut short, "
                                  f"or emptied after the run)")
            return [_parse(cls, row, path, i, reader.fieldnames or ())
                    for i, row in enumerate(reader, start=2)]
    except UnicodeDecodeError:          # damaged bytes, or a file of another encoding
        raise RecordError(f"{path}:{first_non_utf8_line(path)}: not UTF-8 text "
                          f"(damaged?)") from None
    except csv.Error as err:    # a line past csv's field limit (damaged bytes): the csv reader's
        # line (DictReader.line_num, set after each row, is the row before's)
        raise RecordError(f"{path}:{reader.reader.line_num}: malformed CSV: {err}") from None


def read_transcripts(folder) -> List[Transcript]:
    return _read(folder, "transcripts")


def read_rejects(folder) -> List[Reject]:
    return _read(folder, "rejects")


def read_resets(folder) -> List[Reset]:
    return _read(folder, "resets")


def read_lii(folder) -> List[Lii]:
    return _read(folder, "lii")


def read_memory(folder) -> List[Memory]:
    """``memory.csv`` (empty for runs written before it existed)."""
    return _read(folder, "memory") if (Path(folder) / "memory.csv").is_file() else []


#: ``rows_done``'s counts so far: path -> (device, inode, bytes counted, lines in them, the last
#: bytes counted). A grid asks every few seconds for each running run; reading only what was
#: appended since keeps that from reading every record file whole each time (500 Slurm runs of
#: 10,000 rows: about 0.5 GB a poll over a network file system).
_COUNTED: Dict[str, tuple] = {}
_TAIL = 64


def _lines(path: str) -> int:
    """Complete lines of ``path`` (0 if it cannot be read), counting only what was appended
    since the last call; a file replaced, cut short or rewritten before that point (a resumed
    run drops the rows after its checkpoint) is counted again from its start."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            dev, ino, done, n, tail = _COUNTED.get(path, (None, None, 0, 0, b""))
            if (dev, ino) != (st.st_dev, st.st_ino) or st.st_size < done or (
                    done and (f.seek(done - len(tail)), f.read(len(tail)))[1] != tail):
                done, n = 0, 0
            f.seek(done)
            new = f.read()
            end = new.rfind(b"\n") + 1        # complete lines only: a line being written waits
            n += new.count(b"\n", 0, end)
            done += end
            if done:
                f.seek(max(done - _TAIL, 0))
                tail = f.read(min(done, _TAIL))
            _COUNTED[path] = (st.st_dev, st.st_ino, done, n, tail)
            return n
    except OSError:
        _COUNTED.pop(path, None)
        return 0


def rows_done(folder) -> int:
    """Stream rows a run has recorded so far (transcripts + rejects), read while it runs: the
    grid's progress. Counts complete lines only; 0 for a folder with no records yet."""
    return sum(max(_lines(os.path.join(str(folder), f"{name}.csv")) - 1, 0)
               for name in ("transcripts", "rejects"))


def decoded_rows(folder) -> int:
    """Rows of ``folder``'s ``transcripts.csv`` (lines past the header; 0 without the file): what
    a run stopped before its first checkpoint decodes again."""
    path = Path(folder) / "transcripts.csv"
    return max(path.read_bytes().count(b"\n") - 1, 0) if path.is_file() else 0


def write_wer_file(folder, transcripts: Iterable[Transcript]) -> None:
    """``wer.txt``: SpeechBrain's ``ErrorRateStats`` of the transcripts (Kaldi-style alignments)."""
    stats = ErrorRateStats()
    for t in transcripts:
        stats.append([t.ID], [t.hyp.split()], [t.ref.split()])
    with open(Path(folder) / "wer.txt", "w", encoding="utf-8") as f:
        stats.write_stats(f)


class RecordWriter:
    """Appends the per-utterance records of a run, flushed line by line.

    ``sync()`` fsyncs the files and returns their byte lengths (stored in a checkpoint). Opened
    with such ``offsets`` (a resume), every file is cut back to them, which drops whatever was
    written after that checkpoint, partial lines included; the kept records give the running
    counts and the resets announced for utterances not decoded yet.
    """

    def __init__(self, folder, offsets: Optional[Dict[str, int]] = None, cursor: int = 0):
        self.folder = Path(folder)
        self.n_err = self.n_words = self.n_resets = 0
        self._pending = set()            # positions whose transcript gets reset = 1
        self._files, self._writers = {}, {}
        for name, cls in CSV_FILES.items():
            path = self.folder / f"{name}.csv"
            if offsets is not None:
                size = offsets.get(name)
                if size is None and name in ADDED_LATER:
                    size = 0            # started anew: a fresh header is written below
                    path.touch()
                have = path.stat().st_size if path.is_file() else -1
                if size is None or have < size:
                    raise RecordError(
                        f"{path}: {'missing' if have < 0 else f'{have} bytes'}, but the checkpoint "
                        f"at row {cursor} recorded {size} bytes; the records cannot be resumed. "
                        f"Delete {self.folder / 'save'} (or use another --output_folder) to restart.")
                with open(path, "r+b") as f:
                    f.truncate(size)
                fh = open(path, "a", newline="", encoding="utf-8")
                if size == 0:
                    csv.writer(fh).writerow(_columns(cls))
                    fh.flush()
            else:
                fh = open(path, "w", newline="", encoding="utf-8")
                csv.writer(fh).writerow(_columns(cls))
                fh.flush()
            self._files[name], self._writers[name] = fh, csv.writer(fh)
        if offsets is not None:
            last = -1                   # the last utterance decoded before the checkpoint
            for t in read_transcripts(self.folder):
                self.n_err, self.n_words = self.n_err + t.n_err, self.n_words + t.n_words
                last = max(last, t.position)
            for r in read_resets(self.folder):
                self.n_resets += 1
                if r.position > last:
                    self._pending.add(r.position)

    def _row(self, name: str, rec) -> None:
        self._writers[name].writerow([getattr(rec, c) for c in _columns(CSV_FILES[name])])

    def transcript(self, rec: Transcript) -> None:
        # a reset due at a skipped row (too short, an empty reference) marks the next one decoded
        rec.reset = int(any(p <= rec.position for p in self._pending))
        self._pending = {p for p in self._pending if p > rec.position}
        self._row("transcripts", rec)
        self.n_err, self.n_words = self.n_err + rec.n_err, self.n_words + rec.n_words

    def reject(self, rec: Reject) -> None:
        self._row("rejects", rec)

    def reset(self, rec: Reset) -> None:
        self._row("resets", rec)
        self._pending.add(rec.position)
        self.n_resets += 1

    def memory(self, rec: Memory) -> None:
        self._row("memory", rec)

    def lii(self, position: int, value: float, stage: str) -> None:
        self._writers["lii"].writerow([position, f"{value:.6g}", stage])

    def flush(self) -> None:
        for fh in self._files.values():
            fh.flush()

    def sync(self) -> Dict[str, int]:
        """Flush and fsync every file; their byte lengths (the resume offsets)."""
        for fh in self._files.values():
            fh.flush()
            os.fsync(fh.fileno())
        return {name: os.path.getsize(self.folder / f"{name}.csv") for name in CSV_FILES}

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
