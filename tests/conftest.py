"""Shared fixtures: tiny *real* Hugging Face CTC models written with ``save_pretrained``."""
import importlib.util
import logging
import math
import os
import shutil
import subprocess
import sys
from functools import partial

import pytest
import torch

from tta_brain.lobes.testing import TINY, save_random_ctc_model

# Tiny models on a shared 2-core machine: one thread avoids oversubscription (20-50x slowdowns),
# also in the recipe subprocesses the tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.append(os.path.join(ROOT, "tools"))      # the benchmark and check scripts

#: The modules that take longest (``--durations`` on 2 cores), collected first: under the README's
#: ``-n 2 --dist loadscope --no-loadscope-reorder`` (pytest-xdist; one thread a process, above, so
#: one process keeps one core busy) a worker takes a module whole, in this order, and the other
#: worker runs the short ones meanwhile instead of one long module running alone at the end. The
#: rest keep their order.
LONGEST_FIRST = ("test_synthetic_recipe.py", "test_sweep.py", "test_grid.py", "test_gpu.py",
                 "test_recipe_decode.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # a stable sort


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test():
    """A root handler a test installs (SpeechBrain's console handler of an in-process decode,
    a main()'s ``logging.basicConfig``) is bound to that test's captured stream: left in place,
    a later test's log record went to the closed stream, and its stderr held
    "--- Logging error ---" and a traceback (which test saw it depended on the order xdist gave
    the modules). Each test's own handlers are removed after it."""
    root = logging.getLogger()
    before = set(root.handlers)
    yield
    for handler in root.handlers[:]:
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
            handler.close()


def save_ctc_model(out_dir, seed=0, norm="group", hidden=32, layers=2, **config_overrides):
    """A randomly initialised tiny Wav2Vec2ForCTC + processor (wav2vec2-base-960h vocabulary)."""
    cfg = dict(TINY, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
               feat_extract_norm=norm, do_stable_layer_norm=False)
    cfg.update(config_overrides)
    return save_random_ctc_model(out_dir, seed, **cfg)


RUNTIME_KEYS = ("precision", "compile", "cache_features", "cpu_native_backward", "loss_scale")


def build_on(model_dir, name, plain=False, **kwargs):
    """Method ``name`` on its own freshly loaded lobe of ``model_dir``. Runtime options
    (``RUNTIME_KEYS``) go to the lobe's ``Runtime``; ``plain=True`` is the reference path the
    speed paths are checked against: no feature cache and the optimisers' per-tensor loops."""
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.methods import build_method
    from tta_brain.lobes.runtime import Runtime
    runtime = {k: kwargs.pop(k) for k in list(kwargs) if k in RUNTIME_KEYS}
    if plain:
        runtime.setdefault("cache_features", "off")
        loop = partial(torch.optim.AdamW, weight_decay=0.0, foreach=False)
        kwargs.setdefault("optimizer", loop)
        if name == "dsuta":
            kwargs.setdefault("slow_optimizer", loop)
    return build_method(name, model=HFCTCLobe(model_dir, runtime=Runtime(**runtime)), **kwargs)


def crash_at(monkeypatch, run, position):
    """``decode.main(run)`` stopped by an exception at stream ``position`` (its checkpoints
    before it written), as a crash leaves a run."""
    from tta_brain import decode
    from tta_brain.run.brain import TTABrain
    orig = TTABrain.evaluate_batch

    def boom(self, batch, stage=None):
        if batch[1].position == position:
            raise RuntimeError("simulated crash")
        return orig(self, batch)
    monkeypatch.setattr(TTABrain, "evaluate_batch", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        decode.main(run)
    monkeypatch.setattr(TTABrain, "evaluate_batch", orig)


def reference_copy(model_dir, names, eval_mode=True):
    """A separate copy of the model for a step by hand: its lobe and its parameters ``names``
    (the method's ``param_names``), the only ones that take gradients; eval mode unless told."""
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    lobe = HFCTCLobe(model_dir)
    if eval_mode:
        lobe.model.eval()
    lobe.model.requires_grad_(False)
    named = dict(lobe.model.named_parameters())
    params = [named[n] for n in names]
    for p in params:
        p.requires_grad_(True)
    return lobe, params


def max_diff(a, b):
    """Largest absolute difference between two equally long lists of tensors (0 for none)."""
    assert len(a) == len(b)
    return max((float((x.detach().double().cpu() - y.detach().double().cpu()).abs().max())
                for x, y in zip(a, b)), default=0.0)


def rel_change(a, b, src) -> float:
    """How far two adapted states are apart, relative to how far adaptation moved ``b`` from the
    source ``src``: ||a - b|| / ||b - src||, L2 over all their elements. Where two runs take
    different kernels on CUDA (a padded and an unpadded pass, a batched and a separate one),
    Adam turns the rounding of a near-zero gradient into an update of up to lr, so single weights
    differ by more than rounding while the state as a whole does not."""
    assert len(a) == len(b) == len(src)
    sq = lambda xs, ys: sum(float((x.detach().double().cpu() - y.detach().double().cpu())  # noqa
                                  .pow(2).sum()) for x, y in zip(xs, ys))
    return math.sqrt(sq(a, b)) / max(math.sqrt(sq(b, src)), 1e-30)


def transcript_agreement(want, got):
    """``(same, cer)`` of two equally shaped lists (runs) of transcript lists: the fraction of
    identical transcripts, and the pooled CER of ``got`` against ``want`` (a fraction)."""
    from tta_brain.asr.metrics import corpus_error_rate
    pairs = [(w, g) for wr, gr in zip(want, got, strict=True) for w, g in zip(wr, gr, strict=True)]
    same = sum(w == g for w, g in pairs) / len(pairs)
    return same, corpus_error_rate(pairs, unit="char") / 100.0


@pytest.fixture
def make(tiny_model_dir):
    """``make(name, model_dir=None, **kwargs)``: a method on its own freshly loaded tiny model
    (see :func:`build_on`)."""
    def _make(name, model_dir=None, **kwargs):
        return build_on(model_dir or tiny_model_dir, name, **kwargs)
    return _make


@pytest.fixture
def source_values(tiny_model_dir):
    """``source_values(names_or_method)``: the checkpoint's values of the named parameters (or of
    a method's adapted ones)."""
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    params = dict(HFCTCLobe(tiny_model_dir).model.named_parameters())

    def values(names):
        names = getattr(names, "param_names", names)
        return [params[n].detach().clone() for n in names]
    return values


def kill_9_mid_run(cmd, out, env, timeout=240):
    """Run ``cmd`` (a ``tta_brain.decode`` writing ``out``) and SIGKILL it as soon as its first
    checkpoint exists; the run must not have finished by then (its rerun is the test's part)."""
    import signal
    import time
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    try:
        while not list((out / "save").glob("CKPT+*/stream.ckpt")):
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.time() < deadline, f"no checkpoint after {timeout} s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists(), "killed too late: the run had finished"


def assert_resumes_after_kill_9(cmd, out, env, ref,
                                files=("transcripts.csv", "resets.csv", "wer.txt")):
    """``kill -9`` the decode ``cmd`` at its first checkpoint and rerun it: it resumes, and its
    ``files`` equal those of the uninterrupted run in ``ref``."""
    kill_9_mid_run(cmd, out, env)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Resuming" in (out / "log.txt").read_text()
    for f in files:
        assert (out / f).read_text() == (ref / f).read_text(), f


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_ctc_model(str(tmp_path_factory.mktemp("tiny_w2v2")))


@pytest.fixture
def tiny_lobe(tiny_model_dir):
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    return HFCTCLobe(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_stats(tiny_model_dir, tmp_path_factory):
    """A source statistics file of the tiny model (kinds hidden, tokens: FOA, E-BATS) from
    generated clean speech that is in no test stream."""
    from fake_corpora import fake_speech
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.methods import source_stats as ss
    lobe = HFCTCLobe(tiny_model_dir)
    inputs = [lobe.prepare(torch.from_numpy(fake_speech(0.7, seed=900 + i))) for i in range(4)]
    record = ss.SourceStats(stats={k: ss.KINDS[k](lobe, inputs, {}) for k in ("hidden", "tokens")},
                            manifest="generated", manifest_sha1="", model=tiny_model_dir,
                            model_params_sha1=ss.params_sha1(lobe.model), n_utts=len(inputs))
    path = tmp_path_factory.mktemp("tiny_stats") / "stats.pt"
    ss.save(record, path)
    return str(path)


@pytest.fixture(scope="session")
def utterances():
    """A few deterministic 'speech-like' waveforms (AM tones + noise), 16 kHz, 0.5-1.2 s."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i, sec in enumerate((0.8, 1.2, 0.5, 1.0, 0.7, 0.9)):
        n = int(16000 * sec)
        tt = torch.arange(n) / 16000
        f0 = 120 + 30 * i
        env = 0.5 * (1 + torch.sin(2 * torch.pi * 3 * tt))
        wav = env * sum(torch.sin(2 * torch.pi * f0 * h * tt) / h for h in (1, 2, 3))
        out.append((0.3 * wav + 0.05 * torch.randn(n, generator=g)).float())
    return out


# ----------------------------------------------------------------------------- a Slurm cluster
def _unavailable(reason):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: CI must start the cluster before the tests)")
    pytest.skip(reason)


def _slurm_conf():
    """SLURM_CONF, else the config of cluster.sh's state directory, else Slurm's default."""
    conf = os.environ.get("SLURM_CONF")
    if conf:
        return conf if os.path.isfile(conf) else None
    state_dir = os.environ.get("TTA_SLURM_DIR", "/tmp/tta-slurm")
    for conf in (os.path.join(state_dir, "etc", "slurm.conf"), "/etc/slurm/slurm.conf"):
        if os.path.isfile(conf):
            return conf
    return None


@pytest.fixture
def slurm_cluster(monkeypatch):
    """The SLURM_CONF of a running cluster (set in os.environ, so sbatch and the jobs see it)."""
    if shutil.which("sbatch") is None:
        _unavailable("sbatch not found: start a cluster with .ci/slurm_cluster.sh start")
    conf = _slurm_conf()
    if conf is None:
        _unavailable("no slurm.conf found (SLURM_CONF unset, no /tmp/tta-slurm/etc/slurm.conf): "
                     "start a cluster with .ci/slurm_cluster.sh start")
    monkeypatch.setenv("SLURM_CONF", conf)
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        first = ((ping.stdout + ping.stderr).strip().splitlines() or ["no output"])[0]
        _unavailable(f"slurmctld does not answer (SLURM_CONF={conf}: {first[:200]}): "
                     "start a cluster with .ci/slurm_cluster.sh start")
    if importlib.util.find_spec("submitit") is None:
        _unavailable("submitit is not installed (pip install submitit)")
    return conf
