"""An experiment folder as a whole: the typed :class:`Run` the report and the plots read (records +
summary), and clearing a folder for ``--overwrite``."""
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from tta_brain.run.records import (CSV_FILES, Lii, Memory, RecordError, Transcript, read_lii,
                                   read_memory, read_resets, read_transcripts)
from tta_brain.run.summary import Summary, read_summary

__all__ = ["Run", "load_run", "clear_run", "walk", "RUN_FILES"]

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """An experiment folder as the report and the plots see it."""
    dir: Path
    name: str                      # relative to the results root
    summary: Summary
    transcripts: List[Transcript]
    resets: List[int]
    lii: List[Lii]
    memory: List[Memory] = field(default_factory=list)
    #: why ``memory.csv`` could not be read (a diagnostic: the run's results stand without it)
    memory_error: Optional[str] = None

    @property
    def method(self) -> str:
        return self.summary.method

    @property
    def stream(self) -> str:
        return self.summary.stream

    @property
    def seed(self):
        return self.summary.seed

    @property
    def steps(self) -> Optional[int]:
        return self.summary.steps

    @property
    def boundaries(self) -> List[int]:
        return self.summary.boundaries

    @property
    def source_model(self) -> Optional[str]:
        """The source model the run adapted, as its fingerprint identifies it (``sha1:`` of a
        local folder's files, ``hub:<name>@<commit>``); ``None`` where it records none."""
        source = ((self.summary.fingerprint or {}).get("hparams") or {}).get("source")
        return str(source) if source else None


#: Folders under a results root that hold no run: checkpoints, plots.
SKIP_DIRS = {"save", "plots", "__pycache__"}


def walk(root):
    """``(folder, its file names)`` of every folder under ``root``, in name order: linked folders
    followed (runs gathered by symlinks), each real folder once (a link loop ends), checkpoint,
    plot and hidden folders left out. The one walk of a results root (report, compare_runs)."""
    seen = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        yield dirpath, filenames


def load_run(folder, root=None) -> Run:
    """Read a finished experiment folder (raises :class:`RecordError` naming the bad file). Its
    transcripts must be those its summary was computed from (utterances, words, errors): a
    ``transcripts.csv`` cut short at a line boundary (a copy from a cluster that stopped, a full
    disk) or changed after the run reads as a smaller run, not as this one."""
    folder = Path(folder)
    summary = read_summary(folder)
    transcripts = sorted(read_transcripts(folder), key=lambda t: t.position)
    held = (len(transcripts), sum(t.n_words for t in transcripts), sum(t.n_err for t in transcripts))
    said = (summary.n_utts, summary.n_words, summary.n_err)
    if held != said:
        raise RecordError(f"{folder / 'transcripts.csv'}: {held[0]} utterances, {held[1]} words, "
                          f"{held[2]} errors, but summary.json says {said[0]}, {said[1]}, "
                          f"{said[2]} ({AGAIN})")
    try:        # memory.csv is a diagnostic: damaged, it costs the memory figures, not the run
        memory, memory_error = sorted(read_memory(folder), key=lambda m: m.position), None
    except RecordError as err:
        memory, memory_error = [], str(err)
        logger.warning("%s: memory figures left out: %s", folder, err)
    resets = sorted(r.position for r in read_resets(folder))
    if resets != sorted(summary.resets):
        raise RecordError(f"{folder / 'resets.csv'}: {len(resets)} resets"
                          f"{_at(resets)}, but summary.json says {len(summary.resets)}"
                          f"{_at(sorted(summary.resets))} ({AGAIN})")
    # a reset after the last decoded utterance (the stream's end, or rows all skipped on their
    # manifest) decoded nothing: runs before 0ac67ac / 5a60a29 recorded it, today's do not; the
    # report leaves it out of both (it was counted as a false detection)
    last = max((t.position for t in transcripts), default=-1)
    resets = [p for p in resets if p <= last]
    lii = sorted(read_lii(folder), key=lambda v: v.position)
    if summary.n_lii is not None and len(lii) != summary.n_lii:   # (older summaries: unknown)
        raise RecordError(f"{folder / 'lii.csv'}: {len(lii)} LII values, but summary.json says "
                          f"{summary.n_lii} ({AGAIN})")
    return Run(dir=folder, name=os.path.relpath(folder, root) if root is not None else folder.name,
               summary=summary, transcripts=transcripts, resets=resets, lii=lii,
               memory=memory, memory_error=memory_error)


#: what to do with a finished run's records that are not those its summary counted
AGAIN = "cut short or changed after the run finished: copy the folder again, or delete it and " \
        "rerun its decode command"


def _at(positions: List[int], shown: int = 6) -> str:
    if not positions:
        return ""
    return " at " + ", ".join(map(str, positions[:shown])) + (", ..." if len(positions) > shown
                                                               else "")


#: Everything a run writes into its folder besides the record CSVs (``save/``: checkpoints).
RUN_FILES = ("wer.txt", "summary.json", "stream.csv", "hyperparams.yaml", "log.txt", "env.log",
             "fingerprint.json", "save")


def clear_run(folder) -> List[str]:
    """Delete a run's records, summary, checkpoints and logs (``--overwrite``); the names removed."""
    import shutil
    folder, removed = Path(folder), []
    for name in [f"{n}.csv" for n in CSV_FILES] + list(RUN_FILES):
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
