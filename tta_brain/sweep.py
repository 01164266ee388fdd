"""A batched sweep: R decode runs over the same stream that differ only in settings, in one
process, as R adapted states over one shared model (``tta_brain.methods.batched``).

    python -m tta_brain.sweep <decode arguments> -- <decode arguments> [-- ...]

Each run writes its own ordinary run folder, as ``python -m tta_brain.decode`` with the same
arguments would: the same fingerprint, hyperparams.yaml, log.txt, records, checkpoints and summary
(each through its own ``TTABrain``, driven row by row in lock-step; the stream is read once; a
run's own log records, such as its reset policy's, go to its log.txt alone).
Supported: ``suta``, ``csuta``, ``dsuta``, ``tent``, ``eata``, ``sar``, ``cotta``, ``cea``,
``sdpl``, ``sgem`` and ``awmc`` (any
reset policy: none, fixed, oracle, dynamic) in fp32; the runs may differ in :data:`MAY_DIFFER` (lr,
steps, em_coef, temperature, the reset policy and its settings, lr multipliers, seed: CoTTA's
draws; DSUTA's buffer size, slow lr and fast moments; EATA's margins, EMA and Fisher weight; SAR's
rho, E0, loss EMA and recovery constant; CoTTA's EMA, anchor threshold, augmentation and restore;
CEA's second stage; SGEM's lr_min, Renyi alpha, negative sampling, beam width and LM
weights; AWMC's leader EMA). A method's ``train_mode`` is batched only on a model whose train mode
draws nothing (no dropout, LayerDrop, SpecAugment or batch norm: ``HFCTCLobe.train_draws``).
The backprop-free ``lame``, ``t3a``, ``foa`` and ``ebats`` run as one batch too
(``tta_brain.methods.batched_free``: one prefix, the runs' CMA-ES candidates in one forward, the
dynamic resets' LII losses from that prefix);
their runs may differ in their search and fitness settings (the CMA-ES seed, population, sigma,
generations and early stop, the loss weights, T-EMA and covariance ratio; FOA's shift; LAME's
graph; T3A's filter). Anything else (another method, another
stream, source model, device or precision, any other key that differs) is refused with one line
naming the run and the option (:class:`Refused`) before a folder is written; the grid then runs
those runs separately.

Rerunning: finished runs are skipped; each unfinished run resumes from its own last checkpoint
(the sweep starts at the earliest cursor, a run joins when the stream reaches its own), so a
killed sweep goes on as its runs would alone. A folder started by the sweep can be resumed by a
separate ``tta_brain.decode`` and the other way round (the checkpoint's format is the method's).
"""
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

from tta_brain import decode
from tta_brain.data.manifest import ManifestError
from tta_brain.lobes.runtime import free_run_memory
from tta_brain.methods.batched import POLICIES, BatchedSUTA
from tta_brain.methods.batched_cea import BatchedCEA
from tta_brain.methods.batched_cotta import BatchedCoTTA
from tta_brain.methods.batched_dsuta import BatchedDSUTA
from tta_brain.methods.batched_eata import BatchedEATA
from tta_brain.methods.batched_free import BatchedFree
from tta_brain.methods.batched_pseudo import BatchedAWMC, BatchedSDPL, BatchedSGEM
from tta_brain.methods.batched_sar import BatchedSAR
from tta_brain.run import identity
from tta_brain.run.brain import PREFETCH, TTABrain
from tta_brain.run.checkpoint import ResumeError
from tta_brain.run.records import RecordError

logger = logging.getLogger("tta_brain.sweep")      # one name, imported or run with -m

__all__ = ["Refused", "refusal", "run", "batch_for", "MAY_DIFFER", "METHODS"]

#: The batches, the batched methods (packaged yaml names) and the keys in which the runs of a
#: batch may differ.
BATCHES = (BatchedSUTA, BatchedDSUTA, BatchedEATA, BatchedSAR, BatchedCoTTA, BatchedCEA,
           BatchedSDPL, BatchedSGEM, BatchedAWMC, BatchedFree)
METHODS = tuple(c.name for b in BATCHES for c in b.methods)
MAY_DIFFER = ("lr", "steps", "em_coef", "temperature", "reset", "reset_every", "seed",
              "layernorm_lr_mult", "cnn_lr_mult", "reset_K", "reset_patience", "reset_threshold",
              "reset_lii_count", "buffer_size", "slow_lr", "fast_moments", "e_margin_factor",
              "d_margin", "probs_ema", "fisher_alpha", "rho", "loss_ema", "reset_constant",
              "ema_decay", "ap_threshold", "n_augment", "noise_min", "noise_max", "noise_p",
              "restore_prob", "restore_mask", "steps2", "lr2", "tc_coef",
              "lr_min", "renyi_alpha", "ns_coef", "ns_threshold", "beam_width", "lm_weight",
              "word_bonus",
              # the backprop-free methods' search and fitness (not n_prompts: the candidates' size)
              "cma_seed", "popsize", "sigma", "generations", "early_stop_threshold", "patience",
              "entropy_coef", "stats_coef", "tokenwise", "loss_max", "cov_ratio", "fitness_coef",
              "disc_div", "shift_coef", "hist_decay", "knn", "bound_lambda", "max_steps", "tol",
              "blank_threshold", "filter_K"
              ) + identity.LOCATION_KEYS + identity.LABEL_KEYS


class Refused(ValueError):
    """These runs cannot be one batch; the message is one line naming the run and the option."""


def _method_name(p) -> str:
    node = p.resolved.get("method")
    try:
        return str(node["name"])
    except (TypeError, KeyError):
        return "?"


def refusal(plans) -> Optional[str]:
    """Why the planned runs (``decode.plan``) cannot run as one batch (None: they can), from
    their resolved yamls alone (the built methods are checked again)."""
    first = plans[0]
    for i, p in enumerate(plans):
        who = f"run {i + 1} ({p.out})"
        name, v = _method_name(p), p.resolved
        if name not in METHODS:
            return f"{who}: method {name} is not batched (batched: {', '.join(METHODS)})"
        if str(v.get("reset", "none")) not in [c.name for c in POLICIES]:
            return (f"{who}: reset {v.get('reset')} is not batched "
                    f"({', '.join(c.name for c in POLICIES)})")
        if str(v.get("slow_grad", "reuse")) != "reuse":
            return f"{who}: slow_grad {v.get('slow_grad')} is not batched (reuse only)"
        if str(v.get("precision", "fp32")) != "fp32" or v.get("compile"):
            return f"{who}: precision {v.get('precision')} / compile {v.get('compile')} (fp32 only)"
        if str(v.get("param_collection", "clean")) != "clean":
            return f"{who}: param_collection {v.get('param_collection')} (clean only)"
        if p.hp.path != first.hp.path:
            return f"{who}: yaml {p.hp.path} != run 1's {first.hp.path}"
        if p.rows != first.rows or p.fingerprint["stream_sha1"] != first.fingerprint["stream_sha1"]:
            roots = [str(q.resolved.get("data_root") or "") for q in (p, first)]
            on = f", --data_root {roots[0]} vs {roots[1]}" if roots[0] != roots[1] else ""
            return f"{who}: another stream than run 1's ({p.stream_csv} vs {first.stream_csv}{on})"
        sa, sb = (q.fingerprint.get("structure") or {} for q in (first, p))
        nested = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
        if nested:                  # one model, one parameter selection, one optimiser class
            return (f"{who}: the yaml's {', '.join(nested)} differ{'s' if len(nested) == 1 else ''}"
                    f" from run 1's (a batch's runs differ in plain options only)")
        a, b = first.fingerprint["hparams"], p.fingerprint["hparams"]
        for key in sorted(set(a) | set(b)):
            if key not in MAY_DIFFER and a.get(key) != b.get(key):
                gone = next(((w, str(x)[len("missing:"):]) for w, x in
                             ((who, b.get(key)), (f"run 1 ({first.out})", a.get(key)))
                             if str(x).startswith("missing:")), None)     # cache.file_identity
                if gone:
                    return f"{gone[0]}: {key}: file not found: {gone[1]}"
                return (f"{who}: option {key} differs from run 1's ({b.get(key)!r} != "
                        f"{a.get(key)!r}; a batch of {name} may differ in "
                        f"{', '.join(may_differ(a))})")
    return None


def may_differ(hparams) -> List[str]:
    """The keys of a run's recorded hparams in which the runs of its batch may differ (not the
    location and label keys, which never make two runs different)."""
    return [k for k in MAY_DIFFER if k in hparams
            and k not in identity.LOCATION_KEYS + identity.LABEL_KEYS]


def batch_for(method):
    """The batch class that runs ``method``'s kind (``BatchedSUTA`` for one it refuses, which
    then says why)."""
    return next((b for b in BATCHES if type(method) in b.methods), BatchedSUTA)


class _RunLogs:
    """One log.txt per run in one process: a record goes to the run being served (and records of
    the batch's own work, outside any run or from another thread than the runs' (the stream's
    read-ahead, one for all runs), to every run's log)."""

    def __init__(self, folders):
        root = logging.getLogger()
        for h in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
            root.removeHandler(h)                   # the last folder's, from its set-up
            h.close()
        self.current: Optional[int] = None
        self.thread = threading.get_ident()     # the runs' thread (records of others: all runs)
        self.failed: Optional[int] = None       # the run being served when an error arose
        self.handlers = []
        fmt = logging.Formatter("%(asctime)s - %(name)s - %(levelname)s - %(message)s")
        for i, folder in enumerate(folders):
            h = logging.FileHandler(os.path.join(folder, "log.txt"), encoding="utf-8")
            h.setFormatter(fmt)
            h.addFilter(lambda rec, i=i: self.current in (None, i) or rec.thread != self.thread)
            root.addHandler(h)
            self.handlers.append(h)

    @contextmanager
    def run(self, i: int):
        self.current = i
        try:
            yield
        except BaseException:
            self.failed = i
            raise
        finally:
            self.current = None

    def close(self):
        root = logging.getLogger()
        for h in self.handlers:
            root.removeHandler(h)
            h.close()


def run(argvs: List[List[str]]):
    """Run the decodes ``argvs`` (``tta_brain.decode`` arguments) as one batch; their summaries
    (None for a run skipped as finished). Raises :class:`Refused` before writing anything when
    they cannot be batched; ``SystemExit`` (one ``ERROR:`` line) as decode does."""
    plans = []
    for i, a in enumerate(argvs):          # which run of the batch a bad value is in
        try:
            plans.append(decode.plan(a))
        except SystemExit as e:
            out = next((x.partition("=")[2] for x in reversed(a)
                        if x.startswith("--output_folder=")), None)
            raise SystemExit(f"ERROR: run {i + 1}{f' ({out})' if out else ''}: "
                             f"{str(e).removeprefix('ERROR: ')}") from None
    for p in plans:
        if p.status == "help":
            raise Refused("--help is not a run")
        if p.status in ("differs", "damaged") and not p.args.overwrite:
            decode._refuse(p.out, p.diffs, p.status)
    todo = [(p, a) for p, a in zip(plans, argvs) if p.status != "done"]
    for p in plans:
        if p.status == "done":
            decode._skip(p.out, p.resolved)
    if not todo:
        return [None] * len(plans)
    why = refusal([p for p, _ in todo])
    if why:
        raise Refused(why)
    for j, (p, _) in enumerate(todo):      # two folders are allowed: said, not refused
        same = next((q for q, _ in todo[:j] if q.fingerprint == p.fingerprint), None)
        if same is not None:
            logger.warning("%s has the same settings as %s: the same run, decoded twice",
                           p.out, same.out)
    outs = [os.path.realpath(p.out) for p, _ in todo]      # a/ and a//. are a too
    if len(set(outs)) != len(outs):
        raise Refused("two runs of the batch write the same --output_folder")
    locks, created = [], [not os.path.exists(p.out) for p, _ in todo]
    try:
        for p, a in todo:
            locks.append(decode.lock_folder(p.out, "python -m tta_brain.sweep: python -m "
                                            "tta_brain.decode " + " ".join(a)))
        summaries = _run(todo, [1 + next(i for i, q in enumerate(plans) if q is p)
                                for p, _ in todo], len(plans))
    finally:
        for lock in locks:
            lock.release()
        for (p, _), new in zip(todo, created):
            if new and os.path.isdir(p.out) and os.listdir(p.out) == [identity.LOCK_FILE]:
                os.remove(os.path.join(p.out, identity.LOCK_FILE))
                os.rmdir(p.out)
        free_run_memory()          # the R runs' states, before a fallback decodes them one by one
    done = iter(summaries)
    return [None if p.status == "done" else next(done) for p in plans]


def _run(todo, numbers, total):
    """``numbers``: each run's number among the ``total`` of the sweep's command (an error names
    its run so, the runs already finished counted)."""
    statuses = [decode.prepare(p) for p, _ in todo]
    if "done" in statuses:                  # finished meanwhile by another process
        raise Refused("a run of the batch was finished by another process meanwhile; rerun")
    built, held = [], []
    for (p, _), n in zip(todo, numbers):    # each run's own yaml; its own model is dropped
        try:
            with decode.HeldLogs() as logs:
                hparams = decode.build(p)
        except decode.hp_files.HparamsError as e:   # what only its constructor checks
            decode._fail(f"run {n} ({p.out}): {e}")
        built.append(hparams)
        held.append(logs)
        if len(built) > 1:          # only its settings are read: its weights go at once
            hparams["model"].to("meta")
            hparams["model"] = built[0]["model"]
    methods = [h["method"] for h in built]
    try:
        batch = batch_for(methods[0])(built[0]["model"], methods)
    except ValueError as e:
        raise Refused(str(e)) from None
    brains = []
    for r, ((p, argv), status, hparams) in enumerate(zip(todo, statuses, built)):
        hparams["method"] = batch.views[r]
        ckpt = decode.open_folder(p, argv, status, hparams, held[r])
        brains.append(TTABrain(modules={"model": batch.lobe}, hparams=hparams,
                               run_opts=p.args.run_opts, checkpointer=ckpt,
                               fingerprint=p.fingerprint, record_hparams=p.record))
    del built
    logs = _RunLogs([p.out for p, _ in todo])
    logger.info("Batched sweep of %d runs over one model (%s)", len(brains),
                ", ".join(p.out for p, _ in todo))
    try:
        return _walk(brains, [p for p, _ in todo], logs, numbers, total)
    except (ManifestError, ResumeError, RecordError) as e:
        if logs.failed is None:                 # the batch's own: every run's log
            decode._fail_logged(str(e))
        with logs.run(logs.failed):             # one run's (it names that run's files)
            decode.log_to_files(str(e))
        decode._fail(f"{e}{_which(numbers[logs.failed], total)}")
    except BaseException as e:  # a crash's traceback in the log.txt of the run it arose in (all
        if not isinstance(e, SystemExit):   # runs' outside one), before the handlers close
            with logs.run(logs.failed):
                decode.log_to_files("Exception:", sys.exc_info())
        if isinstance(e, OSError) and e.errno in decode.NO_ROOM:
            run = "" if logs.failed is None else _which(numbers[logs.failed], total)
            decode._fail(f"{e.strerror}{f' ({e.filename})' if e.filename else ''}{run}: the "
                         f"sweep stopped; once there is room, the same command resumes its runs "
                         f"from their last complete checkpoints")
        raise
    finally:
        logs.close()


def _walk(brains, plans, logs, numbers, total):
    """The stream once, each row for the runs whose cursor is there, in lock-step. ``plans``:
    the runs' own (a run's stream is its own ``--stream_csv``, the same rows: its default
    ``stream_name`` is its manifest's name, as its separate run's); ``numbers``, ``total``:
    the runs' numbers in the sweep's command, for an error's message."""
    cursors = []
    for i, (b, p) in enumerate(zip(brains, plans)):
        with logs.run(i):
            cursors.append(b.start_stream(p.stream_csv, rows=p.rows, progressbar=False))
    batch = brains[0].method.batch
    batch.serving = logs.run            # a run's own records (its resets, skips) to its log alone
    utts = brains[0].stream_loader.prefetch(min(cursors), PREFETCH)
    try:
        for utt in utts:
            active = [i for i, b in enumerate(brains) if b.state.cursor == utt.index]
            if utt.reason is None and active:
                t0 = time.perf_counter()
                batch.process(active, utt.wav, _info(utt))
                share = (time.perf_counter() - t0) / len(active)
                for i in active:
                    brains[i].state.wall_time += share
            for i in active:
                with logs.run(i):
                    brains[i].decode_row(utt)
        for i, b in enumerate(brains):
            with logs.run(i):
                b.end_stream()
        if batch.graphs is not None:
            logger.info("Batched steps as CUDA graphs: %s", batch.graphs.describe())
        if hasattr(batch, "work"):
            logger.info("Batched backprop-free runs: %s", batch.work())
    finally:
        utts.close()
        for b in brains:
            b.close_stream()
    summaries, failed = [], []
    for i, b in enumerate(brains):
        with logs.run(i):
            try:
                summaries.append(b.stream_summary())
            except (ManifestError, RecordError) as e:     # in this run's log, naming its files
                decode.log_to_files(str(e))
                failed.append((i, str(e)))
                continue
        print(decode.summary_line(summaries[-1]), flush=True)
    if failed:
        (i, first), more = failed[0], len(failed) - 1
        decode._fail(first + _which(numbers[i], total, more))
    return summaries


def _which(number: int, total: int, more: int = 0) -> str:
    """Which run of the sweep's ``total`` an error is of, numbered as in its command (and how
    many more stopped alike)."""
    if total == 1:
        return ""
    alike = f"; {more} more stopped alike, each said in its own log.txt" if more else ""
    return f" (run {number} of {total}{alike})"


def _info(utt):
    from tta_brain.methods.events import UttInfo
    return UttInfo(id=utt.id, position=utt.position, domain=utt.domain, segment=utt.segment)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    groups, cur = [], []
    for a in argv + ["--"]:
        if a == "--":
            groups.append(cur)
            cur = []
        else:
            cur.append(a)
    if [a for a in argv if a != "--"] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    usage = ("usage: python -m tta_brain.sweep <decode args> -- <decode args> ... (--help: what "
             "a sweep does; <method> --help: the method's options)")
    if not any(groups):
        raise SystemExit(usage)
    empty = [i + 1 for i, g in enumerate(groups) if not g]
    if empty:                       # a stray separator may hide a run the user meant to give
        raise SystemExit(f"ERROR: run {empty[0]} of {len(groups)} is empty ('--' twice in a "
                         f"row, or at an end); give each run's arguments between two '--'")
    asked = [g for g in groups if "-h" in g or "--help" in g]
    if asked:                       # a run's arguments are decode's: its help for that method
        decode.main(asked[0])
        return 0
    try:
        run(groups)
    except Refused as e:
        raise SystemExit(f"ERROR: not batched: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
