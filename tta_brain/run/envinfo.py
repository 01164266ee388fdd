"""What a run ran on: library versions (summary.json, log.txt, env.log) and the machine (the
RESULTS.md environment block). The one place that asks."""
import datetime as _dt
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, Optional, Sequence

__all__ = ["versions", "environment", "git_hash", "describe_device", "installed_packages",
           "numerics", "numerics_changes"]

PACKAGES = ("torch", "torchaudio", "speechbrain", "transformers", "numpy", "soundfile", "cma")


def _version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # PackageNotFoundError and broken metadata alike
        return None


_INSTALLED: Optional[str] = None


_RULE = "==============================\n"


def installed_packages() -> str:
    """SpeechBrain's description of the environment (Python, ``pip freeze``, git, CUDA): the head
    of every run's env.log (log.txt names env.log, not the freeze). The freeze is asked once per
    process (about 0.5 s; a batched sweep or a grid worker opens many run folders, and the
    installed packages do not change under it); the git revision (of the working directory, as
    SpeechBrain asks it) each time: a notebook that commits, checks out or changes directory
    between runs wrote the first run's revision into every later env.log."""
    parts = _environment_description().split(_RULE)
    for i, part in enumerate(parts):
        if part.startswith(("Git revision:", "Could not get git revision")):
            rev = _command(["git", "rev-parse", "--short", "HEAD"], cwd=os.getcwd())
            parts[i] = f"Git revision:\n{rev}\n" if rev else "Could not get git revision"
    return _RULE.join(parts)


def _environment_description() -> str:
    global _INSTALLED
    if _INSTALLED is None:
        from tta_brain import quirks  # noqa: F401
        from speechbrain.utils.logger import get_environment_description
        # SpeechBrain's shell helper also logs the whole freeze at DEBUG: into the log.txt of
        # whichever run folder is open first, and of no other; env.log holds it for every run
        shell = logging.getLogger("speechbrain.utils.superpowers")
        disabled, shell.disabled = shell.disabled, True
        try:
            _INSTALLED = get_environment_description()
        finally:
            shell.disabled = disabled
    return _INSTALLED


def versions() -> Dict[str, str]:
    """Python, tta_brain and the libraries that decide the numbers (+ CUDA when torch has it)."""
    import tta_brain
    out = {"python": platform.python_version(), "tta_brain": tta_brain.__version__}
    for name in PACKAGES:
        module = sys.modules.get(name)       # the version that runs, local tags included
        v = getattr(module, "__version__", None) or _version(name)
        if v is not None:
            out[name] = str(v)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version()
    return out


def numerics() -> Dict:
    """What decides how a run's floating point rounds beside its settings, and is no part of its
    fingerprint: torch's intra-op threads (``OMP_NUM_THREADS`` / ``torch.set_num_threads``; a
    CPU reduction split over other threads sums in another order) and the libraries' versions.
    Kept with each checkpoint: a run resumed under other values says so (``numerics_changes``)."""
    torch = sys.modules.get("torch")
    out = {"threads": int(torch.get_num_threads()) if torch is not None else None}
    out.update(versions())
    for name in PACKAGES:     # the installed version, whether or not this process imported the
        v = _version(name)    # module yet (versions() prefers a module's __version__: torch's
        if v is not None:     # 2.11.0+cu130 against the metadata's 2.11.0, a false change)
            out[name] = v
    return out


def numerics_changes(old: Dict, new: Dict) -> list:
    """``key: old -> new`` for each value of :func:`numerics` that differs."""
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def describe_device(device, visible: Optional[str] = None) -> str:
    """``cpu``, or ``cuda:I (GPU P: name)`` with ``P`` the machine's GPU id (``nvidia-smi``'s
    index) that CUDA device ``I`` of this process is: entry ``I`` of ``CUDA_VISIBLE_DEVICES``
    (``visible``; default: the environment's), which a grid sets for each of its runs."""
    name = str(device)
    if not name.startswith("cuda"):
        return name
    torch = sys.modules.get("torch")
    index = name.partition(":")[2]
    if not index:
        index = str(torch.cuda.current_device()) if torch and torch.cuda.is_available() else "0"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else None
    gpu = ids[int(index)] if ids is not None and int(index) < len(ids) else index
    # the name only of a device this process has (a planned index may be beyond them)
    model = (f": {torch.cuda.get_device_name(int(index))}"
             if torch is not None and torch.cuda.is_available()
             and int(index) < torch.cuda.device_count() else "")
    return f"cuda:{index} (GPU {gpu}{model})"


def _command(args: Sequence[str], cwd=None) -> Optional[str]:
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def git_hash(repo_dir=None) -> Optional[str]:
    """The commit of the checkout holding tta_brain (None for an installed package)."""
    repo_dir = Path(repo_dir) if repo_dir else Path(__file__).resolve().parents[1]
    return _command(["git", "rev-parse", "HEAD"], cwd=repo_dir)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(repo_dir=None) -> "OrderedDict[str, str]":
    """Date, Python, library versions, git hash, CPU and GPU (ESPnet's environment block)."""
    env = OrderedDict()
    env["date"] = _dt.datetime.now().astimezone().strftime("%a %b %d %H:%M:%S %Z %Y")
    env["python version"] = sys.version.split()[0]
    for pkg in ("torch", "torchaudio", "transformers", "speechbrain"):
        env[f"{pkg} version"] = _version(pkg) or "not installed"
    env["Git hash"] = git_hash(repo_dir) or "unavailable"
    env["CPU"] = f"{_cpu_name()} ({os.cpu_count()} cores)"
    gpus = _command(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    env["GPU"] = "; ".join(gpus.splitlines()) if gpus else "none detected"
    return env
