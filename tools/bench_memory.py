#!/usr/bin/env python3
"""Memory benchmark: peak memory of a full decode (``tta_brain.decode``) vs the stream length.

For every length N (default 50, 100, 200, 400 utterances) a fresh process decodes the first N
utterances of one generated two-domain stream with dsuta + dynamic reset (checkpoints, record
CSVs, summary: the whole recipe path) and reports

* peak RSS of the process (``VmHWM``), and its RSS at the end;
* RSS right after utterance 50, 100, 200, ... (the state carried along the stream);
* on CUDA, the peak of allocated and reserved device memory (``torch.cuda.max_memory_*``).

Nothing per utterance beyond the written records should be kept, so all figures stay flat.

Utterance lengths: by default every utterance has its own length, as in a real corpus
(``--n_lengths 8`` cycles through 8 durations instead). Each new length makes the CPU kernels build
and cache new shape-keyed set-ups (oneDNN's primitive cache and ideep's convolution cache, 1024
entries each by default), and the RSS crept up with them, in tta-brain and in the ``--control``
loop alike. ``tta_brain.decode`` and ``TTAStream`` therefore bound both caches to 64 entries
(``runtime.bound_kernel_caches``; a value the user exports wins). Measured on the 2-core CI
machine, 2,000 random-length utterances, generated model, dsuta + dynamic (the defaults below),
median RSS per 200-utterance window and the tail slope::

    caches at 1024 (before)   768, 786, 795, 802, 805, 806, 809, 810, 811, 811 MiB   +0.72 MiB/100 utts
    caches at 64 (default)    753, 754, 755, 756, 756, 755, 755, 756, 755, 756 MiB   +0.06 MiB/100 utts
    control loop, 1024        731, 750, 767, 777, 780, 783, 786, 786, 789, 792 MiB   +1.07 MiB/100 utts
    control loop, 64          719, 725, 727, 728, 729, 729, 729, 729, 730, 730 MiB   +0.10 MiB/100 utts

(the control is the same model, inputs and steps in a plain loop without tta-brain; the control at
64 also traced the Python heap, hence its lower level is not comparable; oneDNN off altogether,
``--mkldnn off``, is flat as well). The bound changes no transcript (tests/test_brain.py) and no speed we could measure: 400
utterances with the synthetic source model took 43.1 / 44.7 s bounded and 53.7 / 44.1 s at 1024
(alternating runs). The last line of the output says GROWS when the longest run's peak RSS exceeds
the shortest one's by more than ``--tolerance_mb`` or, from ``2 x --window`` utterances on, the
slope of its second half exceeds ``--slope_tolerance`` (exit status 1 then).

Usage::

    python tools/bench_memory.py                                   # CPU, generated tiny model
    python tools/bench_memory.py --lengths 50 100 200 400 800 --device cuda:0
    python tools/bench_memory.py --source /models/wav2vec2-base-960h --seconds 2 6 --device cuda:0
    python tools/bench_memory.py --decode_opts "--reset=dynamic --steps=5 --reset_K=50"

A generated model is a randomly initialised Wav2Vec2ForCTC (``--hidden``, ``--layers``) with the
wav2vec2-base-960h vocabulary; the audio is speech-like synthetic signal (harmonics under a
syllable-rate envelope), every other block of ``--block`` utterances with loud added noise.
"""
import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench_args import at_least, device, output_file, positive  # noqa: E402
from tta_brain.lobes.testing import save_random_ctc_model  # noqa: E402
WORDS = ("ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL")
SR = 16000
#: environment variables that change the memory behaviour (printed when set)
ENV_KNOBS = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
             "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
             "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "LD_PRELOAD")


# ----------------------------------------------------------------------------- inputs
def make_model(out_dir, hidden, layers, seed=0):
    """A randomly initialised Wav2Vec2ForCTC + processor written with save_pretrained."""
    return save_random_ctc_model(out_dir, seed, hidden_size=hidden, num_hidden_layers=layers,
                                 num_attention_heads=max(1, hidden // 32),
                                 intermediate_size=2 * hidden, conv_dim=(32, 32, 32),
                                 conv_kernel=(10, 8, 8), conv_stride=(5, 8, 8),
                                 feat_extract_norm="group", num_conv_pos_embeddings=16,
                                 num_conv_pos_embedding_groups=2, layerdrop=0.0, mask_time_prob=0.0)


def make_audio(root, n, seconds, block, n_lengths, seed=0):
    """``n`` utterances (wav files) and their manifest rows, in stream order. Durations are
    ``n_lengths`` values spread over ``seconds`` in random order (0: uniformly random)."""
    import numpy as np
    import soundfile as sf
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "wav"), exist_ok=True)
    lengths = None
    if n_lengths:
        lengths = (np.linspace(seconds[0], seconds[1], n_lengths) * SR).astype(int)
    rows = []
    for i in range(n):
        seg = i // block
        n_samples = rng.choice(lengths) if n_lengths else int(rng.uniform(*seconds) * SR)
        t = np.arange(n_samples) / SR
        f0 = rng.uniform(100, 220)
        sig = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.3)) / k for k in range(1, 6))
        sig *= 0.5 * (1 + np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6.3)))
        sig = 0.1 * sig / np.sqrt(np.mean(sig ** 2))
        if seg % 2:
            sig = sig + 0.3 * rng.standard_normal(len(t))
        sig = np.clip(sig, -1, 1).astype(np.float32)
        path = os.path.join(root, "wav", f"utt{i:05d}.wav")
        sf.write(path, sig, SR, subtype="PCM_16")
        rows.append({"ID": f"utt{i:05d}", "duration": f"{len(sig) / SR:.4f}",
                     "wav": f"$data_root/wav/utt{i:05d}.wav", "spk_id": "s",
                     "wrd": " ".join(rng.choice(WORDS, size=int(rng.integers(2, 5)))),
                     "domain": "noisy" if seg % 2 else "clean", "segment": seg, "position": i})
    return rows


def speech_like_wavs(n, lo, hi, n_lengths=0, seed=0):
    """Speech-like tensors (the GPU check's and the sweep benchmark's): ``n_lengths`` distinct durations in [lo, hi] s (0: all distinct)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    lengths = ([int(16000 * (lo + (hi - lo) * i / max(n_lengths - 1, 1))) for i in range(n_lengths)]
               if n_lengths else None)
    out = []
    for i in range(n):
        n_s = (lengths[int(torch.randint(len(lengths), (), generator=g))] if lengths else
               int(16000 * (lo + (hi - lo) * torch.rand((), generator=g).item())))
        t = torch.arange(n_s) / 16000
        f0 = 100 + 100 * torch.rand((), generator=g).item()
        env = 0.5 * (1 + torch.sin(2 * torch.pi * 3 * t))
        wav = env * sum(torch.sin(2 * torch.pi * f0 * h * t) / h for h in (1, 2, 3))
        out.append((0.3 * wav + 0.05 * torch.randn(n_s, generator=g)).float())
    return out


def write_stream(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# ----------------------------------------------------------------------------- measurement
def _status_kb(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb():
    kb = _status_kb("VmRSS")
    return None if kb is None else kb / 1024


def peak_rss_mb():
    kb = _status_kb("VmHWM")
    if kb is None:          # not Linux: ru_maxrss (kB on Linux, bytes on macOS)
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kb = r / 1024 if sys.platform == "darwin" else r
    return kb / 1024


def smaps_rollup_mb():
    """Anonymous and file-backed resident memory of this process (MiB), Linux only."""
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Anonymous", "Rss"):
                    out[key] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def _mallinfo2():
    """glibc's ``mallinfo2`` (glibc >= 2.33), or None."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                   "usmblks", "fsmblks", "uordblks", "fordblks",
                                                   "keepcost")]
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    return fn


class Tracer:
    """RSS after every utterance; with ``py_heap``, the traced Python heap (``tracemalloc``) and
    glibc's heap (``mallinfo2``: bytes in use in the malloc arenas + mmapped chunks, and the free
    bytes the arenas hold)."""

    def __init__(self, py_heap=False):
        self.rss, self.py, self.c_used, self.c_free = [], [], [], []
        self.py_heap = py_heap
        self.mallinfo = _mallinfo2() if py_heap else None
        if py_heap:
            import tracemalloc
            tracemalloc.start()

    def __call__(self):
        self.rss.append(round(rss_mb() or 0.0, 2))
        if self.mallinfo is not None:
            m = self.mallinfo()
            self.c_used.append(round((m.uordblks + m.hblkhd) / 2 ** 20, 3))
            self.c_free.append(round(m.fordblks / 2 ** 20, 3))
        if self.py_heap:
            import tracemalloc
            self.py.append(round(tracemalloc.get_traced_memory()[0] / 2 ** 20, 3))


def child(args):
    """Decode one stream in this process and print one JSON line of measurements."""
    if args.control:
        return control(args)
    import torch

    from tta_brain.run import brain
    from tta_brain import decode
    from tta_brain.run.brain import TTABrain
    _knobs(args)
    if args.trim_every is not None:      # 0: never
        brain.TRIM_EVERY = args.trim_every or 10 ** 12
    if args.prefetch is not None:
        brain.PREFETCH = args.prefetch
    trace = Tracer(args.py_heap)
    orig = TTABrain.evaluate_batch

    def measured(self, batch, stage=None):
        hyp = orig(self, batch)
        trace()
        return hyp
    TTABrain.evaluate_batch = measured
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    summary = decode.main([args.hparams, f"--source={args.source}",
                           f"--stream_csv={args.stream}", f"--output_folder={args.out}",
                           f"--data_root={args.data_root}", f"--device={args.device}",
                           "--noprogressbar", *args.decode_opts.split()])
    res = {"n": summary.n_utts, "resets": len(summary.resets), "wer": round(summary.wer, 2)}
    _report(args, res, trace, t0)


def _knobs(args):
    import torch
    if args.mkldnn == "off":
        torch.backends.mkldnn.enabled = False


def _report(args, res, trace, t0):
    import torch
    res.update({"peak_rss_mb": round(peak_rss_mb(), 1), "end_rss_mb": round(rss_mb() or 0, 1),
                "rss_at": {m: round(trace.rss[m - 1], 1) for m in args.marks
                           if m <= len(trace.rss)},
                "trace": trace.rss, "smaps": smaps_rollup_mb(), "wall_s": round(time.time() - t0, 1)})
    if trace.py:
        res["py_heap"] = trace.py
    if trace.c_used:
        res["malloc_used"], res["malloc_free"] = trace.c_used, trace.c_free
    if args.device.startswith("cuda"):
        res["cuda_peak_alloc_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
        res["cuda_peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2 ** 20, 1)
    print("BENCH_MEMORY " + json.dumps(res), flush=True)


def control(args):
    """The control: the same model, inputs and lengths in a plain loop without tta-brain objects
    (its only imports: the pure ``suta_loss`` and the ``native_cpu_kernels`` switch). Per utterance, as dsuta: ``steps``
    x (forward, SUTA loss, backward with oneDNN off as ``cpu_native_backward``, AdamW step) and
    one prediction forward; the LayerNorm + CNN parameters adapt, from the source every
    ``--block`` utterances (as a reset would)."""
    import soundfile as sf
    import torch
    from transformers import AutoModelForCTC

    from tta_brain.methods.losses import suta_loss
    from tta_brain.lobes.runtime import native_cpu_kernels
    _knobs(args)
    trim = None
    if args.trim_every:
        import ctypes
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    opts = dict(o.lstrip("-").split("=", 1) for o in args.decode_opts.split() if "=" in o)
    steps, lr = int(opts.get("steps", 10)), float(opts.get("lr", 2e-5))
    torch.manual_seed(0)
    model = AutoModelForCTC.from_pretrained(args.source).to(args.device).eval()
    model.requires_grad_(False)
    params = [p for n, p in model.named_parameters()
              if "layer_norm" in n or "feature_extractor" in n or "feature_projection" in n]
    for p in params:
        p.requires_grad_(True)
    source = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    with open(args.stream) as f:
        rows = list(csv.DictReader(f))
    trace = Tracer(args.py_heap)
    t0 = time.time()
    for i, row in enumerate(rows):
        wav, _ = sf.read(row["wav"].replace("$data_root", args.data_root), dtype="float32")
        x = torch.from_numpy(wav)[None].to(args.device)
        x = (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + 1e-7)
        if i % args.block == 0:
            with torch.no_grad():
                torch._foreach_copy_(params, source)
            for state in opt.state.values():
                for v in state.values():
                    v.zero_()
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            loss = suta_loss(model(x).logits).mean()
            with native_cpu_kernels() if args.device == "cpu" else nullcontext():
                loss.backward()
            opt.step()
        with torch.no_grad():
            model(x).logits.argmax(-1)
        if trim is not None and (i + 1) % args.trim_every == 0:
            trim(0)
        trace()
    _report(args, {"n": len(rows), "resets": 0, "wer": 0.0}, trace, t0)


def windows(trace, size):
    """Median RSS of each window of ``size`` utterances (the last one may be shorter)."""
    import statistics
    return [round(statistics.median(trace[i:i + size]), 1) for i in range(0, len(trace), size)]


def tail_slope(trace, start=None):
    """Least-squares slope of the RSS over utterances ``start..`` (default: the last half), in
    MiB per 100 utterances."""
    start = len(trace) // 2 if start is None else start
    ys = trace[start:]
    n = len(ys)
    if n < 2:
        return float("nan")
    mx, my = (n - 1) / 2, sum(ys) / n
    sxy = sum((i - mx) * (y - my) for i, y in enumerate(ys))
    sxx = sum((i - mx) ** 2 for i in range(n))
    return 100 * sxy / sxx


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        from tta_brain.grid import option_list_hint      # only on the error path (grid is slow)
        super().error(option_list_hint(message, ("--decode_opts",)))


def main(argv=None):
    p = _Parser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=positive(int), nargs="+", default=[50, 100, 200, 400])
    p.add_argument("--device", default="cpu", type=device)
    p.add_argument("--source", help="CTC model dir or hub name (default: a generated tiny one)")
    p.add_argument("--hidden", type=positive(int), default=64)
    p.add_argument("--layers", type=positive(int), default=2)
    p.add_argument("--seconds", type=positive(float), nargs=2, default=(0.5, 1.0),
                   help="utterance durations: uniform in [min, max] s")
    p.add_argument("--n_lengths", type=at_least(int, 0), default=0,
                   help="distinct utterance lengths (0: every utterance its own random length)")
    p.add_argument("--block", type=positive(int), default=25, help="utterances per domain block")
    p.add_argument("--hparams", default="dsuta", help="method name or yaml (default: dsuta)")
    p.add_argument("--decode_opts", default="--reset=dynamic --reset_K=20 --buffer_size=5 "
                   "--steps=2 --lr=1e-3 --ckpt_every=50",
                   help="overrides passed to tta_brain.decode")
    p.add_argument("--threads", type=positive(int), default=1, help="OMP_NUM_THREADS of the runs")
    p.add_argument("--workdir", help="keep inputs and outputs here (default: a temporary folder, "
                   "removed at the end)")
    p.add_argument("--tolerance_mb", type=at_least(float, 0), default=20.0)
    p.add_argument("--window", type=positive(int), default=200,
                   help="utterances per window of the windowed RSS (median per window)")
    p.add_argument("--slope_tolerance", type=at_least(float, 0), default=0.5,
                   help="MiB per 100 utterances: a larger tail slope of the longest run is growth")
    p.add_argument("--control", action="store_true",
                   help="the control: a plain forward/SUTA loss/backward/AdamW loop on the same "
                        "model and inputs, without tta-brain (steps and lr from --decode_opts)")
    p.add_argument("--py_heap", action="store_true",
                   help="also trace the Python heap (tracemalloc; slower) and glibc's (mallinfo2)")
    p.add_argument("--trim_every", type=at_least(int, 0),
                   help="bisecting: utterances between malloc_trim calls (TTABrain.TRIM_EVERY; "
                        "0: never; the control trims only with it)")
    p.add_argument("--prefetch", type=at_least(int, 0),
                   help="bisecting: TTABrain.PREFETCH (0: no thread)")
    p.add_argument("--mkldnn", choices=("on", "off"), default="on",
                   help="bisecting: off = torch.backends.mkldnn.enabled False for the whole run")
    p.add_argument("--json", type=output_file, help="write the measurements here")
    # internal: one measured run
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data_root", help=argparse.SUPPRESS)
    p.add_argument("--marks", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.seconds[0] > args.seconds[1]:
        p.error(f"--seconds {args.seconds[0]:g} {args.seconds[1]:g}: min, then max")
    if args.workdir:
        if os.path.exists(args.workdir) and not os.path.isdir(args.workdir):
            p.error(f"--workdir {args.workdir}: a file, not a folder")
        os.makedirs(args.workdir, exist_ok=True)
        return measure(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as work:
        return measure(args, work)


def measure(args, work) -> int:
    """The runs of ``main`` in the folder ``work``; 0 if the memory stays flat, else 1."""
    lengths = sorted(set(args.lengths))
    source = args.source or make_model(os.path.join(work, "model"), args.hidden, args.layers)
    rows = make_audio(work, lengths[-1], args.seconds, args.block, args.n_lengths)
    marks = sorted({m for m in (50, 100, 200, 400, 800, 1600, 3200) if m <= lengths[-1]}
                   | set(lengths))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "PYTHONPATH": ROOT}
    print(f"device {args.device} | model {source if args.source else 'generated wav2vec2 '}"
          f"{'' if args.source else f'(hidden {args.hidden}, {args.layers} layers)'} | "
          f"{'CONTROL (plain loop) ' if args.control else ''}"
          f"{args.hparams} {args.decode_opts} | utterances "
          f"{args.seconds[0]}-{args.seconds[1]} s "
          f"({f'{args.n_lengths} distinct lengths' if args.n_lengths else 'random lengths'}) | "
          f"work dir {work}", flush=True)
    knobs = [f"{k}={os.environ[k]}" for k in ENV_KNOBS if k in os.environ]
    knobs += [f"--{k}={getattr(args, k)}" for k in ("trim_every", "prefetch")
              if getattr(args, k) is not None]
    knobs += ["--mkldnn=off"] if args.mkldnn == "off" else []
    if knobs:
        print("settings: " + " ".join(knobs), flush=True)
    results = []
    for n in lengths:
        stream = os.path.join(work, f"stream_{n}.csv")
        write_stream(stream, rows[:n])
        out = os.path.join(work, f"exp_{n}")
        shutil.rmtree(out, ignore_errors=True)      # a finished run would just be resumed
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--stream", stream,
               "--out", out, "--data_root", work, "--device", args.device,
               "--hparams", args.hparams, "--decode_opts=" + args.decode_opts,
               "--block", str(args.block), "--source", source,
               *(["--control"] if args.control else []), *(["--py_heap"] if args.py_heap else []),
               *([f"--trim_every={args.trim_every}"] if args.trim_every is not None else []),
               *([f"--prefetch={args.prefetch}"] if args.prefetch is not None else []),
               f"--mkldnn={args.mkldnn}",
               "--marks", *map(str, [m for m in marks if m <= n])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_MEMORY ")]
        if proc.returncode != 0 or not line:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"run with {n} utterances failed (exit {proc.returncode})")
        res = json.loads(line[0].split(" ", 1)[1])
        results.append(res)
        at = ", ".join(f"@{k}: {v:.1f}" for k, v in res["rss_at"].items())
        cuda = (f" | CUDA peak alloc {res['cuda_peak_alloc_mb']:.1f} MiB, reserved "
                f"{res['cuda_peak_reserved_mb']:.1f} MiB" if "cuda_peak_alloc_mb" in res else "")
        print(f"{n:6d} utts | peak RSS {res['peak_rss_mb']:8.1f} MiB | end RSS "
              f"{res['end_rss_mb']:8.1f} MiB | RSS after utterance ({at}) MiB{cuda} | "
              f"{res['resets']} resets | WER {res['wer']:.1f}% | {res['wall_s']:.0f} s", flush=True)
        if n >= 2 * args.window:
            res["windows"] = windows(res["trace"], args.window)
            res["tail_slope"] = tail_slope(res["trace"])
            print(f"{'':6s}      | median RSS per {args.window}-utterance window (MiB): "
                  f"{', '.join(f'{w:.0f}' for w in res['windows'])}")
            extra = ""
            if "py_heap" in res:
                extra = (f"; Python heap (tracemalloc) {res['py_heap'][n // 2]:.2f} -> "
                         f"{res['py_heap'][-1]:.2f} MiB, slope "
                         f"{tail_slope(res['py_heap']):+.3f} MiB per 100")
            if "malloc_used" in res:
                extra += (f"; malloc in use {res['malloc_used'][n // 2]:.1f} -> "
                          f"{res['malloc_used'][-1]:.1f} MiB (slope "
                          f"{tail_slope(res['malloc_used']):+.3f}), held free "
                          f"{res['malloc_free'][n // 2]:.1f} -> {res['malloc_free'][-1]:.1f} MiB")
            print(f"{'':6s}      | tail slope (utterances {n // 2 + 1}-{n}): "
                  f"{res['tail_slope']:+.2f} MiB per 100 utterances{extra}", flush=True)
    growth = results[-1]["peak_rss_mb"] - results[0]["peak_rss_mb"]
    flat = growth <= args.tolerance_mb
    line = (f"peak RSS {lengths[0]} -> {lengths[-1]} utterances: {growth:+.1f} MiB "
            f"({100 * growth / results[0]['peak_rss_mb']:+.2f}%)")
    if "tail_slope" in results[-1]:
        slope = results[-1]["tail_slope"]
        line += f"; tail slope {slope:+.2f} MiB per 100 utterances"
        flat = flat and slope <= args.slope_tolerance
    if "cuda_peak_alloc_mb" in results[0]:
        g = results[-1]["cuda_peak_alloc_mb"] - results[0]["cuda_peak_alloc_mb"]
        line += f"; CUDA peak allocated {g:+.1f} MiB"
        flat = flat and g <= args.tolerance_mb
    print(f"{line} -> {'FLAT' if flat else 'GROWS'} (tolerance {args.tolerance_mb:.0f} MiB, "
          f"{args.slope_tolerance:g} MiB per 100 utterances)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"},
                       "results": results, "growth_mb": growth, "flat": flat}, f, indent=1)
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
