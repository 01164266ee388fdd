"""Decode a stream with a TTA method: the SpeechBrain recipe skeleton.

    python -m tta_brain.decode <method or yaml> --source=<model dir or hub name> \\
        --stream_csv=<stream manifest> --output_folder=<exp dir> [--reset=dynamic] [--key=value]

``<method>`` is a packaged method (``python -m tta_brain.decode --help`` lists them) or the path of
a yaml. Every ``--key=value`` that is not a run option overrides the yaml (a later one wins over
an earlier one); ``python -m tta_brain.decode <method> --help`` lists the keys with their
defaults. Run options: ``--device``, ``--precision``, ``--compile``, ``--noprogressbar``;
SpeechBrain's training options are refused. Rerunning the same command resumes an interrupted run
(even one killed with ``kill -9``) from its last checkpoint.

Mistakes in the command, the yaml or the stream manifest stop the run with one ``ERROR:`` line
naming the file and the key (set ``TTA_DEBUG=1`` for the Python traceback).

One writer per folder: the run holds an exclusive lock on ``<output_folder>/.lock``; a second
process on the same folder stops at once naming the holder. The run's fingerprint
(``tta_brain.run.identity``) decides what a rerun does: a finished run with the same fingerprint is
skipped, an interrupted one resumed; a folder holding a run with another fingerprint is refused
(the message lists the keys that differ) unless ``--overwrite`` is given.
"""
import errno
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tta_brain import quirks  # noqa: F401  (first: SpeechBrain without its torch quirks)
import speechbrain as sb
import torch

from tta_brain import hparams as hp_files
from tta_brain.run import identity
from tta_brain.run.brain import TTABrain
from tta_brain.run.checkpoint import ResumeError, checkpoint_files, saved_fingerprint
from tta_brain.run.cli import UsageError, help_text, parse_arguments, record_hparams
from tta_brain.data.loader import load_stream
from tta_brain.data.manifest import ManifestError
from tta_brain.data.prep.progress import hidden as progress_hidden
from tta_brain.run.envinfo import describe_device, installed_packages, versions
from tta_brain.run.folder import clear_run, load_run
from tta_brain.run.records import CSV_FILES, RecordError
from tta_brain.run.summary import percent, read_summary
from tta_brain.lobes.runtime import (KERNEL_CACHE_VARIABLES, bound_kernel_caches, free_run_memory,
                                    process_settings)

logger = logging.getLogger("tta_brain.decode")     # one name, imported or run with -m
# torch.compile's kernel cache takes a file lock per kernel: its DEBUG lines (hundreds for a tiny
# model) filled log.txt, which SpeechBrain writes at DEBUG
logging.getLogger("filelock").setLevel(logging.WARNING)


#: the errors of a full disk, a file size limit and a full quota
NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _fail(message):
    """Stop with a one-line message (no traceback unless TTA_DEBUG is set)."""
    if os.environ.get("TTA_DEBUG") and sys.exc_info()[1] is not None:
        raise
    raise SystemExit(f"ERROR: {message}")


def log_to_files(message, exc_info=None):
    """``message`` as an error in the run's log.txt: the root logger's file handlers only (on
    the console it would stand twice: logged, then as the ERROR line that stops the run);
    ``exc_info``: with that exception's traceback."""
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s", (message,),
                               exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def close_run_log(out) -> None:
    """Detach and close the root logger's handler of ``<out>/log.txt`` (SpeechBrain's
    ``create_experiment_directory`` installs it and nothing removes it): in a process that goes
    on (a notebook, a sweep script) what is logged after the run, the caller's own lines or a
    next command that fails before it has a folder, went into this run's log.txt."""
    path = os.path.abspath(os.path.join(out, "log.txt"))
    root = logging.getLogger()
    for handler in root.handlers[:]:
        if isinstance(handler, logging.FileHandler) and handler.baseFilename == path:
            root.removeHandler(handler)
            handler.close()


def _fail_logged(message):
    """:func:`_fail`, with ``message`` also in the run's log.txt (:func:`log_to_files`)."""
    log_to_files(message)
    _fail(message)


def _log_run(out, argv, seed, device, deterministic, source=None):
    """Seed, device, source model identity, versions and command in log.txt and env.log (after
    SpeechBrain's environment description: ``installed_packages``)."""
    vers = versions()
    logger.info("Command: python -m tta_brain.decode %s", " ".join(argv))
    logger.info("Seed: %s", seed)
    if source:
        logger.info("Source model: %s", source)
    logger.info("Device: %s; deterministic kernels: %s", device, deterministic)
    logger.info("CPU threads: %d (torch intra-op; OMP_NUM_THREADS=%s)", torch.get_num_threads(),
                os.environ.get("OMP_NUM_THREADS", "(unset)"))
    logger.info("Versions: %s", json.dumps(vers))
    logger.info("Environment (pip freeze, git, CUDA): %s", os.path.join(out, "env.log"))
    with open(os.path.join(out, "env.log"), "a", encoding="utf-8") as f:
        f.write("\n==============================\ntta-brain run\n")
        f.write(f"Command: python -m tta_brain.decode {' '.join(argv)}\n")
        f.write(f"Seed: {seed}\n")
        if source:
            f.write(f"Source model: {source}\n")
        f.write(f"Device: {device}\nDeterministic kernels: {deterministic}\n")
        f.write(f"CPU threads: {torch.get_num_threads()}\n")
        for k, v in vers.items():
            f.write(f"{k}: {v}\n")
        for k in KERNEL_CACHE_VARIABLES:
            f.write(f"{k}: {os.environ.get(k, '(library default)')}\n")


@dataclass
class Plan:
    """What a decode command would do, worked out once without loading the model or writing a
    file: the resolved yaml, the stream's rows, the fingerprint and the folder's status."""
    hp: object                    # hparams.Resolved: path, resolved text, values
    args: object                  # cli.Arguments
    rows: list                    # the stream manifest's rows (read once)
    record: dict                  # the plain values recorded with the run (summary, fingerprint)
    stream_csv: str
    out: str
    fingerprint: dict
    status: str                   # new | resume | done | differs | damaged
    diffs: list
    determinism: str = ""         # the deterministic-kernels and TF32 line (set by prepare)
    notes: list = field(default_factory=list)   # what reading the stream logged (for log.txt)

    @property
    def resolved(self) -> dict:
        return self.hp.values if self.hp is not None else {}


def folder_status(out, fp):
    """``(status, differences)`` of an output folder for a run with fingerprint ``fp``;
    ``damaged``: this run finished there, but its records are not those its summary was computed
    from (cut short, changed) or the summary is unreadable: the difference is the reason."""
    folder = Path(out)
    if (folder / "summary.json").is_file():
        unread = None
        try:
            old = read_summary(folder).fingerprint or identity.read_fingerprint(folder)
        except RecordError as e:
            old, unread = identity.read_fingerprint(folder), e
        diffs = identity.differences(old, fp)
        if diffs:
            return "differs", diffs
        if unread is not None and checkpoint_files(folder):  # the stream's end was saved: its
            return "resume", [f"{unread}; the run resumes from its last checkpoint, which "
                              f"writes it again (nothing is decoded twice)"]
        try:
            load_run(folder)
        except RecordError as e:
            return "damaged", [str(e)]
        return "done", []
    old = identity.read_fingerprint(folder)
    if old is None and (folder / identity.FINGERPRINT_FILE).is_file():
        said = f"{folder / identity.FINGERPRINT_FILE}: cannot be read (cut short or damaged)"
        saved = saved_fingerprint(folder)    # the checkpoint's own copy, asked before anything
        if saved is None:                    # is written there
            return "damaged", [f"{said}, and no checkpoint tells which run the folder holds"]
        diffs = identity.differences(saved, fp)
        return ("differs", diffs) if diffs else \
            ("resume", [f"{said}; its checkpoint's copy of the fingerprint is this run's: it "
                        f"resumes there"])
    if old is not None:
        diffs = identity.differences(old, fp)
        return ("differs", diffs) if diffs else ("resume", [])
    # a run's files without its fingerprint (written first): another program's or an older
    # tta_brain's; hyperparams.yaml and env.log would be replaced without a word
    if any((folder / f"{n}.csv").exists() for n in CSV_FILES) or (folder / "save").exists() \
            or any((folder / n).exists() for n in ("hyperparams.yaml", "env.log")):
        return "differs", identity.differences(None, fp)
    return "new", []


def settings(argv, device_here: bool = True):
    """The parsed command and its resolved, checked yaml (``hp`` None for ``--help``): what a run
    computes, known before its stream is read (a grid's ``--dry_run`` checks every run so).
    Raises SystemExit with one ``ERROR:`` line for a bad command or value."""
    try:
        args = parse_arguments(list(argv))
        if args.help:
            return args, None
        resolved = hp_files.resolve(args.method, args.overrides, device_here=device_here)
        hp_files.check_required(resolved)
        return args, resolved
    except (UsageError, hp_files.HparamsError) as e:
        _fail(str(e))


def plan(argv, device_here: bool = True, streams: dict = None) -> Plan:
    """Parse a decode command, resolve its yaml, fingerprint the run and look at its folder.
    Raises SystemExit with one ``ERROR:`` line for a bad command, yaml or manifest.
    ``device_here=False``: the run will decode on another machine (a Slurm node), so ``--device``
    is checked for its form only; the run checks it again where it starts. ``streams``: a dict
    the caller keeps while it plans many runs at once (a grid): a stream manifest (with its data
    root) is read and its audio digested once there, and its plans share the one list of rows
    (each plan held its own copy: 8 MiB a 10,000-row stream, 4 GiB for a grid of 500 runs)."""
    args, hp = settings(argv, device_here)
    if args.help:
        return Plan(None, args, [], {}, "", "", {}, "help", [])
    resolved = hp.values
    for key in ("model", "method", "stream_csv", "output_folder"):
        if key not in resolved:
            _fail(f"{hp.path}: no '{key}' key (a method yaml needs model, method, stream_csv and "
                  f"output_folder; `include: [run]` gives the last three)")
    stream_csv, out = str(resolved["stream_csv"]), str(resolved["output_folder"])
    key = (os.path.abspath(stream_csv), str(resolved.get("data_root") or ""))
    known = streams.get(key) if streams is not None else None
    try:   # before the experiment folder exists: a bad manifest leaves nothing behind
        with HeldLogs() as notes:          # logged in the run's log once it has one
            if known is None:
                rows = load_stream(stream_csv, resolved.get("data_root"))
                read = list(notes.records)     # what reading it logged, for each run's log
            else:
                rows, read, audio = known
                notes.records.extend(read)
            code = identity.your_code(resolved)
            for name, c in code.items():
                logger.info("Your own code: %s = %s (sha1 %s), in the fingerprint", name,
                            c["file"], c["sha1"][:12])
    except ManifestError as e:
        _fail(f"{e} (--stream_csv)")
    if known is None:
        audio = identity.audio_sha1(rows, stream_csv)   # console only: a cached rerun reads none
        if streams is not None:
            streams[key] = (rows, read, audio)
    record = record_hparams(resolved)
    nested = [k for k in resolved if k not in record and not str(k).startswith("__")]
    try:
        structure = hp_files.structure(hp.path, nested, args.overrides,
                                       added=identity.ADDED_TO_BLOCKS)
    except hp_files.HparamsError as e:
        _fail(str(e))
    fp = identity.fingerprint(record, stream_csv, len(rows), structure, audio, code)
    status, diffs = folder_status(out, fp)
    if status == "differs":
        diffs = identity.explain_missing_audio(diffs, rows)
        why = _missing_source(diffs, resolved.get("source"))
        if why and device_here:       # (a Slurm node may see files this machine does not)
            _fail(f"{hp.path}: {why} (--source; {out} holds a finished or started run of "
                  f"another source model, which is kept)")
    return Plan(hp, args, rows, record, stream_csv, out, fp, status, diffs, notes=notes.records)


def _missing_source(diffs, source):
    """Why the source model of a run whose ``hparams.source`` differs from its folder's cannot
    be loaded here (a mistyped ``--source`` / ``--model`` path reads as the hub name
    ``hub:<path>``, so the folder's run looked like one of other settings, to ``--overwrite``),
    or None."""
    if source is None or not any(d.startswith("hparams.source:") for d in diffs):
        return None
    from tta_brain.lobes.hf_ctc import source_problem
    return source_problem(str(source))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = plan(argv)
    if p.status == "help":
        try:
            print(help_text(p.args.method))
        except hp_files.HparamsError as e:      # a mistyped method or path, a bad include line
            _fail(str(e))
        return None
    if p.status == "done":
        return _skip(p.out, p.resolved)
    if p.status in ("differs", "damaged") and not p.args.overwrite:
        _refuse(p.out, p.diffs, p.status)
    created = not os.path.exists(p.out)
    lock = lock_folder(p.out, "python -m tta_brain.decode " + " ".join(argv))
    try:
        return _run(p, argv)
    except BaseException as e:   # a crash's traceback in log.txt: SpeechBrain's excepthook logs
        if not isinstance(e, SystemExit):   # it there only while the run's handler is attached
            log_to_files("Exception:", sys.exc_info())
        if isinstance(e, OSError) and e.errno in NO_ROOM:
            _fail(f"{p.out}: {e.strerror}{f' ({e.filename})' if e.filename else ''}: the run "
                  f"stopped; once there is room, the same command resumes it from its last "
                  f"complete checkpoint")
        raise
    finally:
        close_run_log(p.out)
        lock.release()
        if created and os.listdir(p.out) == [identity.LOCK_FILE]:   # failed before writing
            os.remove(os.path.join(p.out, identity.LOCK_FILE))
            os.rmdir(p.out)
        free_run_memory()           # the run's model and graphs, before the process goes on


def lock_folder(out, command) -> identity.FolderLock:
    """``out``'s lock, held (one writer per folder), or one ``ERROR:`` line: another writer holds
    it, or the folder cannot be written (a file, not writable, a read-only file system)."""
    if os.path.exists(out) and not os.path.isdir(out):
        _fail(f"cannot write the output folder {out} (--output_folder): it is a file")
    lock = identity.FolderLock(out)
    try:
        return lock.acquire(command)
    except identity.LockedError as e:
        _fail(str(e))
    except OSError as e:      # not writable, a file in the way, a read-only file system
        _fail(f"cannot write the output folder {out} (--output_folder): "
              f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}")


def _skip(out, resolved=None):
    """The finished run's summary, said skipped; a label asked for (``--method_tag``,
    ``--stream_name``: not part of the settings) other than the run's is said kept."""
    summary = read_summary(out)
    kept = [f"{what} '{had}' (not --{key}={want})"
            for key, what, had in (("method_tag", "method", summary.method),
                                   ("stream_name", "stream", summary.stream))
            for want in [(resolved or {}).get(key)] if isinstance(want, str) and want
            and want != had]
    note = (f"; it stays labelled {' and '.join(kept)}: a finished run is not relabelled "
            f"(--overwrite decodes it again)") if kept else ""
    print(f"{out}: finished with the same settings (WER {percent(summary.wer)}), skipping{note}")
    return summary


def _refuse(out, diffs, status="differs"):
    if status == "damaged":
        _fail(f"{diffs[0]}; to decode this run again there, add --overwrite (it deletes the "
              f"folder's records first)")
    if any(d.startswith("audio_sha1:") for d in diffs):
        diffs = [d + (" (the audio files the stream names changed since that run: mixed again "
                      "or replaced)" if d.startswith("audio_sha1:") and " != " in d else "")
                 for d in diffs]
    _fail(f"{out} holds a run with other settings ({'; '.join(diffs)}); use another "
          f"--output_folder, or add --overwrite to delete its records and start over")


def prepare(p: Plan) -> str:
    """The folder's status again, now that the lock is held (``done``: skip it; a ``differs``
    without ``--overwrite`` stops here), and the process-wide settings of a run on its device."""
    status, diffs = folder_status(p.out, p.fingerprint)
    if status == "done":
        return status
    if status == "resume" and diffs:        # a damaged file that the checkpoint makes good:
        with HeldLogs() as said:            # said once its log.txt is there (open_folder)
            logger.warning("%s", diffs[0])
        p.notes.extend(said.records)
    if status in ("differs", "damaged") and not p.args.overwrite:
        _refuse(p.out, identity.explain_missing_audio(diffs, p.rows), status)
    bound_kernel_caches()                                          # before the first forward
    p.determinism = process_settings(p.resolved.get("device"),
                                     p.resolved.get("deterministic", True),
                                     p.resolved.get("tf32", "torch"))
    return status


class HeldLogs(logging.Handler):
    """What a run logs while its yaml is built (the model's loading, ...), before its log.txt
    exists: held (not written to the log of a run this process made before), then logged once
    the run's folder is made (:meth:`replay`), so it reaches its log.txt and the console. A build
    that fails logs them where the process logged before (stderr's warnings, as before)."""

    def __init__(self):
        super().__init__()
        self.records, self._level, self._handlers = [], None, []

    def __enter__(self):
        root = logging.getLogger()
        self._level, self._handlers = root.level, root.handlers[:]
        for h in self._handlers:
            root.removeHandler(h)
        root.setLevel(min(root.getEffectiveLevel(), logging.INFO))
        root.addHandler(self)
        return self

    def __exit__(self, kind, *_):
        root = logging.getLogger()
        root.removeHandler(self)
        for h in self._handlers:
            root.addHandler(h)
        root.setLevel(self._level)
        if kind is not None:                    # no folder will take them
            self.replay()

    def emit(self, record):
        self.records.append(record)

    def replay(self):
        records, self.records = self.records, []
        self.handle_all(records)

    @staticmethod
    def handle_all(records):
        for r in records:
            logging.getLogger(r.name).handle(r)


def open_folder(p: Plan, argv, status: str, hparams, held: "HeldLogs" = None
                ) -> "sb.utils.checkpoints.Checkpointer":
    """Make ``p.out`` this run's folder (``--overwrite`` clears another run's records first): the
    fingerprint, the experiment directory (log.txt, env.log), hyperparams.yaml, the logged seed,
    device and versions, the method's description, stream.csv; the run's checkpointer.
    ``hparams``: the built yaml (``method`` may be a stand-in with ``describe()``); ``held``: what
    was logged while it was built."""
    if status in ("differs", "damaged"):     # --overwrite, once the new run is known to build
        removed = clear_run(p.out)
        print(f"{p.out}: --overwrite: removed {', '.join(removed) or 'nothing'}")
    identity.write_fingerprint(p.out, p.fingerprint)     # the folder is this run's from now on
    seed = hparams.get("seed")
    unseeded = seed is None
    if unseeded:
        seed = 0
        sb.utils.seed_everything(seed)
    out = p.out
    sb.create_experiment_directory(experiment_directory=out, save_env_desc=False)
    HeldLogs.handle_all(p.notes)
    if held is not None:
        held.replay()
    if unseeded:                        # (said once its log.txt is there)
        logger.warning("%s has no 'seed'; seeded with 0", p.hp.path)
    env_log = os.path.join(out, "env.log")
    resumed = status == "resume" and os.path.isfile(env_log)    # each start's environment kept:
    with open(env_log, "a" if resumed else "w", encoding="utf-8") as f:   # a resume wrote over
        if resumed:                                                    # the first process's
            f.write("\n==============================\nresumed: the environment of this start\n"
                    "==============================\n")
        f.write(installed_packages())          # what SpeechBrain writes there, asked once
    with open(os.path.join(out, "hyperparams.yaml"), "w", encoding="utf-8") as f:
        f.write(p.hp.record)
    _log_run(out, argv, seed, describe_device(p.resolved.get("device", "cpu")), p.determinism,
             p.fingerprint.get("hparams", {}).get("source"))
    logger.info("%s", hparams["method"].describe())
    if not os.path.exists(os.path.join(out, "stream.csv")):
        shutil.copyfile(p.stream_csv, os.path.join(out, "stream.csv"))
    return sb.utils.checkpoints.Checkpointer(os.path.join(out, "save"))


def build(p: Plan):
    """The run's yaml built; what its components show while they load (KenLM's reading bar)
    follows ``--noprogressbar``."""
    with progress_hidden(bool(p.args.run_opts.get("noprogressbar"))):
        return p.hp.build()


def _run(p: Plan, argv):
    status = prepare(p)
    if status == "done":
        return _skip(p.out, p.resolved)
    try:
        with HeldLogs() as held:
            hparams = build(p)
    except hp_files.HparamsError as e:
        _fail(str(e))
    checkpointer = open_folder(p, argv, status, hparams, held)
    # the run's one precision (the method's passes); SpeechBrain would log its eval default
    run_opts = dict(p.args.run_opts, eval_precision=hparams.get("precision", "fp32"))
    brain = TTABrain(modules={"model": hparams["model"]}, hparams=hparams,
                     run_opts=run_opts, checkpointer=checkpointer,
                     fingerprint=p.fingerprint, record_hparams=p.record)
    try:
        summary = brain.evaluate(p.stream_csv, rows=p.rows)
    except (ManifestError, ResumeError, RecordError) as e:
        _fail_logged(str(e))
    print(summary_line(summary))
    return summary


def summary_line(summary) -> str:
    """The line a finished run prints."""
    return (f"{summary.method} | {summary.stream} | WER {percent(summary.wer)}, CER "
            f"{percent(summary.cer)} | {summary.n_utts} utts, "
            f"{summary.n_skipped} skipped, {len(summary.resets)} resets | "
            f"{summary.time_per_audio_s:.3f} s per audio s")


if __name__ == "__main__":
    main()
