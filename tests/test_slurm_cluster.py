"""submitit on a real Slurm cluster (``.ci/slurm_cluster.sh start``): a job, a job array, and
the checkpoint/requeue path that a time limit or a preemption takes.

Skipped when no cluster is reachable (no ``sbatch`` on PATH, no config, no slurmctld answering),
except under ``CI=true``, where CI starts the cluster first and a missing one is a failure.
"""
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow   # end to end: python -m pytest -m 'not slow' leaves it out

# The jobs unpickle what they run: this test module is not importable there (tests/ is not a
# package on the job's sys.path), so cloudpickle ships its functions by value.
try:
    import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
except (ImportError, AttributeError, ValueError):
    pass

DEADLINE_S = 90  # a healthy one-node cluster runs the jobs below in a few seconds


def _cred_expire_s():
    """How long a requeued job waits before it may start again (Slurm: AuthInfo cred_expire)."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("AuthInfo") and "cred_expire=" in line:
            return int(line.split("cred_expire=")[1].split(",")[0].strip())
    return 120  # Slurm's default


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read() or 0)
    except FileNotFoundError:
        return 0


def _square_plus(x, offset=0):
    return {"value": x * x + offset, "job_id": os.environ.get("SLURM_JOB_ID"),
            "array_task": os.environ.get("SLURM_ARRAY_TASK_ID")}


def _wait(jobs, deadline):
    while not all(job.done() for job in jobs):
        if time.monotonic() > deadline:
            queue = subprocess.run(["squeue", "-l"], capture_output=True, text=True).stdout
            nodes = subprocess.run(["sinfo", "-N", "-l"], capture_output=True, text=True).stdout
            for job in jobs:
                job.cancel(check=False)
            pytest.fail(f"jobs not done after {DEADLINE_S}s\n{queue}\n{nodes}")
        time.sleep(0.5)


def test_submitit_job_and_array(slurm_cluster, tmp_path):
    import submitit

    deadline = time.monotonic() + DEADLINE_S
    # cluster="slurm": never fall back silently to submitit's local executor.
    executor = submitit.AutoExecutor(folder=str(tmp_path / "%j"), cluster="slurm")
    # 10 min: submitit asks for USR2 90 s before the limit (2 min: 25 s into the job, measured
    # on the CI cluster); a CI run once signalled a job while Python was still loading it.
    executor.update_parameters(timeout_min=10, cpus_per_task=1, mem_gb=1, name="tta-slurm-test")
    job = executor.submit(_square_plus, 3, offset=1)
    jobs = executor.map_array(_square_plus, [1, 2])
    _wait([job, *jobs], deadline)

    result = job.result()
    assert result["value"] == 10
    assert result["job_id"] == job.job_id
    assert [j.result()["value"] for j in jobs] == [1, 4]
    assert sorted(j.result()["array_task"] for j in jobs) == ["0", "1"]
    assert job.paths.result_pickle.exists()
    assert "completed successfully" in (job.stdout() or "")

    # With accounting (cluster.sh's default) sacct reports the final state a little after the
    # result file appears; without it submitit's state stays UNKNOWN.
    state = job.state
    while state not in ("COMPLETED", "UNKNOWN") and time.monotonic() < deadline:
        time.sleep(1)
        state = job.watcher.get_state(job.job_id, mode="force")
    assert state in ("COMPLETED", "UNKNOWN"), state


class _ResumableCount:
    """Counts to n, progress in a file, resumes from it. Its checkpoint() method (all that
    submitit looks for, as in submitit.helpers.Checkpointable) makes it requeued on USR2."""

    def __init__(self, path, n, step_s=0.2):
        self.path, self.n, self.step_s = path, n, step_s

    def __call__(self):
        start = _read_int(self.path)
        for i in range(start, self.n):
            time.sleep(self.step_s)
            with open(self.path + ".tmp", "w") as f:
                f.write(str(i + 1))
            os.replace(self.path + ".tmp", self.path)
        return {"resumed_from": start, "restarts": os.environ.get("SLURM_RESTART_COUNT", "0")}

    def checkpoint(self):
        import submitit
        return submitit.helpers.DelayedSubmission(self)


def test_submitit_checkpoint_requeue(slurm_cluster, tmp_path):
    """USR2 (what Slurm sends before a time limit): checkpoint, requeue, resume, same job id."""
    import submitit

    deadline = time.monotonic() + DEADLINE_S + _cred_expire_s()
    progress = str(tmp_path / "progress.txt")
    executor = submitit.AutoExecutor(folder=str(tmp_path / "%j"), cluster="slurm")
    # A 5 min limit: Slurm sends no USR2 of its own during the test. submitit takes a USR2 for a
    # time-out once the job ran min(0.8 * limit, limit - 10 min): below 50 min, from the start.
    # So this is the time-out path (checkpoint, requeue, one of max_num_timeout used).
    executor.update_parameters(timeout_min=5, cpus_per_task=1, mem_gb=1, name="tta-slurm-requeue")
    job = executor.submit(_ResumableCount(progress, n=10))
    while _read_int(progress) < 2:
        if time.monotonic() > deadline or job.done():
            job.cancel(check=False)
            pytest.fail(f"no progress from job {job.job_id}: {job.stderr()}")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True)
    _wait([job], deadline)
    result = job.result()
    assert result["resumed_from"] >= 2, result
    assert result["restarts"] == "1", result
    assert "Requeued job" in job.stdout()
