"""Grids of decodes as jobs: every (stream, method token, seed, sweep point) of a recipe stage is one
``tta_brain.decode`` run in its own folder, submitted through submitit to local worker processes
(``--engine local``, the default) or to Slurm (``--engine slurm``).

    python -m tta_brain.grid --exp_dir exp/snr20 --source MODEL --data_root data \\
        --streams data/snr20/streams/md_hard.csv [NAME=CSV ...] --methods "suta dsuta+dynamic" \\
        --seeds "0 1 2" [--conf_dir conf] [--md_streams "md_hard"] [--decode_opts="--lr=1e-4"] \\
        [--sweep "lr=1e-4,3e-4"] [--engine local|slurm] [--nj N] [--gpus "0 1"] [--per_gpu 2]

The runs, their folders (``<exp_dir>/<stream>/<token>[_<tag>]/seed<seed>``, the tag naming the
``--decode_opts`` / ``--sweep`` values: ESPnet's inference_tag) and their overrides are planned by
:mod:`tta_brain.run.grid_plan`.

Runs whose folder holds a finished run with the same fingerprint are skipped before anything is
submitted (``tta_brain.decode`` decides the same way), so rerunning a grid is idempotent; a failed
run does not stop the others; the grid ends with the failed runs, their logs and exit status 1.
"""
import argparse
import contextlib
import inspect
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import submitit

from tta_brain.run import identity
from tta_brain.run.grid_plan import Run, plan_runs

logger = logging.getLogger("tta_brain.grid")

#: Runs of at least this many stream rows are long: the progress line says how far each running
#: one is and estimates the time to the end; it is then printed at least every PROGRESS_EVERY s.
LONG_RUN = 1000
PROGRESS_EVERY = 60.0


class DecodeJob(submitit.helpers.Checkpointable):
    """One decode in a job process. Preempted or timed out (Slurm), it is requeued with the same
    arguments and resumes from the run's last checkpoint."""

    def __init__(self, argv: List[str], threads: int = 0, local: bool = False):
        self.argv, self.threads, self.local = list(argv), int(threads), bool(local)

    def setup(self) -> None:
        """The job process's threads; a local job also stops on SIGTERM as on Ctrl-C (submitit
        bypasses SIGTERM, Slurm's preemption warning, which a local job never gets): the grid
        stops its local jobs with it, as submitit's cancel (SIGINT) reaches none (the grid
        starts them with SIGINT ignored: :func:`_sigint_ignored`)."""
        if self.local:
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        if self.threads:
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
            import torch
            torch.set_num_threads(self.threads)

    def __call__(self):
        self.setup()
        from tta_brain import decode
        try:
            summary = decode.main(self.argv)
        except SystemExit as e:          # decode's one-line errors: a failed job, not a crash
            raise _failed(e) from None
        return None if summary is None else {"wer": summary.wer, "n_utts": summary.n_utts}


def _failed(e: SystemExit) -> BaseException:
    """What a job raises for a ``SystemExit`` in it: decode's one-line error (a text) as a
    failure; any other exit as it is: submitit's ``sys.exit(-1)`` after it requeued the job on
    Slurm's USR2 (preemption, the time limit near) must leave the process without a result, or
    the grid reads the requeued job as failed (``RuntimeError: -1``) while it goes on."""
    return RuntimeError(str(e)) if isinstance(e.code, str) else e


class SweepJob(DecodeJob):
    """Several decodes of one stream as one batched sweep (``tta_brain.sweep``) in a job
    process; when the sweep refuses them, or fails on its way (out of memory with R states, an
    operation the batched pass cannot run), they run one after another (logged), each resuming
    from its own last checkpoint. Returns one ``None`` (done) or error line per run."""

    def __init__(self, argvs: List[List[str]], threads: int = 0, local: bool = False):
        super().__init__([], threads, local)
        self.argvs = [list(a) for a in argvs]

    def __call__(self):
        self.setup()
        from tta_brain import decode
        from tta_brain import sweep
        from tta_brain.lobes.runtime import free_run_memory
        try:
            sweep.run(self.argvs)
            return [None] * len(self.argvs)
        except sweep.Refused as e:
            print(f"grid: not batched ({e}); the {len(self.argvs)} runs run one after another",
                  flush=True)
        except SystemExit as e:
            raise _failed(e) from None
        except Exception as e:          # noqa: BLE001 - e.g. out of memory with R states, a kernel
            why = (str(e).strip().splitlines() or [""])[0][:300]      # without a batching rule
            print(f"grid: the batched sweep failed ({type(e).__name__}: {why}); the "
                  f"{len(self.argvs)} runs run one after another, each from its own last "
                  f"checkpoint", flush=True)
        # the failed batch's states are free only now (the exception held its frames): collect
        # them before the runs decode one by one (after an out-of-memory error above all)
        free_run_memory()
        out = []
        for argv in self.argvs:
            try:
                decode.main(argv)
                out.append(None)
            except SystemExit as e:
                if not isinstance(e.code, str):     # requeued (see _failed): the job ends here
                    raise
                out.append(str(e))
        return out


#: In a run folder: the Slurm job a grid submitted for it (the job id, one line).
SUBMITTED_FILE = ".slurm_job"


def mark_submitted(folder: Path, job_id) -> None:
    """Remember in ``folder`` the Slurm job submitted for its run (a rerun of the grid while
    that job still waits in the queue must not submit the run again)."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / SUBMITTED_FILE).write_text(f"{job_id}\n")
    except OSError:          # (a folder this machine cannot write: the job's own check stays)
        pass


def submitted_job(folder: Path) -> Optional[str]:
    """The Slurm job :func:`mark_submitted` noted for ``folder``'s run (None: none)."""
    try:
        return (Path(folder) / SUBMITTED_FILE).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def check_done(runs: List[Run], device_here: bool = True, streams: Optional[dict] = None) -> None:
    """Mark runs finished with the same fingerprint as skipped, refused ones as failed, and
    those being written, or still queued on Slurm by an earlier grid, as busy
    (``device_here=False``: the runs decode on Slurm nodes, whose GPUs this machine, a login
    node, need not have; each run checks its device where it starts). ``streams``: the
    streams read so far (``decode.plan``'s), kept by a caller that checks runs one by one."""
    from tta_brain import decode
    queued = None                  # squeue's jobs, asked once (only if a run was submitted)
    streams = {} if streams is None else streams   # each stream read (and its audio digested)
                                                   # once, its rows shared
    for run in runs:
        try:
            p = decode.plan(run.argv, device_here=device_here, streams=streams)
        except SystemExit as e:
            run.status, run.message = "failed", run.said(str(e))
            continue
        run.plan = p
        who = p.status != "done" and identity.FolderLock(run.folder).busy()
        job = p.status != "done" and not who and submitted_job(run.folder)
        if job and queued is None:
            queued = slurm_listed() or set()
        if who:                  # another grid's worker (one killed with -9 goes on) or a decode
            run.status, run.message = "busy", f"being written by {who}"
        elif job and job in queued:    # an earlier grid's job, pending (it holds no lock yet)
            run.status, run.message = "busy", (f"queued on Slurm as job {job} by an earlier "
                                               f"grid (scancel {job} to run it here)")
        elif p.status == "done":
            run.status, run.message = "skipped", "finished with the same settings"
        elif p.status == "differs" and not p.args.overwrite:
            run.status = "failed"
            run.message = (f"holds a run with other settings ({'; '.join(p.diffs)}); use another "
                           f"--exp_dir or --decode_opts=--overwrite")
        elif p.status == "damaged" and not p.args.overwrite:
            run.status, run.message = "failed", (f"{p.diffs[0]}; to decode this run again "
                                                   f"there, add --decode_opts=--overwrite")


def _say_finished(run: Run, device_here: bool, streams: Optional[dict] = None) -> str:
    """A dry run's line on a run whose folder holds a finished run: the grid skips it (same
    settings: "skipped") or refuses it (other settings, a damaged folder: "failed"). Said only
    when its stream can be read (an earlier stage may write it: "queued"); nothing is written."""
    check_done([run], device_here=device_here, streams=streams)
    said = "skipped" if run.status == "skipped" else \
        "failed" if run.status == "failed" and run.plan is not None else "queued"
    if said == "skipped":
        print(f"grid: {run.name} is finished with the same settings: the grid skips it",
              flush=True)
    elif said == "failed":
        print(f"grid: {run.name} will not run: it {run.message}", flush=True)
    run.status, run.message, run.plan = "queued", "", None
    return said


def batches(runs: List[Run], size: int, check: bool = True) -> List[List[Run]]:
    """The queued runs as jobs, in the order they start: one run each (``size`` 1), or batches of
    at most ``size`` runs of one (method yaml, source, stream, data root), each one batched sweep
    (``--batch_runs``). A batch that ``tta_brain.sweep`` refuses is split into separate runs, with
    a logged line (``check=False``, a dry run's: the batches as asked, none refused yet)."""
    queued = [r for r in runs if r.status == "queued"]
    if size <= 1:
        return [[r] for r in queued]
    from tta_brain import decode
    from tta_brain import sweep
    units = []
    for chunk in chunks(queued, size):
        why = check and len(chunk) > 1 and sweep.refusal([r.plan or decode.plan(r.argv)
                                                          for r in chunk])
        if why:
            logger.info("--batch_runs: %s run separately: %s",
                        ", ".join(r.name for r in chunk), why)
            units += [[r] for r in chunk]
        else:
            units.append(chunk)
    return sorted(units, key=lambda u: queued.index(u[0]))


def chunks(runs: List[Run], size: int) -> List[List[Run]]:
    """``runs`` in groups of at most ``size`` of one (method yaml, source, stream, data root): the
    batches ``--batch_runs`` asks for, before ``tta_brain.sweep`` says whether each can be one."""
    where = ("--source=", "--stream_csv=", "--data_root=")
    groups = {}
    for r in runs:
        key = (r.argv[0],) + tuple(a for a in r.argv if a.startswith(where))
        groups.setdefault(key, []).append(r)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)]


def _slurm_constructor_keys() -> tuple:
    """``--slurm_conf`` keys that submitit takes when the executor is made, not as job parameters
    (``slurm_max_num_timeout``: requeues allowed per job; ``slurm_python``; ...)."""
    from submitit.slurm.slurm import SlurmExecutor
    return tuple(f"slurm_{n}" for n in inspect.signature(SlurmExecutor.__init__).parameters
                 if n not in ("self", "folder"))


def slurm_executor(args, folder, submit: bool = True) -> "submitit.AutoExecutor":
    """The Slurm executor of ``--slurm_conf``: its constructor keys to the executor, the rest
    (over the array parallelism) as job parameters, checked the way submitit checks them. A
    missing or malformed file, or a key or value submitit refuses, is one line naming the file
    (``SystemExit``); nothing is created before a job is submitted. ``submit=False`` (a dry run:
    the conf is checked, nothing submitted) also works on a machine without Slurm; otherwise a
    machine without ``srun`` is one line too."""
    import yaml
    params = {"slurm_array_parallelism": args.nj or 64}
    path, conf = args.slurm_conf, None
    if path:
        try:
            conf = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise SystemExit(f"ERROR: --slurm_conf {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise SystemExit(f"ERROR: --slurm_conf {path}: yaml syntax error: "
                             f"{' '.join(str(e).split())}") from None
        if conf is not None and not isinstance(conf, dict):
            raise SystemExit(f"ERROR: --slurm_conf {path}: expected key: value lines (submitit "
                             f"parameters), got a {type(conf).__name__}")
        params.update(conf or {})
    made = {k: params.pop(k) for k in _slurm_constructor_keys() if k in params}
    missing = [c for c in ("srun", "sbatch") if shutil.which(c) is None]
    if submit and missing:
        raise SystemExit(f"ERROR: --engine slurm: no `{missing[0]}` on this machine's PATH: submit "
                         f"from a Slurm login node (--dry_run checks --slurm_conf anywhere)")
    try:
        with _without_srun_check():
            ex = submitit.AutoExecutor(folder=folder, cluster="slurm", **made)
        ex.update_parameters(**params)
    except (NameError, AssertionError, TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SystemExit(f"ERROR: --slurm_conf {path or '(none)'}: {first} (keys: submitit's "
                         f"AutoExecutor parameters, e.g. slurm_partition, timeout_min, mem_gb, "
                         f"cpus_per_task, gpus_per_node, slurm_max_num_timeout)") from None
    _check_signal_time(ex._executor.parameters, path, conf if path else None)
    return ex


def slurm_minutes(value) -> Optional[float]:
    """A Slurm time limit in minutes: a number of minutes, or sbatch's forms ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS`` (None: not one of them; sbatch says)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\s*", str(value))
    if not m:
        return None
    days, a, b, c = (int(x) if x is not None else None for x in m.groups())
    if days is not None:                       # D-HH[:MM[:SS]]
        return days * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    if c is not None:                          # HH:MM:SS
        return a * 60 + b + c / 60
    if b is not None:                          # MM:SS
        return a + b / 60
    return float(a)                            # MM


def _check_signal_time(params: dict, path, conf=None) -> None:
    """Refuse a time limit that leaves no run time before Slurm's USR2. submitit asks for USR2
    ``signal_delay_s`` (default 90) before the limit (``time``, default 5 min), and Slurm may send
    it up to 60 s earlier than asked (sbatch(1), --signal): a job would be signalled as it starts,
    then requeued (a checkpointable run) or killed, again and again. The limit is read in any of
    sbatch's forms (``slurm_time: "00:01:00"`` was not checked); the message names the key the
    conf sets."""
    limit, delay = slurm_minutes(params.get("time", 5)), params.get("signal_delay_s", 90)
    if limit is None or not isinstance(delay, int):
        return
    if limit * 60 - delay <= 60:
        key = next((k for k in ("slurm_time", "timeout_min") if k in (conf or {})), "timeout_min")
        given = (conf or {}).get(key, 5)
        said = f"{given}" if isinstance(given, int) else f"{given!r} ({limit:g} min)"
        raise SystemExit(f"ERROR: --slurm_conf {path or '(none)'}: {key} {said} leaves "
                         f"{limit * 60 - delay:g} s before Slurm's USR2 (slurm_signal_delay_s "
                         f"{delay}), which Slurm may send up to 60 s early: raise {key} or "
                         f"lower slurm_signal_delay_s")


@contextlib.contextmanager
def _without_srun_check():
    """submitit's SlurmExecutor refuses to be built where ``srun`` is missing (its ``affinity``);
    :func:`slurm_executor` checks that itself when it will submit, so a dry run can check a conf
    on a machine without Slurm."""
    affinity = submitit.SlurmExecutor.__dict__["affinity"]
    submitit.SlurmExecutor.affinity = classmethod(lambda cls: 2)
    try:
        yield
    finally:
        submitit.SlurmExecutor.affinity = affinity


def slurm_gpus(ex) -> bool:
    """Whether the jobs of a Slurm executor ask for GPUs (gpus_per_node, slurm_gpus_per_task,
    slurm_num_gpus or a gpu slurm_gres): its runs then decode on CUDA."""
    p = ex._executor.parameters
    return any(int(p.get(k) or 0) > 0 for k in ("gpus_per_node", "gpus_per_task", "num_gpus")) \
        or "gpu" in str(p.get("gres") or "")


def _engine(args):
    folder = Path(args.exp_dir) / ".grid" / time.strftime("%Y%m%d-%H%M%S")
    try:                                # --exp_dir a file, or where one cannot write
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"ERROR: --exp_dir {args.exp_dir}: cannot create {folder}: "
                         f"{e.strerror or e}") from None
    if args.engine == "slurm":
        return slurm_executor(args, folder)
    ex = submitit.LocalExecutor(folder=folder)
    ex.update_parameters(timeout_min=60 * 24 * 365)
    return ex


def _slots(args) -> List[Optional[int]]:
    """The local workers' slots in the order runs take them: a GPU id each (``--per_gpu`` per
    GPU, GPU by GPU in turn: ``--nj`` below the slots leaves no GPU idle), or None (CPU)."""
    gpus = [int(g) for g in args.gpus.split()]
    if gpus:
        return [g for _ in range(args.per_gpu) for g in gpus][:args.nj or None]
    return [None] * (args.nj or max(1, (os.cpu_count() or 1)))


def _starts(waiting: list, free: list):
    """The jobs that start now on the local workers, each with its slot (a GPU id, or None): the
    next waiting job on the next free slot (both taken from their lists), while both are left;
    a finished job's slot goes to the end of ``free``."""
    while free and waiting:
        yield waiting.pop(0), free.pop(0)


def slot_plan(units: List[List[Run]], args) -> str:
    """The dry run's line of the ``--gpus`` slots: how many jobs at a time on which GPUs, and the
    GPU each of the first jobs starts on (:func:`_starts` over :func:`_slots`, as the grid starts
    them); the others take the slot that frees first."""
    slots = _slots(args)
    first = list(_starts(list(units), list(slots)))
    per = ", ".join(f"GPU {g}: {slots.count(g)}" for g in dict.fromkeys(slots))
    said = "; ".join(f"GPU {g}: " + (u[0].name if len(u) == 1 else
                                     f"batch of {len(u)} ({', '.join(r.name for r in u)})")
                     for u, g in first)
    rest = len(units) - len(first)
    return (f"DRY-RUN: --gpus {args.gpus} (--per_gpu {args.per_gpu}"
            + (f", --nj {args.nj}" if args.nj else "") + f"): {len(slots)} job(s) at a time ("
            f"{per}), each seeing its one GPU (CUDA_VISIBLE_DEVICES); the first start on {said}"
            + (f"; each of the other {rest} on the slot that frees first" if rest else ""))


def execute(runs: List[Run], args) -> None:
    """Submit the queued runs (one job per run, or per batch with ``--batch_runs``) and follow
    them to the end, printing the grid's progress."""
    units = batches(runs, getattr(args, "batch_runs", 1))
    if not units:
        return
    ex = _engine(args)
    jobs = {}

    def job(unit, threads=0):
        local = args.engine == "local"
        if len(unit) == 1:
            return DecodeJob(unit[0].argv, threads, local)
        return SweepJob([r.argv for r in unit], threads, local)

    if args.engine == "slurm":
        try:
            with ex.batch():
                for u in units:
                    jobs[id(u)] = (u, ex.submit(job(u)), None)
        except (submitit.core.utils.FailedJobError, OSError) as e:
            conf = args.slurm_conf or "(none)"
            raise SystemExit(f"ERROR: --engine slurm: sbatch did not take the {len(units)} "
                             f"job(s), nothing was submitted: {sbatch_error(e)} (check "
                             f"--slurm_conf {conf} and the cluster)") from None
        for u, j, _ in jobs.values():
            for r in u:
                r.status = "running"
                mark_submitted(r.folder, j.job_id)
    try:
        _follow(runs, units, args, ex, jobs, job)
    finally:
        if args.engine == "local":
            _stop_workers(jobs)
        else:
            _left_on_slurm(jobs)


def _left_on_slurm(jobs) -> None:
    """The grid ends early (Ctrl-C, SIGTERM, an error): its Slurm jobs go on (they checkpoint and
    a rerun of the grid skips or resumes their runs); say which, so they can be cancelled."""
    going = sorted(str(j.job_id) for u, j, _ in jobs.values()
                   if u[0].status == "running" and not j.done())
    if going:
        print(f"grid: stopped; its {len(going)} Slurm job(s) go on: {' '.join(going)} (scancel "
              f"them to stop them; rerun the same command once they have left squeue)", flush=True)


def sbatch_error(e: Exception) -> str:
    """The line of a failed submission that says why: sbatch's own ``error:`` / ``fatal:`` line
    (submitit wraps it in its command and output), else the exception's first line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if "sbatch: error" in ln or "sbatch: fatal" in ln]
    line = said[-1] if said else lines[0] if lines else type(e).__name__
    return line[line.index("sbatch:"):] if "sbatch:" in line else line[:300]


def _stop_workers(jobs) -> None:
    """Cancel the local jobs still running (the grid is ending early: Ctrl-C, SIGTERM, an
    error): without this they would go on decoding after the grid is gone. Each job's
    controller gets SIGTERM, which it forwards to its job (a local job stops on it: see
    :meth:`DecodeJob.setup`), then submitit's cancel (SIGINT: the controller stops its job, and
    kills it a second later), which a controller started with SIGINT ignored (all the grid's:
    :func:`_sigint_ignored`) does not hear. A cancelled run keeps its checkpoints: rerunning the
    grid resumes it."""
    running = [(u, j) for u, j, _ in jobs.values() if u[0].status == "running" and not j.done()]
    for u, j in running:
        with contextlib.suppress(OSError, AttributeError):      # ended meanwhile
            j._process.send_signal(signal.SIGTERM)
        j.cancel()
        for r in u:
            r.status, r.message = "failed", "cancelled: the grid was stopped"
    if running:
        print(f"grid: stopped; cancelled {sum(len(u) for u, _ in running)} running run(s) "
              "(rerun the same command to resume them)", flush=True)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while the grid starts a local job's controller, which inherits it: Ctrl-C
    (SIGINT to the terminal's whole process group) stops the grid alone, which cancels its jobs
    (:func:`_stop_workers`); each controller had also stopped on it, printing its
    KeyboardInterrupt traceback. A Ctrl-C within a start (a fork and exec, milliseconds) is
    ignored: press it again. (Blocking it instead of losing it does not hold: the kernel hands a
    signal the main thread blocks to another of the grid's threads, where it is ignored too.)
    Only the main thread may set a handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def local_threads(slots: int) -> int:
    """The CPU threads of each local worker: the user's ``OMP_NUM_THREADS`` where it is set (it
    was overridden: a grid's runs did not run as the user's decodes did), else this process's
    cores (its CPU affinity: a cgroup's or taskset's, not the machine's) divided among the
    ``slots`` workers."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):     # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, slots))


def _follow(runs, units, args, ex, jobs, job) -> None:
    free = _slots(args)
    threads = local_threads(len(free)) if args.engine == "local" else 0
    last, printed = None, 0.0
    asked, said = -PENDING_EVERY, ""              # Slurm's pending jobs: last asked, last said
    pending = set()                               # ... and their runs, as Slurm said last
    unlisted: Dict[int, int] = {}                 # Slurm jobs squeue no longer lists: times seen
    waiting = [u for u in units if args.engine == "local"]
    while True:
        for u, gpu in _starts(waiting, free):
            ex.update_parameters(visible_gpus=[gpu] if gpu is not None else [],
                                 gpus_per_node=1 if gpu is not None else 0)
            with _sigint_ignored():   # (a Ctrl-C after it finds the job known, to cancel it)
                jobs[id(u)] = (u, ex.submit(job(u, threads)), gpu)
                for r in u:
                    r.status = "running"
        for key, (u, j, gpu) in list(jobs.items()):
            if u[0].status == "running" and j.done():
                _collect(u, j)
                if args.engine == "local":
                    free.append(gpu)
        if args.engine == "slurm" and time.monotonic() - asked >= PENDING_EVERY:
            said, pending = _say_pending(jobs, said)
            _fail_unlisted(jobs, unlisted)
            asked = time.monotonic()
        line = _progress(runs, time.monotonic(), pending)
        head = line.split(" | ")[0]
        if head != last or (line != head and time.monotonic() - printed >= PROGRESS_EVERY):
            print(line, flush=True)
            last, printed = head, time.monotonic()
        if not any(r.status in ("queued", "running") for u in units for r in u):
            return
        time.sleep(args.poll)


#: Seconds between two questions to Slurm about the grid's pending jobs.
PENDING_EVERY = float(os.environ.get("TTA_GRID_PENDING_EVERY", 30.0))


def slurm_listed() -> Optional[set]:
    """The ids of this user's Slurm jobs that ``squeue`` lists (an array's tasks one each), in
    any state; None when squeue cannot tell."""
    import pwd                 # the process's own user ($USER may name another one)
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-u", pwd.getpwuid(os.getuid()).pw_name,
                              "-o", "%i"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return {ln.strip() for ln in out.stdout.splitlines() if ln.strip()}


def _fail_unlisted(jobs, unlisted: Dict[int, int]) -> None:
    """Jobs the grid waits for that squeue no longer lists and submitit has no result of, at two
    questions in a row: failed, naming the job (an array task cancelled while pending leaves no
    trace in squeue or sacct, and submitit's state stays UNKNOWN: the grid waited for ever)."""
    listed = slurm_listed()
    if listed is None:
        return
    for key, (u, j, _) in list(jobs.items()):
        if u[0].status != "running" or j.done() or str(j.job_id) in listed:
            unlisted.pop(key, None)
            continue
        unlisted[key] = unlisted.get(key, 0) + 1
        # sacct asked now (submitit's own view may be minutes old): a job that ended with a
        # state there (cancelled while running, killed, finished) is _collect's, with its state;
        # one sacct still calls pending or running (an array task cancelled while pending can
        # keep its array's PENDING record, or none) is gone: squeue has not listed it twice
        if unlisted[key] >= 2 and not j.done(force_check=True):
            for run in u:
                run.status = "failed"
                run.message = (f"Slurm job {j.job_id} left the queue without a result, and "
                               f"Slurm keeps no record of it (cancelled before it started?)")
                run.logs = [str(p) for p in (j.paths.stdout, j.paths.stderr,
                                             run.folder / "log.txt") if os.path.exists(p)]
#: Slurm's pending reasons that no wait resolves: the job asks what its partition cannot give.
NEVER_STARTS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                "QOSMaxCpuPerJobLimit", "QOSMaxMemoryPerJob", "QOSMaxGRESPerJob")


def slurm_pending(job_ids: List[str]) -> Dict[str, str]:
    """``{job id: Slurm's reason}`` of those of ``job_ids`` that are pending (``squeue``); empty
    when squeue cannot tell (it is a courtesy of the progress, not a state the grid acts on)."""
    if not job_ids:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "PD", "-o", "%i|%r", "-j",
                              ",".join(job_ids)], capture_output=True, text=True,
                             timeout=30).stdout      # -r: an array's tasks one a line
    except (OSError, subprocess.SubprocessError):
        return {}
    pairs = (ln.split("|", 1) for ln in out.splitlines() if "|" in ln)
    return {i.strip(): r.strip() for i, r in pairs if i.strip() in job_ids}


def pending_line(runs_of: Dict[str, List[Run]], reasons: Dict[str, str]) -> str:
    """One line on the grid's pending Slurm jobs ("" when none): those whose reason no wait
    resolves by run and job, said never to start (the progress said them "running" for ever);
    the others (waiting for resources, priority) counted by reason."""
    parts, waiting = [], {}
    for job_id, reason in sorted(reasons.items()):
        if reason in NEVER_STARTS:
            parts.append(f"{', '.join(r.name for r in runs_of[job_id])} (job {job_id}: {reason}; "
                         f"it will not start: its partition cannot give what --slurm_conf asks)")
        else:           # Slurm's "None": submitted, not looked at by its scheduler yet
            reason = "not scheduled yet" if reason in ("None", "") else reason
            waiting[reason] = waiting.get(reason, 0) + 1
    if waiting:
        parts.append(f"{sum(waiting.values())} job(s) waiting ("
                     + ", ".join(f"{r}: {n}" for r, n in sorted(waiting.items())) + ")")
    return f"grid: pending on Slurm: {'; '.join(parts)}" if parts else ""


def _say_pending(jobs, said: str):
    """Print the pending line when it changed; (that line, the names of the pending runs)."""
    runs_of = {str(j.job_id): u for u, j, _ in jobs.values() if u[0].status == "running"}
    reasons = slurm_pending(list(runs_of))
    line = pending_line(runs_of, reasons)
    if line and line != said:
        print(line, flush=True)
    return line, {r.name for job_id in reasons for r in runs_of[job_id]}


def _collect(unit: List[Run], job) -> None:
    for run in unit:      # the files there are (a run refused on its node wrote no log.txt)
        run.logs = [str(p) for p in (job.paths.stdout, job.paths.stderr, run.folder / "log.txt")
                    if os.path.exists(p)]
    try:
        result = job.result()
        errors = result if len(unit) > 1 else [None]
        for run, error in zip(unit, errors):
            run.status, run.message = ("failed", error) if error else ("done", run.message)
    except Exception as e:       # FailedJobError (with the job's stderr), UncompletedJobError
        line = failure_line(str(e), type(e).__name__,
                            local="local" in type(job).__module__.split("."))
        for run in unit:
            run.status = "failed"
            run.message = line[:300]


def failure_line(text: str, kind: str = "", local: bool = False) -> str:
    """The line of a failed job's exception that says why: decode's own ``ERROR:`` line; else,
    for a job that ended without a result (cancelled, killed by Slurm), its Slurm state (the
    line after it is submitit's "Error stream produced:" header; ``local``: a local worker
    process, whose state submitit reports as FINISHED however it died); else the last error
    line."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    own = [ln for ln in lines if "ERROR:" in ln]
    if own:                     # decode's own one-line error, without the job's wrapping
        return own[-1][own[-1].index("ERROR:"):]
    state = re.search(r"has not produced any output \(state: ([^)]*)\)", text)
    if state and local:
        return "the local worker process ended without a result (killed?)"
    if state:
        return f"the job ended without a result (Slurm state: {state.group(1)})"
    errors = [ln for ln in lines if "Error" in ln and ln.strip() != "Error stream produced:"]
    return errors[-1] if errors else lines[0] if lines else kind


def rate_since(seen: Optional[tuple], rows: int, now: float):
    """``(seen, rows per second)`` of a running run that has recorded ``rows`` rows at ``now``;
    ``seen`` = ``(baseline rows, baseline time, rows last seen)``. The baseline moves with the
    clock while the rows stay where they were (a job still queued or loading its model), so the
    rate counts working time only, and starts anew when the rows go back (a resume cuts the
    records back to its checkpoint); the rate is None until the rows have moved past it."""
    if seen is None or rows <= seen[0] or rows < seen[2]:
        return (rows, now, rows), None
    return (seen[0], seen[1], rows), (rows - seen[0]) / max(now - seen[1], 1e-9)


def fmt_duration(seconds: Optional[float]) -> str:
    """``1h05`` / ``12m`` / ``40s``; ``?`` for an unknown duration."""
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}"
    return f"{seconds // 60}m" if seconds >= 60 else f"{seconds}s"


def _progress(runs: List[Run], now: Optional[float] = None, pending=frozenset()) -> str:
    """The grid's one progress line; ``pending``: the names of submitted runs whose Slurm job
    has not started (as squeue said last), counted apart from the running ones."""
    n = {s: sum(r.status == s for r in runs) for s in ("done", "running", "failed", "queued",
                                                      "skipped", "busy")}
    waits = sum(r.status == "running" and r.name in pending for r in runs)
    line = (f"grid: {n['done']} done, {n['running'] - waits} running, "
            + (f"{waits} pending on Slurm, " if waits else "")
            + f"{n['failed']} failed, "
            f"{n['queued']} queued ({len(runs)} runs, {n['skipped']} already finished"
            + (f", {n['busy']} being written or queued by another process" if n["busy"] else "")
            + ")")
    running = [r for r in runs if r.status == "running" and r.name not in pending]
    if now is None or not any(r.total >= LONG_RUN for r in running):
        return line
    # long runs: how far each running one is, its time left, and the grid's (rows left over the
    # running runs' summed rate: an estimate that assumes the queued runs go as fast)
    from tta_brain.run.records import rows_done
    parts, left, speed = [], 0, 0.0
    for r in running:
        rows = min(rows_done(r.folder), r.total)
        r.seen, rate = rate_since(r.seen, rows, now)
        speed += rate or 0.0
        left += r.total - rows
        parts.append(f"{r.name} {rows}/{r.total} "
                     f"{fmt_duration((r.total - rows) / rate if rate else None)} left")
    left += sum(r.total for r in runs if r.status == "queued"
                or (r.status == "running" and r.name in pending))
    return f"{line} | {', '.join(parts)} | grid ETA {fmt_duration(left / speed if speed else None)}"


#: the grid's options whose values are option lists (their values start with ``--``)
OPTION_LISTS = ("--decode_opts", "--md_decode_opts", "--md_recipe_opts")


def option_list_hint(message, names=OPTION_LISTS):
    """argparse's ``message``, plus the ``=`` form where it read an option list ``names`` given
    after a space (``--decode_opts --lr=1e-4``) as two options (tools/bench_memory.py too)."""
    for name in names:
        if message == f"argument {name}: expected one argument":
            message += f"; a value that starts with '-' goes after '=': {name}=\"--lr=1e-4\""
    return message


class _OneLineParser(argparse.ArgumentParser):
    """An option error is one line (argparse printed its whole usage above it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {option_list_hint(message)} (see --help)\n")


def parse_args(argv=None):
    p = _OneLineParser(prog="python -m tta_brain.grid", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp_dir", required=True, type=os.path.expanduser,
                   help="results root of the grid")
    p.add_argument("--source", required=True, help="source model (local dir or hub name)")
    p.add_argument("--data_root", default="", help="replaces $data_root in the manifests")
    p.add_argument("--streams", nargs="+", action="extend", required=True,
                   help="stream manifests, CSV or NAME=CSV (given twice: both lists)")
    p.add_argument("--methods", required=True, help="method tokens, e.g. 'suta dsuta+dynamic', "
                   "or all (every packaged method)")
    p.add_argument("--seeds", default="0", help="seeds, e.g. '0 1 2'")
    p.add_argument("--hparams_dir", default="", help="own yamls (<token>.yaml or <method>.yaml)")
    p.add_argument("--conf_dir", default="", help="folder of <method>[_md].opts / <token>.opts")
    p.add_argument("--md_streams", default="", help="stream names that get the _md option set")
    p.add_argument("--md_decode_opts", default="", help="overrides for --md_streams only")
    p.add_argument("--md_recipe_opts", default="", help="the recipe's own settings for "
                   "--md_streams (before --md_decode_opts): a key a method lacks is not passed "
                   "to it, and none of the grid's methods needing it is no error")
    p.add_argument("--decode_opts", default="", help="overrides for every run (named in the tag)")
    p.add_argument("--sweep", nargs="*", action="extend", default=[],
                   help="key=v1,v2 ...: one run per combination (given twice: both axes)")
    p.add_argument("--engine", default="local", choices=("local", "slurm"))
    p.add_argument("--nj", type=int, default=0, help="runs at a time (local default: one per CPU "
                   "core, or --per_gpu per GPU; slurm: array parallelism)")
    p.add_argument("--gpus", default="", help="local: GPU ids, e.g. '0 1 2 3' or '0,1,2,3': the "
                   "runs decode on them (--device=cuda, one GPU visible to each run); on Slurm "
                   "ask for GPUs in --slurm_conf instead")
    p.add_argument("--per_gpu", type=int, default=2, help="local: runs per GPU")
    p.add_argument("--batch_runs", type=int, default=1, help="runs of one stream, method and "
                   "source that differ only in settings (suta, csuta, dsuta, tent, eata, sar, "
                   "cotta, cea, sdpl, sgem, awmc: lr, steps, em_coef, temperature, reset, seed, "
                   "...; lame, t3a, "
                   "foa, ebats: cma_seed, popsize, sigma, ...) as batched "
                   "sweeps of at most N runs, each one job (tta_brain.sweep); others run "
                   "separately (default 1: every run its job)")
    p.add_argument("--slurm_conf", default="", help="yaml of submitit Slurm parameters "
                   "(slurm_partition, timeout_min, mem_gb, cpus_per_task, gpus_per_node, ...)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between progress checks")
    p.add_argument("--dry_run", action="store_true", help="print the decode commands and stop")
    p.add_argument("--check", action="store_true", help="as --dry_run, printing only the runs "
                   "that would not run (exit 1 if any): a recipe asks before its data stages")
    args = p.parse_args(argv)
    for name in ("methods", "seeds"):         # an empty list is a grid of no runs, not a success
        if not getattr(args, name).split():
            p.error(f"--{name} {getattr(args, name)!r}: names no {name[:-1]}")
    if any(not s.isdigit() or int(s) >= 2 ** 32 for s in args.seeds.split()):
        p.error(f"--seeds {args.seeds!r}: seeds are integers from 0 to 4294967295, e.g. '0 1 2'")
    if any(not s.strip() for s in args.streams):
        p.error(f"--streams {' '.join(map(repr, args.streams))}: an empty stream name")
    for name in ("hparams_dir", "conf_dir"):    # else the packaged yamls / no recipe settings
        if getattr(args, name) and not os.path.isdir(getattr(args, name)):
            p.error(f"--{name} {getattr(args, name)}: no such folder")
    for name, low in (("nj", 0), ("per_gpu", 1), ("batch_runs", 1)):   # else no worker: a hang
        if getattr(args, name) < low:
            p.error(f"--{name} {getattr(args, name)}: must be an integer >= {low}")
    if not args.poll > 0:
        p.error(f"--poll {args.poll}: must be > 0 (seconds)")
    given, args.gpus = args.gpus, " ".join(args.gpus.replace(",", " ").split())   # '0,1' too
    if any(not g.isdigit() for g in args.gpus.split()):
        p.error(f"--gpus {given!r}: GPU ids are numbers, e.g. '0 1 2 3' or '0,1,2,3'")
    twice = sorted({g for g in args.gpus.split() if args.gpus.split().count(g) > 1})
    if twice:                                  # else 2 x --per_gpu runs shared that GPU
        p.error(f"--gpus {given!r}: GPU {twice[0]} given twice (runs per GPU: --per_gpu)")
    if args.slurm_conf and args.engine == "local":      # else the grid runs here, not on Slurm
        p.error(f"--slurm_conf {args.slurm_conf}: read by --engine slurm only (this grid would "
                "run on this machine); add --engine slurm, or leave --slurm_conf out")
    if args.gpus.split() and args.engine == "slurm":
        p.error("--gpus picks this machine's GPUs (--engine local); a Slurm job asks for its GPU "
                "in --slurm_conf (gpus_per_node: 1) and then decodes on it")
    return args


def yaml_method_problem(yaml: str) -> str:
    """Why a yaml's ``method: !apply:tta_brain.methods.build_method`` block cannot build (an
    option its registered method does not take: build_method's refusal, at the key's
    ``file:line``), read from the yaml alone (no model loaded); "" when none, or when only the
    build can tell (another builder, a method not registered yet: your module's)."""
    import ruamel.yaml
    from tta_brain import hparams, methods
    try:
        lines = hparams.composed_lines(hparams.find(yaml))
        node = ruamel.yaml.YAML().load("\n".join(t for t, _, _ in lines))
    except Exception:                  # (its own errors are each run's settings check's)
        return ""
    node = node.get("method") if isinstance(node, dict) else None
    tag = str(getattr(getattr(node, "tag", None), "value", None) or "")
    if not isinstance(node, dict) or tag.split(":", 1)[-1] not in (
            "tta_brain.methods.build_method", "tta_brain.methods.registry.build_method"):
        return ""
    keys = [k for k in node if k != "name"]
    said = methods.registry.unknown_options(str(node.get("name")), keys)
    if not said:
        return ""
    first = next(k for k in keys if methods.registry.unknown_options(str(node["name"]), [k]))
    _, file, line = lines[node.lc.key(first)[0]]
    return f"{file}:{line}: {said}"


def _terminate(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.check else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    # a mistyped --slurm_conf stops here; jobs that ask for GPUs decode on them
    cuda = args.engine == "slurm" and slurm_gpus(slurm_executor(
        args, Path(args.exp_dir) / ".grid", submit=not (args.dry_run or args.check)))
    if cuda:
        logging.getLogger("tta_brain.grid").info(
            "%s asks for GPUs: the runs decode on cuda (a slurm.yaml without GPUs for the CPU)",
            args.slurm_conf)
    from tta_brain import hparams
    try:
        runs = plan_runs(args, cuda=cuda)
    except hparams.HparamsError as e:     # an own yaml's include line (its keys are read here)
        raise SystemExit(f"ERROR: {e}") from None
    for yaml in dict.fromkeys(r.argv[0] for r in runs):   # once a yaml, not a failure per run
        why = yaml_method_problem(yaml)
        if why:
            raise SystemExit(f"ERROR: {why} (every run of it would fail; none was started)")
    if args.dry_run or args.check:     # each run's settings checked as its start would (not
        from tta_brain import decode     # its stream, which an earlier stage may not have written)
        refused, said, streams, queued = 0, {}, {}, []
        # --check (a recipe, before it decodes here) knows this machine's devices; a dry run may
        # prepare commands for another. The stream's own options do not change what is checked.
        here = args.check and not args.dry_run and args.engine == "local"
        where = ("--stream_csv=", "--output_folder=", "--stream_name=", "--data_root=",
                 "--method_tag=")
        for r in runs:
            if args.dry_run:
                print("DRY-RUN: " + shlex.join([sys.executable, "-m", "tta_brain.decode",
                                                *r.argv]))
            key = tuple(a for a in r.argv if not a.startswith(where))
            if key not in said:
                try:
                    decode.settings(r.argv, device_here=here)
                    said[key] = None
                except SystemExit as e:
                    said[key] = str(e)
            if said[key]:
                refused += 1
                print(f"grid: {r.name} will not run: {r.said(said[key])}", flush=True)
                continue
            state = "queued"
            if args.dry_run and (r.folder / "summary.json").is_file():
                state = _say_finished(r, here, streams)
                refused += state == "failed"
            if state == "queued":
                queued.append(r)
        # the jobs of the runs the grid would queue (as it makes them, in the order they start)
        units = batches(queued, args.batch_runs, check=False) if args.dry_run else []
        for chunk in units:
            if len(chunk) > 1:      # checked when it runs: a batch the sweep refuses is split
                print(f"DRY-RUN: batch of {len(chunk)} (one python -m tta_brain.sweep, or separate "
                      f"runs where it cannot batch them): {', '.join(r.name for r in chunk)}",
                      flush=True)
        if units and args.gpus:     # which GPU each starts on (the grid's own start order)
            print(slot_plan(units, args), flush=True)
        return 1 if refused else 0
    check_done(runs, device_here=args.engine == "local")
    if args.engine == "local" and not args.hparams_dir and any(r.status in ("queued", "failed")
                                                               for r in runs):
        # (own yamls may load the model otherwise: a savedir of their own)
        from tta_brain.lobes.hf_ctc import source_problem   # once, not a failure per run (a
        why = source_problem(args.source)                   # Slurm node may see other files)
        if why:
            raise SystemExit(f"ERROR: --source {args.source}: {why} (every run would fail; "
                             f"none was started)")
    for r in runs:              # said now, not after hours of the other runs (and at the end)
        if r.status == "failed":
            print(f"grid: {r.name} will not run: {r.message}", flush=True)
        elif r.status == "busy":
            print(f"grid: {r.name} is not run here: it is {r.message}", flush=True)
    print(_progress(runs), flush=True)
    # SIGTERM (kill, a batch system ending this job) ends the grid as Ctrl-C does: through
    # execute's clean-up, which cancels the local workers. Only the main thread may set a
    # handler: a grid started from another thread (a notebook's, a server's) leaves SIGTERM as
    # it is (it had stopped with ValueError: signal only works in main thread).
    in_main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        execute(runs, args)
    except KeyboardInterrupt:
        print("grid: interrupted", flush=True)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, old)
    failed = [r for r in runs if r.status == "failed"]
    for r in failed:
        print(f"FAILED {r.name}: {r.message}" + (f"\n  logs: {', '.join(r.logs)}" if r.logs else ""),
              flush=True)
    busy = [r for r in runs if r.status == "busy"]
    for r in busy:               # not failed, not finished here: the grid is not complete
        print(f"NOT RUN {r.name}: {r.message}; rerun this grid once it has finished", flush=True)
    print(_progress(runs).replace("grid:", "grid finished:"), flush=True)
    return 1 if failed or busy else 0


if __name__ == "__main__":
    sys.exit(main())
