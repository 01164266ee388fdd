#!/usr/bin/env python3
"""GPU check of the adaptation steps on CUDA: the default (captured steps on length buckets,
``cuda_graphs`` / ``cuda_graph_buckets: auto``) against the eager and the unbucketed steps,
per-utterance fixed cost, deterministic kernels, memory along a long stream.

Everything in one run on one CUDA device. "default" is what a run gets without options
(``cuda_graphs: auto``: suta, csuta, dsuta, tent, eata, sar and cea captured in fp32, also on
the official code's parameter list;
``cuda_graph_buckets: auto``: on length buckets at ratio 0.1 where exact, 64 graphs kept);
"unbucketed" the captured steps without buckets (``UNBUCKETED``, the default until 2026-11-27);
"eager" is
``cuda_graphs: off`` (the host step: finiteness read on the host, ``foreach`` AdamW); "device
eager" is the device-side steps without capture (``cuda_graphs: off, cuda_device_steps: true``),
the exact reference of the captured steps. Results go to stdout and ``<out>/gpu_check.txt`` /
``.json``:

1. ``transcripts``: captured vs device eager on a tiny random wav2vec2 (the tests' model) for 20
   utterances of each graph-capable method (suta, csuta, dsuta, dsuta + dynamic reset, tent,
   eata: its sample filter decided on the device, sar: its whole SAM step, cea: two stages with
   their own optimisers), unbucketed with graph cache 1 and 4 and ``cuda_graph_warmup: 0``,
   length buckets (0.25, cache 4: padded passes, equal to rounding; cea has none) and the
   default; eata, sar and cea cache 4, buckets and the default only, as are suta and dsuta +
   dynamic on the official code's parameter list (``@official``: the recipes'
   ``param_collection: official``, RepeatedAdam on the device): same transcripts? largest
   parameter difference; captures, hits, replays.
2. ``step``: one SUTA step on a 3 s and an 8 s utterance of a random wav2vec2-base-sized model,
   fp32, LayerNorm + CNN adapted: ms per step, eager / device eager / default (the earlier,
   hand-written H200 measurement was 22 ms eager and 8.3 ms replayed; that is *not* what this
   script measured).
3. ``lengths``: the per-utterance fixed cost (``tools/bench_speed.py --two_lengths 3,8``): s per
   utterance of suta and dsuta + dynamic, eager, unbucketed and default (length buckets: one
   captured graph per bucket, replayed from an utterance's first step), on utterances of about
   3 s and 8 s (every one a new length, as in a real stream, after a warm-up at both lengths),
   and the intercept of the line through the two (time = fixed + slope x audio seconds).
   ``profile`` (on request): where a warm utterance's time goes, SUTA on length buckets, one
   run (its phases timed with a sync after each: begin, steps, prediction, end; DSUTA + dynamic
   reset's too) and a batch of
   8, under ``torch.profiler``: wall, GPU kernel time, the host calls that launch or wait, the
   top operators by host and device time, per utterance; then the eager step and the eager batch
   by operator and input shape (which layers own the kernel time; which operators own the
   batch's layout conversions).
4. ``deterministic``: SUTA and DSUTA (default steps) with deterministic kernels on and off (the
   run option ``--deterministic``): s per audio s and the price of determinism; and, warm, cuDNN's
   deterministic convolutions as its heuristics pick them against the fastest ones its autotuner
   (``cudnn.benchmark``) finds.
5. ``memory``: 1,000 utterances of distinct lengths through dsuta (default steps; on length
   buckets as the default, ``BUCKETS``, unless ``--memory_runtime unbucketed``; ``gemm``: on
   buckets with ``convolutions: gemm``): CUDA memory
   (allocated / reserved) every 50 utterances and the slope of the reserved memory over the last
   half (MB per 100 utterances; FLAT below 1 MB per 100), and the last half's s per audio s.
   Allocated memory counts what earlier sections of the process left alive too: for figures
   comparable with a fresh process run it alone.
6. ``bench``: ``tools/bench_speed.py --w2v2_base`` (source, suta, dsuta, dsuta+dynamic), default
   and ``--cuda_graphs off``: s per audio s and the ratio.
7. ``decode``: ``python -m tta_brain.decode`` (in this process) on a generated stream with the same
   random base-sized model, default and ``--cuda_graphs=off``: the method's time (summary.json)
   per audio second, and how many transcript rows agree (the eager path rounds differently).
8. ``official``: the official code (a checkout of hhhaaahhhaa/Dynamic-SUTA given by
   ``--official_dir``, default ``.official/Dynamic-SUTA``; not shipped, never imported elsewhere)
   and ``decode`` side by side in this process: SUTA and DSUTA + dynamic reset on the same random
   base-sized model and utterances at ``--seconds`` and ``--long_seconds``, s per audio s and the
   speed-up; ours also with the CNN's convolutions as matrix products (``DECODE_GEMM_OPTS``,
   its transcripts against the default decode's; this column replaced the unbucketed one,
   measured on two H200 sessions, on 2026-12-01) and, with the defaults, on a
   longer stream of the same lengths (``--long_stream_s`` audio seconds; ours only, against the
   official rate of the short stream), and with ``--cuda_graph_warmup=0`` (the candidate for a
   smaller cold start, ``DECODE_WARMUP0_OPTS``) and ``--param_collection=official`` (the
   recipes' setting, ``DECODE_OFFICIAL_LIST_OPTS``). Without the checkout: ours only. The smoke
   test runs the official code on CPU (its ``.cuda()`` made a no-op).
9. ``field``: ``bench_speed`` over the field's methods (tent, eata, sar, cotta, cea, lame, t3a,
   foa, ebats, with source and suta) on the base-sized model (the default: length buckets on
   CUDA), the one-step ones (tent, eata, sar) again without buckets (``UNBUCKETED_OPTS``: a new
   length then runs eagerly), and ``--population``: E-BATS and
   FOA with the CMA-ES population batched vs one candidate at a time vs the reference's loop.

10. ``convolutions`` (on request): the CNN's convolutions as matrix products
   (``convolutions: gemm``, ``tta_brain.lobes.gemm_conv``; cuDNN's convolution kernels took about
   half of the H200's kernel time per SUTA utterance) against cuDNN's: one warm SUTA step at both
   lengths (also with ``tf32: on``), SUTA and DSUTA + dynamic reset on length buckets (s per
   audio s, transcripts alike), a warm batch of 8 SUTA runs (s per utterance).

``sweep`` (issue #22 item 6): a generated stream (``--sweep_utts`` utterances of 2-4 s) decoded by
8 SUTA runs (10 steps, lr 1e-5 .. 8e-5; ``--sweep_method dsuta+dynamic``: DSUTA with the dynamic
reset, buffer 2, K a third of the stream, at least 4; ``eata``: EATA with every step kept, no Fisher
term; ``sar``: SAR with no pass filtered; ``cotta``, ``cea``, ``sgem``, ``sdpl``: with their
defaults; ``awmc``: its defaults in eval mode (``--train_mode=false``: the random model's dropout
is refused by a batch); ``ebats``,
``foa``, ``lame``, ``t3a``: at their defaults, each run its own CMA-ES seed, k or filter, statistics
from 4 other generated utterances; the ``batched_eager`` arm is then the same batch: nothing of
theirs is captured) on the random base-sized model, as one batched sweep
process (``python -m tta_brain.sweep``) vs 8 ``python -m tta_brain.decode`` processes started
together on the GPU (``tools/bench_sweep.py``): throughput of both over the decode loops and over
the processes' wall time, the ratio (target: >= 3x), and how many runs' transcripts agree; the
batched sweep once more with ``--cuda_graphs=off`` (its steps eager: what capturing the batched
step gains, and whether the transcripts agree), with the sweep's graph counts;
``--sweep_unbucketed``: every run of every arm without length buckets
(``DECODE_UNBUCKETED_OPTS``).

By default a GPU run checks, in this order, transcripts, official, lengths, sweep and memory
(``--sections`` picks others, in the order given; ``deterministic``, measured on an H100 and an
H200, is on request since 2026-11-27). Each section is skipped
(and says so) once ``--budget_s`` (default 480 s) would be exceeded, so the whole check stays
under 8 minutes on one GPU; a failing section is reported and the next runs (``COST``: the seconds
the default sections took on an H200 on 2026-11-27, the others on an H100 on 2026-11-26, a guess
for ``profile``; ``gpu_check.json`` records each section's seconds). ``--cpu_smoke`` runs every section on CPU
with a tiny model and a few utterances (no figures: the script's own test, tests/test_gpu.py); a
size given (``--n_utts``, ``--seconds``, ...: ``SMOKE_DEFAULTS``) is kept. A bad number is one
line at parse time (``bench_args``' types), not a failure on the GPU.

Recipe for a fresh GPU machine with torch 2.11 + CUDA but none of our other packages and no
network. Here (with network), put the wheels into ``.whl/``: ``bash tools/gpu_wheels.sh`` downloads
the CPython 3.12 wheels (the GPU machine's Python, not necessarily this one's) of what we import
that the GPU image lacks or holds in versions we cannot use (its transformers 5.x), each pinned to
the version installed here, and checks that pip would install them on that Python;
then carry ``.whl`` along and, on the GPU machine, in the repository root (into an empty
``.site``: reinstalling over an earlier one left it without some modules)::

    rm -rf .site; python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
    PYTHONPATH=.site:. python3 tools/gpu_check.py --out $OUT

(The imports also need numpy, PyYAML, regex, safetensors, tqdm, packaging, filelock, fsspec,
requests, click, cloudpickle, joblib, scipy, sentencepiece and torchaudio, which the image holds;
the check names any missing
module in one line and stops.) Without a CUDA device it refuses with one line (exit status 2).
The CUDA-only tests (captured vs eager steps, no sync, the batched sweep on the GPU) run with
the image's pytest::

    PYTHONPATH=.site:. python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
        tests/test_sweep.py -k "cuda and not gpu_session"

``bash tools/gpu_session.sh`` does all three in one device call (the check within
``--budget_s``, default 480 s: every default section, the tests within ``--tests_s``, logs under
``$OUT``; about 9 minutes: on an H200 on 2026-11-27 the sections took 419 s, the tests 63 s),
sized to leave a session's 15 device minutes, after the machine's start, room to rerun a section
or two; ``--smoke`` runs its plumbing on the CPU. Before a lent GPU, ``bash tools/gpu_twin.sh``
makes a CPU twin of the image's Python and packages, where
``PATH=/tmp/gpu_twin/bin:$PATH bash tools/gpu_session.sh --cpu_smoke --budget_s 900 --tests_s 0``
rehearses the whole call (the wheels installed into ``.site``, every section).
"""
import argparse
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
for _p in (ROOT, TOOLS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_args import at_least, positive  # noqa: E402  (the bench tools' types: one line, no GPU)

SECTIONS = ("transcripts", "step", "lengths", "profile", "deterministic", "memory", "bench",
            "decode", "official", "field", "sweep", "convolutions")
#: seconds of each section on one GPU, for the budget: as an H200 took them on 2026-11-27
#: (transcripts + 6 for the field methods' default rows, official + 10 for its fresh loop and
#: + 40 for its warm-up 0 and official-list columns (8 decodes), transcripts + 8 for the
#: official list's rows,
#: profile + 10 for DSUTA's phases, + 16 for its tables by operator and + 10 for the official
#: list's, deterministic + 14 for its autotuned rows (an estimate), added after that run;
#: sweep: 66 s for 8 utterances, an estimate for 24), bench and decode as an H100 did on 2026-11-26;
#: convolutions an estimate (2026-12-01, never run on a GPU)
COST = {"transcripts": 47, "step": 8, "lengths": 57, "deterministic": 36, "memory": 70,
        "bench": 110, "decode": 60, "official": 180, "field": 86, "sweep": 110,
        "profile": 72, "convolutions": 50}
#: What a GPU run checks by default, most wanted first; they add up to 464 s, within the budget
#: (480 s, 8 minutes). ``field``, ``step``, ``profile``, ``bench``, ``decode`` and
#: ``deterministic`` (its price measured twice: 1.12x on an H100, 1.2x on an H200) on request
DEFAULT_SECTIONS = ("transcripts", "official", "lengths", "sweep", "memory")
MEASURED_GRAPH_METHODS = ("suta", "csuta", "dsuta", "dsuta+dynamic", "tent")
#: ``@official``: ``param_collection: official`` (the LS-C and CHiME-3 recipes' setting), whose
#: RepeatedAdam runs on the device since 2026-11-27 (not yet on a GPU)
GRAPH_METHODS = MEASURED_GRAPH_METHODS + ("eata", "sar", "cea", "suta@official",
                                          "dsuta+dynamic@official")
#: the official code's parameter list (``adapt_params`` of ``param_collection: official``)
OFFICIAL_LIST = [{"select": "layernorm"}, {"select": "cnn"}, {"param_collection": "official"}]
#: length buckets as the run's default on CUDA sets them (``cuda_graph_buckets`` and
#: ``cuda_graph_cache: auto``: ``Runtime.AUTO_BUCKETS``, ``AUTO_BUCKET_CACHE``), given explicitly
#: where a section needs them on CPU too (the smoke test; ``auto`` is off on CPU)
BUCKETS, BUCKET_CACHE = {"cuda_graph_buckets": 0.1}, 64
#: the captured steps without buckets (the default until 2026-11-27), for comparison
UNBUCKETED = {"cuda_graph_buckets": 0.0, "cuda_graph_cache": 1}
UNBUCKETED_OPTS = ["--cuda_graph_buckets", "0", "--cuda_graph_cache", "1"]
DECODE_UNBUCKETED_OPTS = ["--cuda_graph_buckets=0", "--cuda_graph_cache=1"]
#: the candidate for a smaller cold start per run, measured beside the default by ``official``
DECODE_WARMUP0_OPTS = ["--cuda_graph_warmup=0"]
#: the recipes' parameter list (``param_collection: official``), measured beside the default
DECODE_OFFICIAL_LIST_OPTS = ["--param_collection=official"]
#: the CNN's convolutions as matrix products (``convolutions: gemm``): the candidate for a faster
#: step, measured beside the default by ``official`` and ``convolutions``
DECODE_GEMM_OPTS = ["--convolutions=gemm"]
GEMM = {"convolutions": "gemm"}
#: runtime options of the three ways a step runs
DEFAULT, EAGER, DEVICE_EAGER = {}, {"cuda_graphs": "off"}, {"cuda_graphs": "off",
                                                          "cuda_device_steps": True}
#: What the check imports besides torch (module names), for the one-line preflight.
NEEDED = ("numpy", "yaml", "ruamel.yaml", "hyperpyyaml", "speechbrain", "transformers",
          "tokenizers", "huggingface_hub", "safetensors", "soundfile", "jiwer", "rapidfuzz",
          "tqdm")
#: the options the run sizes itself by: their defaults on a GPU and under ``--cpu_smoke``, which
#: sets only those not given (a given one is honoured; ``--long_seconds`` then defaults to twice
#: ``--seconds``, as 0.6 and 1.2)
GPU_DEFAULTS = dict(device="cuda:0", n_utts=20, decode_utts=16, memory_utts=1000, sweep_utts=24,
                    seconds=3.0, long_seconds=8.0)
SMOKE_DEFAULTS = dict(device="cpu", n_utts=3, decode_utts=3, memory_utts=12, sweep_utts=3,
                      seconds=0.6, long_seconds=1.2)
EARLIER = ("earlier H200 measurement (hand-written capture, wav2vec2-base size, 3 s, fp32, "
           "not this code): one SUTA step 22 ms eager, 8.3 ms replayed; 10 s: 29 vs 13.5 ms")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the report and the runs")
    p.add_argument("--device", default=None, help="a CUDA device (default cuda:0; "
                   "--cpu_smoke: cpu, the only one it takes)")
    p.add_argument("--sections", default="",
                   help=f"comma-separated, in this order, from {','.join(SECTIONS)} (default: "
                        f"{','.join(DEFAULT_SECTIONS)}; the CPU smoke test: all)")
    p.add_argument("--budget_s", type=positive(float), default=480.0,
                   help="skip the sections that would start after this many seconds")
    p.add_argument("--memory_runtime", default="buckets",
                   choices=("buckets", "unbucketed", "gemm"),
                   help="memory: dsuta on length buckets (BUCKETS: the default on CUDA, also "
                        "on CPU), without (UNBUCKETED; measured flat on an H100 on 2026-11-26) "
                        "or on buckets with --convolutions=gemm (its window copies)")
    p.add_argument("--n_utts", type=positive(int), default=None,
                   help="utterances per method (transcripts; default 20, --cpu_smoke: 3)")
    p.add_argument("--decode_utts", type=positive(int), default=None,
                   help="utterances of the decode stream (default 16, --cpu_smoke: 3)")
    p.add_argument("--memory_utts", type=positive(int), default=None,
                   help="utterances of the memory stream (default 1000, --cpu_smoke: 12)")
    p.add_argument("--seconds", type=at_least(float, 0.1), default=None,
                   help="utterance length of step/bench (default 3, --cpu_smoke: 0.6)")
    p.add_argument("--long_seconds", type=at_least(float, 0.1), default=None,
                   help="the second length (lengths, official), longer than --seconds (default "
                        "8, --cpu_smoke: 2 x --seconds)")
    p.add_argument("--official_dir", default=os.path.join(ROOT, ".official", "Dynamic-SUTA"),
                   help="a checkout of the official code (hhhaaahhhaa/Dynamic-SUTA: its src/, "
                        "config/ and vocab.json) for the section official; not shipped")
    p.add_argument("--long_stream_s", type=positive(float), default=300.0,
                   help="official: audio seconds of the long stream at each length (ours only)")
    p.add_argument("--sweep_utts", type=positive(int), default=None,
                   help="utterances of the sweep stream (default 24, --cpu_smoke: 3; 8 until "
                        "2026-11-27, when 8 utterances "
                        "of 2-4 s spent much of the batch's time on captures: 2.2x, against 2.98x "
                        "for a warm batch of 8 in profile)")
    p.add_argument("--sweep_method", default="suta",
                   choices=("suta", "dsuta+dynamic", "eata", "sar", "cotta", "cea", "sgem",
                            "sdpl", "awmc", "ebats", "foa", "lame", "t3a"),
                   help="the runs of the sweep section")
    p.add_argument("--sweep_unbucketed", action="store_true",
                   help="the sweep section without length buckets ("
                        + " ".join(DECODE_UNBUCKETED_OPTS) + ") in every run of every arm")
    p.add_argument("--cpu_smoke", action="store_true",
                   help="every section on CPU with a tiny model and a few utterances (no "
                        "figures); the sizes given are kept")
    args = p.parse_args(argv)
    if args.cpu_smoke and args.device not in (None, "cpu"):
        p.error(f"--device {args.device}: --cpu_smoke runs on the CPU (leave --device out)")
    if args.cpu_smoke and args.long_seconds is None and args.seconds is not None:
        args.long_seconds = 2 * args.seconds
    for key, value in (SMOKE_DEFAULTS if args.cpu_smoke else GPU_DEFAULTS).items():
        if getattr(args, key) is None:                 # given: honoured, under --cpu_smoke too
            setattr(args, key, value)
    args.sections = ([s.strip() for s in args.sections.split(",") if s.strip()] or
                     list(SECTIONS if args.cpu_smoke else DEFAULT_SECTIONS))
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {', '.join(bad)} (choose from {', '.join(SECTIONS)})")
    if not args.device.startswith("cuda") and not args.cpu_smoke:
        p.error(f"--device must be a CUDA device, not {args.device!r}")
    if {"lengths", "official"} & set(args.sections) and args.seconds >= args.long_seconds:
        p.error(f"--long_seconds {args.long_seconds:g}: the second length must be longer than "
                f"--seconds {args.seconds:g}")
    return args


def preflight(device: str):
    """None when the check can run, else the one-line reason."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable ({e})"
    if device == "cpu":                          # --cpu_smoke
        return None
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False); nothing to check"
    idx = torch.device(device).index or 0
    if idx >= torch.cuda.device_count():
        return f"{device}: only {torch.cuda.device_count()} CUDA device(s)"
    missing = []
    for mod in NEEDED:
        try:
            importlib.import_module(mod)
        except Exception:                       # noqa: BLE001 - name it, whatever broke
            missing.append(mod)
    if missing:
        return (f"missing module(s) {', '.join(missing)}: install the wheels first (bash "
                f"tools/gpu_session.sh does; by hand: python3 -m pip install --no-index "
                f"--no-deps --target .site .whl/*.whl; PYTHONPATH=.site:.)")
    return None


class Report:
    def __init__(self, out):
        self.out, self.lines, self.data = out, [], {}

    def say(self, line=""):
        print(line, flush=True)
        self.lines.append(line)

    def save(self):
        with open(os.path.join(self.out, "gpu_check.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")
        with open(os.path.join(self.out, "gpu_check.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)


# ----------------------------------------------------------------------------- helpers
def _sync(device):
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


class _ReplayBackend:
    """CPU smoke test only: a stand-in for the CUDA graph backend. "Capture" keeps the step's
    body without running it and "replay" runs it, so the device step's bookkeeping (warm-up,
    captures, cache, length buckets, forward graphs) runs on CPU tensors as on a GPU."""

    class Graph:
        def __init__(self, body):
            self.body, self._pool = body, object()

        def replay(self):
            self.body()

        def pool(self):
            return self._pool

        def release(self):
            self.body = None

    def side(self):
        from contextlib import nullcontext
        return nullcontext()

    def capture(self, body, pool=None):
        return self.Graph(body)


def _method(name, model_dir, device, runtime, cache=None, **kw):
    """Method ``name`` (a token: ``dsuta+dynamic``; ``@official``: the official code's parameter
    list) on a fresh lobe with ``runtime`` options. On CPU (the smoke test) the device step runs
    on CPU tensors with :class:`_ReplayBackend`."""
    from functools import partial

    from tta_brain.gpu import make_step
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.lobes.runtime import Runtime
    from tta_brain.methods import build_method
    from tta_brain.methods.resets import make_reset_policy
    name, _, collection = name.partition("@")
    if collection == "official":
        kw.setdefault("adapt_params", OFFICIAL_LIST)
    base, _, reset = name.partition("+")
    if cache is not None:                 # else the runtime's (default: auto)
        runtime = dict(runtime, cuda_graph_cache=cache)
    lobe = HFCTCLobe(model_dir, device=device, runtime=Runtime(**runtime))
    if reset:
        kw["reset_policy"] = make_reset_policy(reset, K=kw.pop("reset_K", 10))
    kw.pop("reset_K", None)
    if not str(device).startswith("cuda"):
        kw["make_step"] = partial(make_step, backend=_ReplayBackend(), device_on_cpu=True)
    return build_method(base, model=lobe, **kw)


def _weight_norms(lobe) -> int:
    """Frozen weight norms the lobe has computed so far (``lobes.weight_norm``)."""
    from tta_brain.lobes.weight_norm import CachedWeightNorm
    return sum(m.computed for m in lobe.modules() if isinstance(m, CachedWeightNorm))


def _wavs(n, lo, hi, n_lengths=0, seed=0):
    """Speech-like waveforms (``bench_memory.speech_like_wavs``)."""
    from bench_memory import speech_like_wavs
    return speech_like_wavs(n, lo, hi, n_lengths, seed)


def _stats(m):
    from tta_brain.gpu import DeviceStep
    steps = m.step
    if not isinstance(steps, DeviceStep):
        return {"step": type(steps).__name__}
    return dict(step="DeviceStep", graphs=steps.graphs, buckets=steps.buckets, **steps.stats,
                **steps.cache.stats, forward_captures=steps.forwards.stats["captures"])


def _process_all(m, wavs, device):
    """Transcripts and the seconds spent (process() ends with the prediction's host copy)."""
    from tta_brain.methods import UttInfo
    _sync(device)
    t0 = time.perf_counter()
    hyps = [m.process(w, UttInfo(id=f"u{i}", position=i, domain="d")) for i, w in enumerate(wavs)]
    _sync(device)
    return hyps, time.perf_counter() - t0


def _release(m, device):
    import torch
    m.step.release()
    del m
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def _tiny_model(work):
    from tta_brain.lobes.testing import TINY, save_random_ctc_model
    path = os.path.join(work, "tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        save_random_ctc_model(path, 0, **dict(TINY, feat_extract_norm="group",
                                              do_stable_layer_norm=False))
    return path


def _base_model(work, args):
    if args.cpu_smoke:
        return _tiny_model(work)
    from bench_speed import build_random_model
    path = os.path.join(work, "w2v2_base")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_random_model(path, w2v2_base=True, seed=0)
    return path


def _steps(args, base):
    """Steps per utterance: the paper's (suta 10, dsuta 5 on multi-domain streams); 2 in the smoke
    test."""
    return 2 if args.cpu_smoke else (5 if base == "dsuta" else 10)


# ----------------------------------------------------------------------------- sections
def section_transcripts(args, rep, work):
    tiny = _tiny_model(work)
    # 8 distinct lengths in random order: captures, cache hits and (cache 4) replays of older
    # graphs after newer ones were captured into the same pool
    wavs = _wavs(args.n_utts, 0.6, 1.4, n_lengths=8, seed=1)
    rep.say(f"{'method, graph cache':<42}{'same transcripts':>14}{'max |dparam|':>14}  graph stats")
    res, ok = {}, True
    for name in GRAPH_METHODS:
        kw = dict(lr=1e-3, steps=3 if name == "csuta" else 4)   # csuta: N=1 would never capture
        if name.startswith("dsuta"):
            kw.update(buffer_size=3, reset_K=6)
        if name == "eata":      # no Fisher file; the tiny model is nearly uniform: a margin of
            kw.update(fisher_alpha=0.0, e_margin_factor=1.0, d_margin=0.9995)  # ln V, a tight cos
        if name == "sar":       # the same margin; a large ascent (some second passes stop)
            kw.update(e_margin_factor=1.0, rho=0.5)
        if name == "cea":       # two stages, their own optimisers and graphs
            kw.update(steps2=kw["steps"])
        a = _method(name, tiny, args.device, DEVICE_EAGER, **dict(kw))
        ha, _ = _process_all(a, wavs, args.device)
        # the methods added since the H100 run (eata, sar, cea): cache 4, buckets and the
        # default only; the default (auto): buckets 0.1 on CUDA, none on CPU
        variants = ((1, 1, 0.0), (4, 1, 0.0), (1, 0, 0.0), (4, 1, 0.25), ("auto", 1, "auto"))
        for cache, warmup, buckets in (variants if name in MEASURED_GRAPH_METHODS
                                       else variants[1::2] + variants[4:]):
            b = _method(name, tiny, args.device, dict(DEFAULT, cuda_graph_warmup=warmup,
                                                      cuda_graph_buckets=buckets),
                        cache=cache, **dict(kw))
            hb, _ = _process_all(b, wavs, args.device)
            same = sum(x == y for x, y in zip(ha, hb))
            diff = max(float((p.detach() - q.detach()).abs().max())
                       for p, q in zip(a.params, b.params))
            st = _stats(b)
            # buckets: the padded passes equal the unpadded ones to rounding, not bit for bit
            ok &= same == len(ha) and (args.cpu_smoke or st.get("replays", 0) > 0)
            label = (f"{name}, default" if buckets == "auto" else
                     f"{name}, {cache}{', warmup 0' if warmup == 0 else ''}"
                     f"{f', buckets {buckets:g}' if buckets else ''}")
            res[label] = dict(same=same, n=len(ha), max_param_diff=diff, eager=_stats(a),
                              graphs=st)
            rep.say(f"{label:<42}{same:>8}/{len(ha):<5}{diff:>14.2e}  {st}")
    rep.say("transcripts: " + ("OK (captured == device eager)" if ok else "MISMATCH or no replay"))
    rep.data["transcripts"] = dict(ok=ok, methods=res)


def _warm_step(args, model, runtime, wav):
    """One SUTA step on ``wav`` with ``runtime`` options, warm (4 steps first; captured: the
    capture among them): ms per step over 20, and the step's counts."""
    import torch
    m = _method("suta", model, args.device, runtime, lr=2e-5, steps=10)
    x = m.lobe.prepare(wav)
    with torch.enable_grad():
        for _ in range(4):
            m.adapt_step(x)
        _sync(args.device)
        n, t0 = 20, time.perf_counter()
        for _ in range(n):
            m.adapt_step(x)
        _sync(args.device)
        wall = (time.perf_counter() - t0) / n * 1e3
    m.predict(x)                                   # settles the step counters
    out = dict(ms_per_step=wall, stats=_stats(m))
    _release(m, args.device)
    return out


def section_step(args, rep, work):
    """One SUTA step, warm, at ``--seconds`` and ``--long_seconds``: eager, device eager and
    the default (captured on CUDA), ms per step. Whether a warm step's time grows with the audio
    tells a per-utterance fixed cost from a step that is bound by its kernels' count."""
    model = _base_model(work, args)
    cuda = args.device.startswith("cuda")
    res = {}
    for seconds in (args.seconds, args.long_seconds):
        x_wav = _wavs(1, seconds, seconds, seed=2)[0]
        row = res[f"{seconds:g}s"] = {}
        for tag, runtime in (("eager", EAGER), ("device eager", DEVICE_EAGER),
                             ("default", DEFAULT)):
            row[tag] = _warm_step(args, model, runtime, x_wav)
        size = "tiny" if args.cpu_smoke else "wav2vec2-base"
        ratio = row["eager"]["ms_per_step"] / max(row["default"]["ms_per_step"], 1e-9)
        rep.say(f"SUTA step, {seconds:.1f} s, random {size} model, fp32 (this run, "
                f"{'GPU' if cuda else 'CPU'}): "
                + ", ".join(f"{k} {v['ms_per_step']:.2f} ms" for k, v in row.items())
                + f" (eager / default x{ratio:.2f})")
        rep.say(f"  default: {row['default']['stats']}")
    rep.say(f"  ({EARLIER})")
    rep.data["step"] = res


def section_lengths(args, rep, work):
    """``tools/bench_speed.py --two_lengths``: s per utterance at two lengths (every utterance a
    new length, as on a real stream) and the intercept, with the default steps."""
    import bench_speed
    model = _base_model(work, args)
    common = ["--device", args.device, "--model", model, "--methods", "suta,dsuta+dynamic",
              "--two_lengths", f"{args.seconds},{args.long_seconds}"]
    common += (["--n_utts", "3", "--warmup", "2", "--suta_steps", "2", "--dsuta_steps", "2"]
               if args.cpu_smoke else ["--n_utts", "12", "--warmup", "8"])
    res = {}
    for tag, opts in (("eager", ["--cuda_graphs", "off"]), ("unbucketed", UNBUCKETED_OPTS),
                      ("default", [])):
        rep.say(f"--- bench_speed --two_lengths ({tag}: {' '.join(opts) or 'no options'}) ---")
        res[tag] = bench_speed.main(common + opts)
        for name, r in res[tag].items():
            (a1, t1), (a2, t2) = r["points"]
            rep.say(f"{name + ' ' + tag:<24} s/utt {t1:.4f} at {a1:.2f} s, {t2:.4f} at {a2:.2f} s: "
                    f"fixed {r['fixed_s_per_utt']:.4f} s/utt + {r['s_per_audio_s']:.4f} s/audio s")
    rep.say("fixed s/utt: the intercept of time = fixed + slope x audio seconds (a warm process, "
            "every utterance a new length)")
    rep.data["lengths"] = res


def _device_us(e):
    """An operator average's self device time in microseconds, across torch's renames."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


#: host calls that wait for the device or hand it work, counted per utterance by ``profile``
HOST_CALLS = ("cudaGraphLaunch", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaMemcpyAsync", "cudaLaunchKernel", "cudaEventSynchronize")


def _profiled(rep, label, n, run, cuda, tables=True):
    """``run()`` (one pass over ``n`` utterances, returning its seconds) under ``torch.profiler``
    and its report per utterance (``tables``: with the top host operators and kernels); the
    report's dict."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, acc_events=True) as prof:   # one cycle (no warning)
        wall = run()
    events = prof.key_averages()
    ms = lambda us: us / 1000.0 / n                       # noqa: E731 - ms per utterance
    # the kernels' own rows (a host operator's row repeats its kernels' device time)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and _device_us(e) > 0]
    gpu_ms = ms(sum(_device_us(e) for e in kernels))
    n_kernels = sum(e.count for e in kernels) / n
    res = dict(profiled_wall_s_per_utt=wall / n, gpu_kernel_ms_per_utt=gpu_ms,
               kernels_per_utt=n_kernels, host_calls={}, top_host=[], top_device=[])
    rep.say(f"{label}: {wall / n:.4f} s per utterance profiled; GPU kernels {gpu_ms:.1f} ms "
            f"per utterance ({gpu_ms / 1000 / (wall / n):.0%} of it), {n_kernels:.0f} kernels")
    if not tables:
        return res
    for name in HOST_CALLS:
        hit = [e for e in events if e.key == name]
        if hit:
            calls, us = sum(e.count for e in hit), sum(e.self_cpu_time_total for e in hit)
            res["host_calls"][name] = dict(per_utt=calls / n, ms_per_utt=ms(us))
            rep.say(f"  {name:<24} {calls / n:>8.1f} calls {ms(us):>8.2f} ms per utterance")
    rep.say(f"  {'top host operators (self)':<44}{'calls/utt':>10}{'ms/utt':>9}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
        res["top_host"].append((e.key, e.count / n, ms(e.self_cpu_time_total)))
        rep.say(f"  {e.key[:44]:<44}{e.count / n:>10.1f}{ms(e.self_cpu_time_total):>9.2f}")
    if cuda:
        rep.say(f"  {'top device kernels (self)':<44}{'calls/utt':>10}{'ms/utt':>9}")
        for e in sorted(kernels, key=lambda e: -_device_us(e))[:8]:
            res["top_device"].append((e.key, e.count / n, ms(_device_us(e))))
            rep.say(f"  {e.key[:44]:<44}{e.count / n:>10.1f}{ms(_device_us(e)):>9.2f}")
        # the positional convolution's weight norm: 11 calls, 3.7 ms per utterance on the H200
        # before frozen ones were computed once (lobes/weight_norm.py); replays included
        wn = [e for e in kernels if "weight_norm" in e.key]
        res["weight_norm_kernels"] = dict(per_utt=sum(e.count for e in wn) / n,
                                          ms_per_utt=ms(sum(_device_us(e) for e in wn)))
        rep.say(f"  weight-norm kernels: {res['weight_norm_kernels']['per_utt']:.1f} calls, "
                f"{res['weight_norm_kernels']['ms_per_utt']:.2f} ms per utterance")
    return res


def _by_operator(rep, label, n_steps, run, cuda, top=10):
    """``run()`` (``n_steps`` eager steps) under ``torch.profiler`` with the operators' input
    shapes: the operators that own the most time per step, with their shapes (which layer: the
    CNN's convolutions, the positional convolution's [1, 768, F] by [768, 48, 128], the
    transformer's matmuls). Device time (the operator's own kernels) on CUDA, host time on CPU."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True, acc_events=True) as prof:
        run()
    own = _device_us if cuda else (lambda e: float(e.self_cpu_time_total))
    rows = [e for e in prof.key_averages(group_by_input_shape=True)
            if own(e) > 0 and e.key.startswith("aten::")]
    total = sum(own(e) for e in rows) or 1.0
    rep.say(f"{label}: {total / 1000 / n_steps:.2f} ms of operators' own "
            f"{'device' if cuda else 'host'} time per step")
    rep.say(f"  {'operator':<34}{'input shapes':<48}{'calls/step':>11}{'ms/step':>9}{'share':>7}")
    res = []
    for e in sorted(rows, key=lambda e: -own(e))[:top]:
        shapes = ", ".join(str(list(s)) for s in (e.input_shapes or []) if s)[:47]
        res.append((e.key, shapes, e.count / n_steps, own(e) / 1000 / n_steps, own(e) / total))
        rep.say(f"  {e.key[:33]:<34}{shapes:<48}{e.count / n_steps:>11.1f}"
                f"{own(e) / 1000 / n_steps:>9.3f}{own(e) / total:>7.1%}")
    return res


def _phases(m, wavs, device):
    """Seconds per utterance of a method's phases (``process`` taken apart, a device sync after
    each): begin (the input on the device, the reset; continual: the reset policy's check and
    its LII forwards), the adaptation steps, the prediction (its one host copy), end (continual:
    the LII test, the slow step or a reset); and the wall of all four. A method with its own
    ``forward_and_adapt`` (DSUTA) has steps and prediction as one phase, ``adapt``."""
    import torch

    from tta_brain.methods import UttInfo
    from tta_brain.methods.base import TTAMethod
    split = type(m).forward_and_adapt is TTAMethod.forward_and_adapt
    tot = dict(begin=0.0, steps=0.0, predict=0.0, end=0.0) if split else dict(
        begin=0.0, adapt=0.0, end=0.0)
    _sync(device)
    t_all = time.perf_counter()
    for i, w in enumerate(wavs):
        t0 = time.perf_counter()
        with torch.enable_grad():
            x = m.begin(w, UttInfo(id=f"u{i}", position=i, domain="d"))
            _sync(device)
            t1 = time.perf_counter()
            if split:
                for k in range(m.steps):
                    m.before_step(k)
                    m.adapt_step(x)
                _sync(device)
                t2 = time.perf_counter()
                m.predict(x)
            else:
                m.forward_and_adapt(x, m.info)
                t2 = time.perf_counter()
            t3 = time.perf_counter()
            m.end(x)
            m.features.clear()
            m.t += 1
            _sync(device)
        t4 = time.perf_counter()
        parts = ((("steps", t1, t2), ("predict", t2, t3)) if split else (("adapt", t1, t3),))
        for k, a, b in (("begin", t0, t1),) + parts + (("end", t3, t4),):
            tot[k] += b - a
    wall = time.perf_counter() - t_all
    return dict({k: v / len(wavs) for k, v in tot.items()}, wall=wall / len(wavs))


def _suta_batch(model, device, runtime, R, steps):
    """A batch of ``R`` SUTA runs (learning rates 1e-5 .. R e-5) with ``runtime`` options."""
    from tta_brain.sweep import batch_for
    ms = [_method("suta", model, device, runtime, lr=1e-5 * (r + 1), steps=steps,
                  **({"cache": BUCKET_CACHE} if runtime is BUCKETS else {})) for r in range(R)]
    return batch_for(ms[0])(ms[0].lobe, ms)


def _batch_all(batch, wavs, device):
    """Seconds of a batch's pass over ``wavs`` (every run adapts and predicts each)."""
    from tta_brain.methods import UttInfo
    runs = list(range(len(batch.views)))
    _sync(device)
    t0 = time.perf_counter()
    for i, w in enumerate(wavs):
        batch.process(runs, w, UttInfo(id=f"u{i}", position=i, domain="d"))
        for v in batch.views:
            v.process(w)
    _sync(device)
    return time.perf_counter() - t0


def section_profile(args, rep, work):
    """Where a warm utterance's time goes, for the fixed cost per utterance the H200 left
    unexplained (2026-11-27: SUTA on length buckets 0.163 s per 3 s utterance, ten replayed
    steps) and for the batched sweep's 2x (target 3x): SUTA on buckets over utterances whose
    buckets it has met, timed, then the same under ``torch.profiler``; then a batch of 8 SUTA
    runs (the sweep section's learning rates) on buckets the same way. Per utterance: wall, the
    GPU's kernel time (busy share), the host calls that launch or wait (:data:`HOST_CALLS`), the
    top operators by host and by device time. Then the official parameter list (RepeatedAdam)
    the same way: its kernels a step against the clean list's. Then the eager step and the eager
    batch by operator with input shapes (:func:`_by_operator`): which layers own the step's
    kernel time and which operators the batch's layout conversions belong to."""
    model = _base_model(work, args)
    cuda = str(args.device).startswith("cuda")
    n, steps = (2 if args.cpu_smoke else 6), _steps(args, "suta")
    wavs = _wavs(n, 0.9 * args.seconds, 1.1 * args.seconds, seed=7)
    m = _method("suta", model, args.device, BUCKETS, cache=BUCKET_CACHE, lr=2e-5, steps=steps)
    _process_all(m, wavs, args.device)                    # every bucket met: replays from here
    _, wall = _process_all(m, wavs, args.device)
    phases = _phases(m, wavs, args.device)
    rep.say("suta on buckets, warm, s per utterance by phase (a sync after each): "
            + ", ".join(f"{k} {v:.4f}" for k, v in phases.items()))
    # DSUTA + dynamic reset (5 steps, buffer 5, K 10: the LII forwards and slow steps too), warm
    dyn = _method("dsuta+dynamic", model, args.device, BUCKETS, cache=BUCKET_CACHE, lr=2e-5,
                  steps=_steps(args, "dsuta"), buffer_size=5, reset_K=10)
    dwavs = _wavs(2 * n if args.cpu_smoke else 20, 0.9 * args.seconds, 1.1 * args.seconds,
                  seed=8)
    _process_all(dyn, dwavs, args.device)                 # its buckets met, phi_D saved
    dyn_phases = _phases(dyn, dwavs, args.device)
    rep.say("dsuta+dynamic on buckets, warm, s per utterance by phase: "
            + ", ".join(f"{k} {v:.4f}" for k, v in dyn_phases.items()) + f"; {_stats(dyn)}")
    _release(dyn, args.device)
    before, norms = m.step.cache.stats["captures"], _weight_norms(m.lobe)
    one = _profiled(rep, f"suta on buckets, {n} utterances of ~{args.seconds:.0f} s, {steps} "
                    f"steps (unprofiled {wall / n:.4f} s per utterance)", n,
                    lambda: _process_all(m, wavs, args.device)[1], cuda)
    one.update(n=n, seconds=args.seconds, wall_s_per_utt=wall / n, stats=_stats(m),
               phases=phases, dsuta_dynamic_phases=dyn_phases,
               captures_while_profiled=m.step.cache.stats["captures"] - before,
               weight_norms_while_profiled=_weight_norms(m.lobe) - norms)
    _release(m, args.device)
    # the official code's parameter list (RepeatedAdam on the device, the LS-C and CHiME-3
    # recipes' setting) against the clean list's fused AdamW: its extra kernels a step (its
    # restore and second bias correction over all tensors at once since 2026-11-28, about 8
    # kernels by torch's multi-tensor rules where they took 252; its multiply-add one a tensor)
    off = _method("suta@official", model, args.device, BUCKETS, cache=BUCKET_CACHE, lr=2e-5,
                  steps=steps)
    _process_all(off, wavs, args.device)
    _, wall_o = _process_all(off, wavs, args.device)
    one["official_list"] = _profiled(
        rep, f"suta@official (the official list: RepeatedAdam) on buckets, the same utterances "
        f"(unprofiled {wall_o / n:.4f} s per utterance)", n,
        lambda: _process_all(off, wavs, args.device)[1], cuda, tables=False)
    one["official_list"].update(wall_s_per_utt=wall_o / n, stats=_stats(off))
    _release(off, args.device)
    extra = (one["official_list"]["kernels_per_utt"] - one["kernels_per_utt"]) / steps
    one["official_list"]["extra_kernels_per_step"] = extra
    if cuda:
        rep.say(f"the official list: {extra:+.0f} kernels a step against the clean list "
                f"({one['official_list']['wall_s_per_utt'] / one['wall_s_per_utt']:.2f}x its "
                "wall per utterance)")
    # which operators (which layers) the step's time goes to: the eager step, shapes recorded
    # (a replay's kernels carry no operator), the first utterance n times (one row per layer)
    eager = _method("suta", model, args.device, EAGER, lr=2e-5, steps=steps)
    same = [wavs[0]] * n
    _process_all(eager, same[:1], args.device)
    one["by_operator"] = _by_operator(
        rep, f"suta eager, one utterance of {wavs[0].numel() / 16000:.2f} s {n} times, {steps} "
        "steps (and the prediction), by operator", n * steps,
        lambda: _process_all(eager, same, args.device), cuda)
    _release(eager, args.device)

    R = 2 if args.cpu_smoke else 8
    batch = _suta_batch(model, args.device, BUCKETS, R, steps)
    _batch_all(batch, wavs, args.device)
    wall_b = _batch_all(batch, wavs, args.device)
    graphs = batch.graphs
    captures = lambda: graphs.cache.stats["captures"] if graphs is not None else 0  # noqa: E731
    before = captures()
    many = _profiled(rep, f"a batch of {R} suta runs on buckets, the same utterances "
                     f"(unprofiled {wall_b / n:.4f} s per utterance for all {R})", n,
                     lambda: _batch_all(batch, wavs, args.device), cuda)
    many.update(R=R, wall_s_per_utt=wall_b / n,
                graphs=graphs.describe() if graphs is not None else "eager",
                captures_while_profiled=captures() - before)
    if graphs is not None:
        graphs.release()
    # the batch's operators (which ones own the layout conversions), eager, two utterances
    batch = None                                          # freed for the cache
    eager_batch = _suta_batch(model, args.device, EAGER, R, steps)
    _batch_all(eager_batch, same[:1], args.device)
    many["by_operator"] = _by_operator(
        rep, f"a batch of {R} suta runs eager, the same utterance twice, by operator",
        2 * steps, lambda: _batch_all(eager_batch, same[:2], args.device), cuda)
    eager_batch = None                                    # noqa: F841 - freed for the cache
    if cuda:
        import torch
        torch.cuda.empty_cache()
    rep.say(f"profile: {one['captures_while_profiled']} + {many['captures_while_profiled']} "
            f"captures while profiled; {one['weight_norms_while_profiled']} weight norms "
            "computed outside the graphs in the warm SUTA run (frozen ones are computed once, "
            "lobes/weight_norm.py); host ms are the calls' own time on the host thread, GPU "
            "kernel ms the kernels' time on the device (graph replays' kernels included where "
            "the profiler sees them); a wall far above both is the host's time between calls")
    rep.data["profile"] = dict(one, batch=many)


def section_deterministic(args, rep, work):
    import torch

    from tta_brain.lobes.runtime import deterministic_kernels
    model = _base_model(work, args)
    wavs = _wavs(2 if args.cpu_smoke else 8, 0.9 * args.seconds, 1.1 * args.seconds, seed=6)
    audio = sum(w.numel() for w in wavs) / 16000
    res, graphs = {}, {}

    def build(name, runtime):                  # SUTA; DSUTA + dynamic reset (buffer 5, K 10)
        kw = dict(lr=2e-5, steps=_steps(args, name.partition("+")[0]))
        if name.startswith("dsuta"):
            kw.update(buffer_size=5, reset_K=10)
        return _method(name, model, args.device, runtime, **kw)
    try:
        for name in ("suta", "dsuta+dynamic"):
            for tag, runtime in (("default", DEFAULT), ("eager", EAGER)):
                for on in (True, False):
                    deterministic_kernels(on)
                    m = build(name, runtime)
                    _process_all(m, wavs[:1], args.device)                  # warm-up
                    _, t = _process_all(m, wavs, args.device)
                    res[f"{name} {tag} deterministic={on}"] = t / audio
                    _release(m, args.device)
        # cuDNN's deterministic convolutions as its heuristics pick them (decode's default)
        # against the fastest deterministic ones its autotuner finds (cudnn.benchmark, not a run
        # option: its pick, and so the rounding, may change from process to process): the
        # default (captured) steps, every utterance once before the clock, so that the
        # autotuning of each new shape and the captures are behind both
        for name in ("suta", "dsuta+dynamic"):
            for tuned in (False, True):
                deterministic_kernels(True)
                torch.backends.cudnn.benchmark = tuned
                m = build(name, DEFAULT)
                _process_all(m, wavs, args.device)
                _, t = _process_all(m, wavs, args.device)
                res[f"{name} warm deterministic autotuned={tuned}"] = t / audio
                graphs[f"{name} autotuned={tuned}"] = _stats(m)   # a failed capture: eager
                _release(m, args.device)
    finally:
        deterministic_kernels(True)                 # the check's default, as decode's
    rep.say(f"{'method, steps':<24}{'deterministic':>14}{'default kernels':>17}{'price':>8}")
    for name in ("suta", "dsuta+dynamic"):
        for tag in ("default", "eager"):
            on, off = (res[f"{name} {tag} deterministic={b}"] for b in (True, False))
            rep.say(f"{name + ', ' + tag:<24}{on:>14.4f}{off:>17.4f}{on / max(off, 1e-12):>7.2f}x")
    rep.say("s per audio s; price = deterministic / default kernels (the run option "
            "--deterministic, default true)")
    rep.say(f"{'method, default steps':<24}{'heuristics':>14}{'autotuned':>17}{'gain':>8}")
    for name in ("suta", "dsuta+dynamic"):
        h, a = (res[f"{name} warm deterministic autotuned={b}"] for b in (False, True))
        g = graphs[f"{name} autotuned=True"]
        rep.say(f"{name + ', warm':<24}{h:>14.4f}{a:>17.4f}{h / max(a, 1e-12):>7.2f}x"
                f"  (autotuned: graphs {g.get('graphs')}, {g.get('replays', 0)} replays)")
    rep.say("s per audio s, deterministic kernels, every utterance met before the clock; "
            "autotuned: cudnn.benchmark among the deterministic algorithms (not a run option)")
    rep.data["deterministic"] = res
    rep.data["deterministic_autotuned_graphs"] = graphs


def section_convolutions(args, rep, work):
    """The CNN's convolutions as matrix products (``convolutions: gemm``, lobes/gemm_conv.py)
    against cuDNN's (``native``, the default), on the random base-sized model: one warm SUTA step
    (default: captured) at ``--seconds`` and ``--long_seconds``, also with TF32 matmuls (``tf32:
    on``: the products in TF32, as cuDNN's convolutions already run under the default ``torch``);
    SUTA and DSUTA + dynamic reset on length buckets over utterances they have met, s per audio s
    and how many transcripts equal the native run's; a warm batch of 8 SUTA runs (the batched
    sweep: vmap makes each convolution one batched product, no layout conversions), s per
    utterance."""
    from tta_brain.lobes.runtime import tf32_kernels
    model = _base_model(work, args)
    res = {"step": {}, "methods": {}, "batch": {}}
    arms = (("native", DEFAULT), ("gemm", GEMM))
    try:
        for seconds in (args.seconds, args.long_seconds):
            wav = _wavs(1, seconds, seconds, seed=2)[0]
            row = res["step"][f"{seconds:g}s"] = {}
            for tag, runtime in arms:
                row[tag] = _warm_step(args, model, runtime, wav)
            tf32_kernels("on")
            row["gemm, tf32 on"] = _warm_step(args, model, GEMM, wav)
            tf32_kernels("torch")
            ratio = row["native"]["ms_per_step"] / max(row["gemm"]["ms_per_step"], 1e-9)
            rep.say(f"SUTA step, {seconds:.1f} s (default step), ms: "
                    + ", ".join(f"{k} {v['ms_per_step']:.2f}" for k, v in row.items())
                    + f" (native / gemm x{ratio:.2f})")
        wavs = _wavs(2 if args.cpu_smoke else 8, 0.9 * args.seconds, 1.1 * args.seconds, seed=6)
        audio = sum(w.numel() for w in wavs) / 16000
        for name in ("suta", "dsuta+dynamic"):
            kw = dict(lr=2e-5, steps=_steps(args, name.partition("+")[0]))
            if name.startswith("dsuta"):
                kw.update(buffer_size=5, reset_K=10)
            hyps = {}
            for tag, runtime in arms:
                m = _method(name, model, args.device, dict(BUCKETS, **runtime),
                            cache=BUCKET_CACHE, **kw)
                first, _ = _process_all(m, wavs, args.device)       # every bucket met
                again, t = _process_all(m, wavs, args.device)
                hyps[tag] = first + again
                res["methods"][f"{name} {tag}"] = dict(s_per_audio_s=t / audio, stats=_stats(m))
                _release(m, args.device)
            same = sum(a == b for a, b in zip(hyps["native"], hyps["gemm"]))
            n, g = (res["methods"][f"{name} {t}"]["s_per_audio_s"] for t, _ in arms)
            res["methods"][f"{name} same transcripts"] = [same, len(hyps["native"])]
            rep.say(f"{name} on buckets, warm, s per audio s: native {n:.4f}, gemm {g:.4f} "
                    f"(x{n / max(g, 1e-12):.2f}); {same}/{len(hyps['native'])} transcripts alike")
        R = 2 if args.cpu_smoke else 8
        for tag, runtime in arms:
            batch = _suta_batch(model, args.device, dict(BUCKETS, **runtime), R,
                                _steps(args, "suta"))
            _batch_all(batch, wavs[:3], args.device)
            res["batch"][tag] = _batch_all(batch, wavs[:3], args.device) / 3
            if batch.graphs is not None:
                batch.graphs.release()
            batch = None                                   # noqa: F841 - freed for the next
        n, g = res["batch"]["native"], res["batch"]["gemm"]
        rep.say(f"a batch of {R} suta runs on buckets, warm, s per utterance: native {n:.4f}, "
                f"gemm {g:.4f} (x{n / max(g, 1e-12):.2f})")
    finally:
        tf32_kernels("torch")                      # the check's default, as decode's
    rep.say("native: cuDNN's convolutions (the default; TF32 under tf32: torch); gemm: "
            "--convolutions=gemm (fp32 products under tf32: torch, TF32 under on); transcripts "
            "alike: the same utterances' two passes, native against gemm (the same sums in "
            "another order)")
    rep.data["convolutions"] = res


def section_bench(args, rep, work):
    import bench_speed
    common = ["--device", args.device, "--n_utts", "4", "--repeats", "2",
              "--warmup", "2", "--seconds", str(args.seconds),
              "--methods", "source,suta,dsuta,dsuta+dynamic"]
    common += ["--model", _tiny_model(work), "--n_utts", "2", "--repeats", "1",
               "--warmup", "1", "--suta_steps", "2", "--dsuta_steps", "2"] if args.cpu_smoke \
        else ["--w2v2_base"]
    res = {}
    for tag, mode in (("eager", "off"), ("default", "auto")):
        rep.say(f"--- bench_speed ({tag}: --cuda_graphs {mode}) ---")
        res[tag] = bench_speed.main(common + ["--json", os.path.join(work, f"bench_{tag}.json"),
                                              "--cuda_graphs", mode])
    rep.say(f"{'method':<16}{'eager s/aud s':>15}{'default':>11}{'speed-up':>10}")
    for m in res["eager"]:
        e, c = res["eager"][m]["wall"]["s_per_audio_s"], res["default"][m]["wall"]["s_per_audio_s"]
        rep.say(f"{m:<16}{e:>15.4f}{c:>11.4f}{e / max(c, 1e-12):>9.2f}x")
    rep.data["bench"] = {t: {m: r["wall"]["s_per_audio_s"] for m, r in v.items()}
                         for t, v in res.items()}


def section_decode(args, rep, work):
    import bench_memory
    from tta_brain import decode
    model = _base_model(work, args)
    data = os.path.join(work, "decode_data")
    secs = (0.6, 1.2) if args.cpu_smoke else (2.0, 4.0)
    rows = bench_memory.make_audio(data, args.decode_utts, secs, block=8, n_lengths=0)
    stream = os.path.join(data, "stream.csv")
    bench_memory.write_stream(stream, rows)
    dsuta = ["--steps=5", "--buffer_size=5"]
    runs = [("source", "source", []), ("suta", "suta", []), ("dsuta", "dsuta", dsuta),
            ("dsuta+dynamic", "dsuta", dsuta + ["--reset=dynamic", "--reset_K=10"])]
    if args.cpu_smoke:                             # the plumbing only
        runs = runs[1::2]
    res = {}
    rep.say(f"{'run':<24}{'run s':>8}{'method s':>10}{'audio s':>9}{'s/aud s':>9}  transcripts")
    for tag, hp, extra in runs:
        for mode in ("off", "auto"):
            name = f"{tag} {'default' if mode == 'auto' else 'eager'}"
            out = os.path.join(work, "decode", f"{tag}_{mode}")
            argv = [hp, f"--source={model}", f"--stream_csv={stream}", f"--output_folder={out}",
                    f"--data_root={data}", f"--device={args.device}", "--noprogressbar",
                    "--overwrite", f"--cuda_graphs={mode}", *extra]
            t0 = time.perf_counter()
            try:
                s = decode.main(argv)
            except SystemExit as e:
                rep.say(f"{name:<24} FAILED: {e}")
                res[name] = dict(failed=str(e))
                continue
            wall = time.perf_counter() - t0
            with open(os.path.join(out, "transcripts.csv")) as f:
                hyps = [line.rstrip("\n") for line in f][1:]
            same = ""
            if mode == "auto" and f"{tag} eager" in res and "hyps" in res[f"{tag} eager"]:
                ref = res[f"{tag} eager"]["hyps"]
                same = f"{sum(a == b for a, b in zip(ref, hyps))}/{len(hyps)} rows as eager"
            res[name] = dict(run_s=wall, method_s=s.wall_time_s, audio_s=s.audio_s,
                             s_per_audio_s=s.time_per_audio_s, device=s.device, hyps=hyps)
            rep.say(f"{name:<24}{wall:>8.1f}{s.wall_time_s:>10.2f}{s.audio_s:>9.1f}"
                    f"{s.time_per_audio_s:>9.4f}  {same}")
    rep.say("run s includes loading the model; method s = adapt + predict (summary.json); the "
            "eager path rounds differently (foreach vs fused AdamW)")
    rep.data["decode"] = {k: {kk: vv for kk, vv in v.items() if kk != "hyps"}
                          for k, v in res.items()}


def _memory_mb(device):
    """(allocated, reserved) CUDA MB, or (RSS, RSS) on CPU (the smoke test)."""
    import torch
    if str(device).startswith("cuda"):
        return (torch.cuda.memory_allocated(device) / 2 ** 20,
                torch.cuda.memory_reserved(device) / 2 ** 20)
    import bench_memory
    rss = bench_memory.rss_mb() or 0.0
    return rss, rss


def section_memory(args, rep, work):
    import bench_memory
    from tta_brain.methods import UttInfo
    model = _base_model(work, args)
    n, every = args.memory_utts, max(1, args.memory_utts // 20)
    lo, hi = (0.5, 1.0) if args.cpu_smoke else (1.0, 3.0)
    buckets = args.memory_runtime != "unbucketed"
    runtime = dict(BUCKETS, **GEMM) if args.memory_runtime == "gemm" else (
        BUCKETS if buckets else UNBUCKETED)
    m = _method("dsuta", model, args.device, runtime,
                cache=BUCKET_CACHE if buckets else 1, lr=2e-5, steps=_steps(args, "dsuta"),
                buffer_size=5)
    marks, trace = {}, []
    wavs = _wavs(n, lo, hi, seed=3)                            # n distinct lengths
    half, audio_half = n // 2, sum(w.numel() for w in wavs[n // 2:]) / 16000
    t_half = None
    for i, w in enumerate(wavs):
        if i == half:
            _sync(args.device)
            t_half = time.perf_counter()
        m.process(w, UttInfo(id=f"m{i}", position=i, domain="d"))
        if (i + 1) % every == 0:
            _sync(args.device)
            alloc, reserved = _memory_mb(args.device)
            marks[i + 1] = (round(alloc, 1), round(reserved, 1))
            trace.append(reserved)
    _sync(args.device)
    # the second half's speed: a long stream's, once its buckets are warm (the marks' syncs
    # included: one every ``every`` utterances)
    rate = (time.perf_counter() - t_half) / audio_half
    # the slope per 100 utterances over the second half of the marks
    slope = bench_memory.tail_slope(trace) / every if len(trace) >= 4 else float("nan")
    flat = slope == slope and slope < 1.0
    verdict = "no verdict in the smoke test" if args.cpu_smoke else "FLAT" if flat else "GROWS"
    what = "reserved CUDA" if args.device.startswith("cuda") else "RSS (CPU smoke test)"
    rep.say(f"dsuta {args.memory_runtime}, {n} utterances of distinct lengths ({lo}-{hi} s): "
            f"(allocated, reserved) MB every {every}: "
            + ", ".join(f"{k}: {v}" for k, v in marks.items()))
    rep.say(f"memory: {what} slope over the last half {slope:+.3f} MB per 100 utterances "
            f"({verdict}); {_stats(m)}")
    rep.say(f"speed over the last {n - half} utterances ({audio_half:.0f} audio s): "
            f"{rate:.4f} s per audio s (dsuta, {_steps(args, 'dsuta')} steps, buffer 5)")
    rep.data["memory"] = dict(runtime=args.memory_runtime, marks=marks, slope_mb_per_100=slope,
                              flat=flat, stats=_stats(m), s_per_audio_s_second_half=rate)
    _release(m, args.device)

# The official code's runs of SUTA and DSUTA + dynamic reset (its config files; steps 10 and 5,
# buffer 5, patience 2), with K small so that a short stream reaches the detection stage.
OFFICIAL_RUNS = (("suta", "SUTAStrategy", "basic", ["10step.yaml"], {}, []),
                 ("dsuta+dynamic", "DSUTAResetStrategy", "dsuta_reset",
                  ["dynamic-reset.yaml", "5step.yaml"], {"K": 10},
                  ["--steps=5", "--buffer_size=5", "--reset=dynamic", "--reset_K=10"]))


class _NoCuda:
    """CPU smoke test only: the official code calls ``model.cuda()``; make it a no-op."""

    def __enter__(self):
        import torch
        self.orig = torch.nn.Module.cuda
        torch.nn.Module.cuda = lambda mod, *a, **k: mod
        return self

    def __exit__(self, *exc):
        import torch
        torch.nn.Module.cuda = self.orig


def _same_rows(work, a, b):
    """(same, n): transcript rows of two of ``official``'s decodes that agree."""
    rows = []
    for tag in (a, b):
        with open(os.path.join(work, "official_ours", tag, "transcripts.csv")) as f:
            rows.append(f.read().splitlines()[1:])
    return sum(x == y for x, y in zip(*rows)), len(rows[0])


def _official_run(args, cls_name, module, strategy_files, extra, model, wavs):
    """Seconds of the official strategy's ``run`` over ``wavs`` (model loading not timed); the
    official code reads ``vocab.json`` from the working directory and runs PyTorch's default
    kernels, as it does in its own repository."""
    import importlib
    import contextlib
    import yaml
    from tta_brain.lobes.runtime import deterministic_kernels
    od = args.official_dir
    if od not in sys.path:
        sys.path.insert(0, od)
    mod = importlib.import_module(f"src.strategies.{module}")
    with open(os.path.join(od, "config", "system", "suta.yaml")) as f:
        system = dict(yaml.safe_load(f), model_name=model)
    strategy = {}
    for name in strategy_files:
        with open(os.path.join(od, "config", "strategy", name)) as f:
            strategy.update(yaml.safe_load(f))
    strategy.update(extra)
    if args.cpu_smoke:                             # the plumbing only
        strategy["steps"] = 2
    ds = [{"wav": w.numpy(), "text": "A B", "id": f"o{i}"} for i, w in enumerate(wavs)]
    cwd = os.getcwd()
    deterministic_kernels(False)
    try:
        os.chdir(od)
        with (_NoCuda() if args.cpu_smoke else contextlib.nullcontext()), \
                open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
                contextlib.redirect_stderr(null):
            strat = getattr(mod, cls_name)({"system_config": system, "strategy_config": strategy})
            if not args.cpu_smoke:                         # warm-up on its own copy
                strat.run(ds[:2])
                strat = getattr(mod, cls_name)({"system_config": system,
                                                "strategy_config": strategy})
            _sync(args.device)
            t0 = time.perf_counter()
            out = strat.run(ds)
            _sync(args.device)
            wall = time.perf_counter() - t0
    finally:
        os.chdir(cwd)
        deterministic_kernels(True)
    del strat
    return wall, [t for _, t in out["transcriptions"]]


def _method_loop(args, tag, model, wavs):
    """Seconds of ``process()`` over ``wavs`` with the run's settings (default steps): (warm,
    fresh). Warm: the method object has first processed two of them (the benchmark's
    measurement: its first eager steps and those buckets' captures are behind it); fresh: a new
    method object in the same process, which starts cold as a decode run's does (its warm-up and
    captures timed), so decode against it is the decode path's own cost."""
    kw = dict(lr=2e-5, steps=2 if args.cpu_smoke else (5 if tag.startswith("dsuta") else 10))
    if tag.startswith("dsuta"):
        kw.update(buffer_size=5, reset_K=10)
    m = _method(tag, model, args.device, DEFAULT, **kw)
    _process_all(m, wavs[:2], args.device)
    _, warm = _process_all(m, wavs, args.device)
    _release(m, args.device)
    m = _method(tag, model, args.device, DEFAULT, **kw)
    _, fresh = _process_all(m, wavs, args.device)
    _release(m, args.device)
    return warm, fresh


def _ours_decode(args, work, tag, hp, extra, model, stream, data):
    """Our run command on the same stream (its default options); (method s, run s)."""
    from tta_brain import decode
    out = os.path.join(work, "official_ours", tag)
    argv = [hp, f"--source={model}", f"--stream_csv={stream}", f"--output_folder={out}",
            f"--data_root={data}", f"--device={args.device}", "--noprogressbar", "--overwrite",
            *extra]
    t0 = time.perf_counter()
    s = decode.main(argv)
    return s.wall_time_s, time.perf_counter() - t0


def section_official(args, rep, work):
    """The official code (``--official_dir``) and ours in this process on the same GPU, model
    (the random wav2vec2-base-sized one) and utterances, at ``--seconds`` and
    ``--long_seconds``: s per audio s and our speed-up. Ours is ``python -m tta_brain.decode``
    with its defaults (method time from summary.json; the run's own model loading excluded, as
    the official side's is)."""
    import bench_memory
    import soundfile as sf
    import torch
    have = os.path.isfile(os.path.join(args.official_dir, "src", "strategies", "basic.py"))
    if not have:
        rep.say(f"official code not found in {args.official_dir} (a checkout of "
                "hhhaaahhhaa/Dynamic-SUTA, --official_dir): ours only")
    model = _base_model(work, args)
    res = {}
    lengths = (args.seconds,) if args.cpu_smoke else (args.seconds, args.long_seconds)
    rep.say(f"{'method, length':<26}{'official s/aud s':>17}{'ours s/aud s':>14}{'speed-up':>10}"
            f"{'loop s/aud s':>14}{'decode':>10}{'fresh loop':>12}{'decode':>10}"
            f"{'gemm convs':>12}{'speed-up':>10}{'long stream':>13}{'speed-up':>10}"
            f"{'warm-up 0':>11}{'speed-up':>10}{'official list':>15}{'speed-up':>10}")
    for li, sec in enumerate(lengths):
        data = os.path.join(work, f"official_data_{li}")
        n = 2 if args.cpu_smoke else (24 if sec < 5 else 16)
        rows = bench_memory.make_audio(data, n, (0.9 * sec, 1.1 * sec), block=n, n_lengths=0,
                                       seed=10 + li)
        stream = os.path.join(data, "stream.csv")
        bench_memory.write_stream(stream, rows)
        wavs = [torch.from_numpy(sf.read(os.path.join(data, "wav", f"{r['ID']}.wav"),
                                         dtype="float32")[0]) for r in rows]
        audio = sum(w.numel() for w in wavs) / 16000
        # the long stream: ours alone (the official code's eager step costs the same at every
        # utterance, so its rate above stands); there our graphs' captures are paid off
        n_long = 3 if args.cpu_smoke else max(1, round(args.long_stream_s / sec))
        long_data = os.path.join(work, f"official_long_{li}")
        long_rows = bench_memory.make_audio(long_data, n_long, (0.9 * sec, 1.1 * sec),
                                            block=n_long, n_lengths=0, seed=20 + li)
        long_stream = os.path.join(long_data, "stream.csv")
        bench_memory.write_stream(long_stream, long_rows)
        long_audio = sum(float(r["duration"]) for r in long_rows)
        for tag, cls_name, module, files, extra, ours_opts in OFFICIAL_RUNS:
            hp = tag.partition("+")[0]
            off = None
            if have:
                try:
                    wall, _ = _official_run(args, cls_name, module, files, extra, model, wavs)
                    off = wall / audio
                except Exception as e:              # noqa: BLE001 - report, go on with ours
                    rep.say(f"official {tag} FAILED: {type(e).__name__}: {e}")
            steps = ["--steps=2"] if args.cpu_smoke else []
            if not args.cpu_smoke:                         # a warm process, as the official
                _ours_decode(args, work, f"{tag}_warm{li}", hp, ours_opts + steps, model,
                             stream, data)
            meth, run_s = _ours_decode(args, work, f"{tag}_{li}", hp, ours_opts + steps, model,
                                       stream, data)
            ours = meth / audio
            loop, fresh = (t / audio for t in _method_loop(args, tag, model, wavs))
            # the CNN's convolutions as matrix products (the candidate for a faster step: cuDNN's
            # took about half of the H200's kernel time); its transcripts against the default's
            gopts = ours_opts + steps + DECODE_GEMM_OPTS
            try:                    # never run on a GPU yet: a failure is this column's alone
                gmeth, _ = _ours_decode(args, work, f"{tag}_g{li}", hp, gopts, model, stream,
                                        data)
                gemm, gsame = gmeth / audio, _same_rows(work, f"{tag}_{li}", f"{tag}_g{li}")
            except (Exception, SystemExit) as e:          # noqa: BLE001 - report, go on
                rep.say(f"ours {tag} {' '.join(DECODE_GEMM_OPTS)} FAILED: {type(e).__name__}: "
                        f"{e}")
                gemm, gsame = float("nan"), (0, 0)
            # the candidate for a smaller cold start: a new bucket captured without its own
            # eager warm-up step once the run is warm (cuda_graph_warmup 0)
            wmeth, _ = _ours_decode(args, work, f"{tag}_w{li}", hp,
                                    ours_opts + steps + DECODE_WARMUP0_OPTS, model, stream, data)
            w0 = wmeth / audio
            # the recipes' setting: the official code's parameter list (RepeatedAdam on the
            # device), the same optimiser entries as the official run beside it
            ometh, _ = _ours_decode(args, work, f"{tag}_o{li}", hp,
                                    ours_opts + steps + DECODE_OFFICIAL_LIST_OPTS, model, stream,
                                    data)
            olist = ometh / audio
            lmeth, _ = _ours_decode(args, work, f"{tag}_long{li}", hp, ours_opts + steps, model,
                                    long_stream, long_data)
            lng = lmeth / long_audio
            key = f"{tag}, {sec:.0f} s"
            res[key] = dict(official=off, ours=ours, ours_run_s=run_s, audio_s=audio, n=n,
                            method_loop=loop, decode_over_loop=ours / loop,
                            fresh_loop=fresh, decode_over_fresh_loop=ours / fresh, gemm=gemm,
                            gemm_same_transcripts=gsame,
                            warmup0=w0, official_list=olist,
                            long_stream=lng, long_n=n_long, long_audio_s=long_audio)
            ups = [f"{off / v:>9.2f}x" if off else f"{'-':>10}"
                   for v in (ours, gemm, lng, w0, olist)]
            rep.say(f"{key:<26}{off if off else float('nan'):>17.4f}{ours:>14.4f}{ups[0]}"
                    f"{loop:>14.4f}{ours / loop - 1:>+10.0%}"
                    f"{fresh:>12.4f}{ours / fresh - 1:>+10.0%}"
                    f"{gemm:>12.4f}{ups[1]}{lng:>13.4f}{ups[2]}{w0:>11.4f}{ups[3]}"
                    f"{olist:>15.4f}{ups[4]}  gemm: {gsame[0]}/{gsame[1]} transcripts as ours")
    rep.say("official: its strategy's run() (model loading not timed), PyTorch's default kernels; "
            "ours: decode with its defaults (captured steps on length buckets on CUDA, "
            "--deterministic true); each side warmed up on its own first; loop: the same method "
            "object's process() over the same utterances in this process after two of them (what "
            "bench_speed times), and decode's time over it (issue #22: within 10 %); fresh loop: "
            "the same with a new method object, cold as decode's (decode over it: the decode "
            "path's own cost); gemm convs: decode with its defaults and "
            + " ".join(DECODE_GEMM_OPTS) + " (the CNN's convolutions as matrix products, "
            "lobes/gemm_conv.py; its transcripts against ours: the same sums in another order); "
            "long stream: decode with its defaults on "
            f"a stream of about {args.long_stream_s:.0f} audio s of the same lengths (each "
            "decode captures its own graphs; a long stream pays them off), its speed-up over the "
            "official rate of the short stream; warm-up 0: decode with its defaults and "
            + " ".join(DECODE_WARMUP0_OPTS) + " on the short stream (a new bucket captured "
            "without an eager step of its own once the run has taken its first 3); official "
            "list: decode with its defaults and " + " ".join(DECODE_OFFICIAL_LIST_OPTS) + " (the "
            "LS-C and CHiME-3 recipes' setting: the official code's optimiser entries, "
            "RepeatedAdam on the device) on the short stream")
    rep.data["official"] = res


FIELD_METHODS = "source,suta,tent,eata,sar,cotta,cea,lame,t3a,foa,ebats"
#: the field's gradient methods with one step per utterance (captured only on length buckets)
ONE_STEP = "tent,eata,sar"


def section_field(args, rep, work):
    """The field's methods' s per audio s on the random base-sized model (bench_speed), and the
    CMA-ES population batched vs one candidate at a time (E-BATS, FOA)."""
    import bench_speed
    model = _base_model(work, args)
    common = ["--device", args.device, "--model", model, "--methods", FIELD_METHODS,
              "--seconds", str(args.seconds), "--cuda_graphs", "auto"]
    common += (["--n_utts", "2", "--repeats", "1", "--warmup", "1", "--suta_steps", "2"]
               if args.cpu_smoke else ["--n_utts", "2", "--repeats", "1", "--warmup", "1"])
    rep.say("--- bench_speed, the field's methods (default options: on CUDA the captured steps "
            "on length buckets) ---")
    res = bench_speed.main(common + ["--json", os.path.join(work, "bench_field.json")])
    rep.say(f"{'method':<12}{'s/aud s':>10}")
    for m, r in res.items():
        rep.say(f"{m:<12}{r['wall']['s_per_audio_s']:>10.4f}")
    # one step per utterance: without buckets a new length runs eagerly (a capture would serve
    # one step), so the default's buckets are what captures them
    rep.say(f"--- bench_speed, {ONE_STEP} without length buckets ({' '.join(UNBUCKETED_OPTS)}) "
            "---")
    unbucketed = bench_speed.main(
        ["--device", args.device, "--model", model, "--methods", ONE_STEP,
         "--seconds", str(args.seconds), "--cuda_graphs", "auto", *UNBUCKETED_OPTS]
        + (["--n_utts", "2", "--repeats", "1", "--warmup", "1"] if args.cpu_smoke
           else ["--n_utts", "6", "--repeats", "1", "--warmup", "4"]))
    rep.say(f"{'method':<12}{'s/aud s':>10}{'default (buckets) speed-up':>28}")
    for m, r in unbucketed.items():
        base = res.get(m, {}).get("wall", {}).get("s_per_audio_s")
        value = r["wall"]["s_per_audio_s"]
        rep.say(f"{m:<12}{value:>10.4f}" + (f"{value / max(base, 1e-12):>27.2f}x" if base else ""))
    pop = ["--device", args.device, "--model", model, "--population", "--seconds",
           str(args.seconds)] + (["--n_utts", "1"] if args.cpu_smoke else ["--n_utts", "2"])
    rep.say("--- bench_speed --population (E-BATS, FOA: batched vs one at a time) ---")
    popres = bench_speed.main(pop)
    for name, modes in popres.items():
        for mode, r in modes.items():
            rep.say(f"{name} {mode:<15}{r['s_per_audio_s']:>9.4f} s/aud s, batched x"
                    f"{r['speedup_of_batched_wall']:.1f} faster, same transcripts: "
                    f"{r['same_transcripts']}")
    rep.data["field"] = dict(s_per_audio_s={m: r["wall"]["s_per_audio_s"] for m, r in res.items()},
                             unbucketed={m: r["wall"]["s_per_audio_s"]
                                         for m, r in unbucketed.items()},
                             population=popres)


def section_sweep(args, rep, work):
    import bench_memory
    import bench_sweep
    model = _base_model(work, args)
    data = os.path.join(work, "sweep_data")
    runs, steps = (2, 2) if args.cpu_smoke else (8, 10)
    secs = (0.6, 1.2) if args.cpu_smoke else (2.0, 4.0)
    rows = bench_memory.make_audio(data, args.sweep_utts, secs, block=8, n_lengths=0)
    stream = os.path.join(data, "stream.csv")
    bench_memory.write_stream(stream, rows)
    method, opts = "suta", ()
    if args.sweep_method == "dsuta+dynamic":
        method, opts = "dsuta", ("--reset=dynamic", "--buffer_size=2",
                                 f"--reset_K={max(4, args.sweep_utts // 3)}")
    elif args.sweep_method == "eata":           # every step kept, no Fisher term (bench_sweep)
        method, opts = "eata", ("--e_margin_factor=1.0", "--d_margin=1.01", "--fisher_alpha=0")
    elif args.sweep_method == "sar":            # no pass filtered
        method, opts = "sar", ("--e_margin_factor=1.01",)
    elif args.sweep_method == "cotta":          # its defaults (32 augmented teacher views)
        method, opts = "cotta", ()
    elif args.sweep_method in ("cea", "sgem", "sdpl"):   # their defaults (CEA: 10 + 10 steps)
        method, opts = args.sweep_method, ()
    elif args.sweep_method == "awmc":           # eval mode: the model's dropout is not batched
        method, opts = "awmc", ("--train_mode=false",)
    elif args.sweep_method in bench_sweep.FREE:  # each run its own seed, k or filter
        from types import SimpleNamespace
        from bench_speed import field_stats
        from tta_brain.lobes.hf_ctc import HFCTCLobe
        method, opts = args.sweep_method, tuple(f"--{k}={v}" for k, v in field_stats(
            args.sweep_method, HFCTCLobe(model), SimpleNamespace(seconds=secs[1], seed=0)).items())
    if args.sweep_unbucketed:
        opts = tuple(opts) + tuple(DECODE_UNBUCKETED_OPTS)
    res = bench_sweep.gpu_bench(model, stream, data, os.path.join(work, "sweep"), args.device,
                                runs=runs, steps=steps, method=method, opts=opts)
    res["method"] = args.sweep_method + (" without length buckets" if args.sweep_unbucketed
                                         else "")
    for arm in ("separate", "batched", "batched_eager"):
        r = res[arm]
        rep.say(f"{runs} {args.sweep_method} runs {arm:<13}: {r['audio_s']:.1f} audio s in "
                f"{r['loop_s']:.1f} s of decode loops ({r['audio_per_s_loop']:.1f} audio s/s), "
                f"{r['wall_s']:.1f} s wall ({r['audio_per_s_wall']:.1f} audio s/s)"
                + (f"; graphs: {r['graphs']}" if r.get("graphs") else ""))
    rep.say(f"batched / separate throughput: {res['ratio_loop']:.2f}x (decode loops), "
            f"{res['ratio_wall']:.2f}x (wall); {res['same_runs']}/{runs} runs with the same "
            f"transcripts (the batched step rounds differently; eager vs captured steps)")
    rep.say(f"batched, captured / eager steps: {res['captured_over_eager']:.2f}x (decode loops); "
            f"{res['same_runs_captured_eager']}/{runs} runs with the same transcripts")
    rep.data["sweep"] = res


def main(argv=None):
    args = parse_args(argv)
    why = preflight(args.device)
    if why:
        print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    import torch
    from tta_brain.lobes.runtime import process_settings
    # decode's defaults (--deterministic, --tf32; the preflight's speechbrain import had turned
    # TF32 matmuls on)
    kernels = process_settings(args.device, True, "torch")
    name = ("CPU smoke test (no figures)" if args.cpu_smoke
            else torch.cuda.get_device_name(args.device))
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    rep = Report(args.out)
    t_start = time.perf_counter()
    rep.say(f"gpu_check: {name}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}; sections {', '.join(args.sections)}; budget "
            f"{args.budget_s:.0f} s")
    rep.say("sizes: " + ", ".join(f"{k} {getattr(args, k):g}" for k in GPU_DEFAULTS if k != "device")
            + (" (--cpu_smoke set those not given)" if args.cpu_smoke else ""))
    rep.say("All figures below are from this run; nothing here is the earlier H200 measurement "
            f"unless labelled so. Kernels as decode's defaults: deterministic {kernels}.")
    rep.data["device"] = name
    status = {}
    for name in args.sections:
        spent = time.perf_counter() - t_start
        if spent + (0 if args.cpu_smoke else COST[name]) > args.budget_s:
            rep.say(f"\n== {name}: SKIPPED (budget: {spent:.0f} s spent, ~{COST[name]} s needed)")
            status[name] = "skipped"
            continue
        rep.say(f"\n== {name}")
        t0 = time.perf_counter()
        try:
            globals()[f"section_{name}"](args, rep, work)
            status[name] = "done"
        except Exception as e:                    # noqa: BLE001 - report it, go on
            import traceback
            rep.say(f"{name} FAILED: {type(e).__name__}: {e}")
            rep.data[f"{name}_traceback"] = traceback.format_exc()
            status[name] = "failed"
        rep.data.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        rep.say(f"({name}: {time.perf_counter() - t0:.0f} s)")
        rep.save()
    rep.data["status"] = status
    rep.say(f"\ngpu_check: {status} in {time.perf_counter() - t_start:.0f} s")
    rep.save()
    return 0 if all(v == "done" for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
