#!/usr/bin/env python3
"""GPU check of the device-side adaptation steps and their CUDA-graph capture (``cuda_graphs``).

Everything in one run, eager and captured (``cuda_graphs: true``) side by side, on one CUDA
device; "eager" is the device-side steps without capture (``cuda_device_steps: true``) in
sections 1, 2 and 5, and the default path users get in sections 3 and 4. Results go to stdout
and ``<out>/gpu_check.txt`` / ``.json``:

1. ``transcripts``: graph replay vs eager execution on a tiny random wav2vec2 (the tests' model)
   for 20 utterances of each graph-capable method (suta, csuta, dsuta, dsuta + dynamic reset):
   same transcripts? largest parameter difference; captures, cache hits, replays.
2. ``step``: one SUTA step on a 3 s utterance of a random wav2vec2-base-sized model, fp32, LayerNorm
   + CNN adapted: ms per step, eager vs replayed (the earlier, hand-written H200 measurement was
   22 ms eager and 8.3 ms replayed; that is *not* what this script measured).
3. ``bench``: ``tools/bench_speed.py --w2v2_base`` (source, suta, dsuta, dsuta+dynamic), once
   eager and once with ``--cuda_graphs``: s per audio s and the ratio.
4. ``decode``: ``python -m tta_brain.decode`` on a generated stream (speech-like audio, as
   ``tools/bench_memory.py`` writes it) with the same random base-sized model: process wall time,
   the method's time (summary.json), and whether eager and captured runs wrote the same
   transcripts.
5. ``memory``: CUDA memory (allocated / reserved) along a stream of distinct lengths with dsuta,
   eager and captured: graphs must not make it grow.

Each section is skipped (and says so) once ``--budget_s`` (default 450 s) would be exceeded, so the
whole check stays under 8 minutes on one GPU; a failing section is reported and the next runs.

Recipe for a fresh GPU machine with torch 2.11 + CUDA but none of our other packages and no
network. Here (with network), put the wheels into ``.whl/``::

    pip download --no-deps -d .whl speechbrain==1.1.2 hyperpyyaml==1.2.3 jiwer rapidfuzz \\
        ruamel.yaml ruamel.yaml.clib transformers==4.57.6 tokenizers huggingface_hub soundfile \\
        cffi pycparser espeakng-loader submitit cloudpickle

then carry ``.whl`` along and, on the GPU machine, in the repository root::

    pip install --no-index --no-deps --target .site .whl/*.whl
    PYTHONPATH=.site:. python tools/gpu_check.py --out $OUT

(The imports also need numpy, PyYAML, regex, safetensors, tqdm, requests, packaging, joblib,
scipy, sentencepiece and torchaudio, usually present next to torch; the check names any missing
module in one line and stops.) Without a CUDA device it refuses with one line (exit status 2).
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
for _p in (ROOT, TOOLS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

SECTIONS = ("transcripts", "step", "bench", "decode", "memory")
GRAPH_METHODS = ("suta", "csuta", "dsuta", "dsuta+dynamic")
#: What the check imports besides torch (module names), for the one-line preflight.
NEEDED = ("numpy", "yaml", "ruamel.yaml", "hyperpyyaml", "speechbrain", "transformers",
          "tokenizers", "huggingface_hub", "safetensors", "soundfile", "jiwer", "tqdm")
EARLIER = ("earlier H200 measurement (hand-written capture, wav2vec2-base size, 3 s, fp32, "
           "not this code): one SUTA step 22 ms eager, 8.3 ms replayed; 10 s: 29 vs 13.5 ms")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the report and the runs")
    p.add_argument("--device", default="cuda:0", help="a CUDA device (default cuda:0)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget_s", type=float, default=450.0,
                   help="skip the sections that would start after this many seconds")
    p.add_argument("--n_utts", type=int, default=20, help="utterances per method (transcripts)")
    p.add_argument("--decode_utts", type=int, default=16, help="utterances of the decode stream")
    p.add_argument("--seconds", type=float, default=3.0, help="utterance length of step/bench")
    # the script's own smoke test on CPU (tiny model everywhere, no figures): tests/test_gpu.py
    p.add_argument("--cpu_smoke", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device, args.n_utts, args.decode_utts, args.seconds = "cpu", 3, 3, 1.0
        args.sections = ",".join(s for s in args.sections.split(",") if s.strip() != "memory")
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {', '.join(bad)} (choose from {', '.join(SECTIONS)})")
    if not args.device.startswith("cuda") and not args.cpu_smoke:
        p.error(f"--device must be a CUDA device, not {args.device!r}")
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
        return (f"missing module(s) {', '.join(missing)}: install the wheels first (see the "
                f"docstring: pip install --no-index --no-deps --target .site .whl/*.whl; "
                f"PYTHONPATH=.site:.)")
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


def _determinism():
    import torch
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def _method(name, model_dir, device, graphs, cache=1, **kw):
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.methods import build_method
    from tta_brain.methods.resets import make_reset_policy
    from tta_brain.lobes.runtime import Runtime
    base, _, reset = name.partition("+")
    lobe = HFCTCLobe(model_dir, device=device,
                     runtime=Runtime(cuda_device_steps=True, cuda_graphs="on" if graphs else "off",
                                     cuda_graph_cache=cache))
    if reset:
        kw["reset_policy"] = make_reset_policy(reset, K=kw.pop("reset_K", 6))
    kw.pop("reset_K", None)
    return build_method(base, model=lobe, **kw)


def _wavs(n, lo, hi, n_lengths=0, seed=0):
    """Speech-like waveforms: ``n_lengths`` distinct durations in [lo, hi] s (0: all distinct)."""
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


def _stats(m):
    from tta_brain.gpu import DeviceStep
    steps = m.step
    if not isinstance(steps, DeviceStep):
        return {"device_path": False}
    return dict(device_path=True, graphs=steps.graphs, **steps.stats, **steps.cache.stats)


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


# ----------------------------------------------------------------------------- sections
def section_transcripts(args, rep, work):
    from tta_brain.methods import UttInfo
    tiny = _tiny_model(work)
    # 8 distinct lengths in random order: captures, cache hits and (cache 4) replays of older
    # graphs after newer ones were captured into the same pool
    wavs = _wavs(args.n_utts, 0.6, 1.4, n_lengths=8, seed=1)
    rep.say(f"{'method, graph cache':<22}{'same transcripts':>18}{'max |dparam|':>14}  graph stats")
    res, ok = {}, True
    for name in GRAPH_METHODS:
        kw = dict(lr=1e-3, steps=3 if name == "csuta" else 4)   # csuta: N=1 would never capture
        if name.startswith("dsuta"):
            kw.update(buffer_size=3, reset_K=6)
        runs = {}
        for graphs, cache in ((False, 1), (True, 1), (True, 4)):
            m = _method(name, tiny, args.device, graphs, cache=cache, **dict(kw))
            hyps = [m.process(w, UttInfo(id=f"u{i}", position=i, domain="d"))
                    for i, w in enumerate(wavs)]
            runs[graphs, cache] = (m, hyps)
        a, ha = runs[False, 1]
        for cache in (1, 4):
            b, hb = runs[True, cache]
            same = sum(x == y for x, y in zip(ha, hb))
            diff = max(float((p.detach() - q.detach()).abs().max())
                       for p, q in zip(a.params, b.params))
            st = _stats(b)
            ok &= same == len(ha) and st.get("replays", 0) > 0
            res[f"{name} cache {cache}"] = dict(same=same, n=len(ha), max_param_diff=diff,
                                                eager=_stats(a), graphs=st)
            rep.say(f"{name + ', ' + str(cache):<22}{same:>12}/{len(ha):<5}{diff:>14.2e}  {st}")
    _sync(args.device)
    rep.say("transcripts: " + ("OK (graph replay == eager)" if ok else "MISMATCH or no replay"))
    rep.data["transcripts"] = dict(ok=ok, methods=res)


def section_step(args, rep, work):
    import torch
    model = _base_model(work, args)
    cuda = args.device.startswith("cuda")
    x_wav = _wavs(1, args.seconds, args.seconds, seed=2)[0]
    res = {}
    for graphs in (False, True):
        m = _method("suta", model, args.device, graphs, lr=2e-5, steps=10)
        x = m.lobe.prepare(x_wav)
        with torch.enable_grad():
            for _ in range(4):                     # warm-up (and, captured: the capture)
                m.adapt_step(x)
            _sync(args.device)
            n, t0 = 20, time.perf_counter()
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
            for _ in range(n):
                m.adapt_step(x)
            if cuda:
                end.record()
            _sync(args.device)
            wall = (time.perf_counter() - t0) / n * 1e3
        m.predict(x)                               # settles the step counters
        res["captured" if graphs else "eager"] = dict(
            ms_per_step=wall, gpu_ms_per_step=start.elapsed_time(end) / n if cuda else None,
            stats=_stats(m))
        del m
        if cuda:
            torch.cuda.empty_cache()
    e, c = res["eager"], res["captured"]
    size = "tiny" if args.cpu_smoke else "wav2vec2-base"
    rep.say(f"SUTA step, {args.seconds:.1f} s, random {size} model, fp32 (this run): eager "
            f"{e['ms_per_step']:.2f} ms, captured {c['ms_per_step']:.2f} ms "
            f"(x{e['ms_per_step'] / max(c['ms_per_step'], 1e-9):.2f}); {c['stats']}")
    rep.say(f"  ({EARLIER})")
    rep.data["step"] = res


def section_bench(args, rep, work):
    import bench_speed
    common = ["--device", args.device, "--n_utts", "4", "--repeats", "2",
              "--warmup", "2", "--seconds", str(args.seconds),
              "--methods", "source,suta,dsuta,dsuta+dynamic"]
    common += ["--model", _tiny_model(work), "--n_utts", "2", "--repeats", "1",
               "--warmup", "1", "--suta_steps", "2", "--dsuta_steps", "2"] if args.cpu_smoke \
        else ["--w2v2_base"]
    res = {}
    for graphs in (False, True):
        tag = "captured" if graphs else "eager"
        rep.say(f"--- bench_speed ({tag}) ---")
        res[tag] = bench_speed.main(common + ["--json", os.path.join(work, f"bench_{tag}.json")]
                                    + ["--cuda_graphs", "on" if graphs else "off"])
    rep.say(f"{'method':<16}{'eager s/aud s':>15}{'captured':>11}{'speed-up':>10}")
    for m in res["eager"]:
        e, c = res["eager"][m]["wall"]["s_per_audio_s"], res["captured"][m]["wall"]["s_per_audio_s"]
        rep.say(f"{m:<16}{e:>15.4f}{c:>11.4f}{e / max(c, 1e-12):>9.2f}x")
    rep.data["bench"] = {t: {m: r["wall"]["s_per_audio_s"] for m, r in v.items()}
                         for t, v in res.items()}


def section_decode(args, rep, work):
    import bench_memory
    model = _base_model(work, args)
    data = os.path.join(work, "decode_data")
    secs = (0.6, 1.2) if args.cpu_smoke else (2.0, 4.0)
    rows = bench_memory.make_audio(data, args.decode_utts, secs, block=8, n_lengths=0)
    stream = os.path.join(data, "stream.csv")
    bench_memory.write_stream(stream, rows)
    runs = [("source", "source", [], False), ("suta", "suta", [], False),
            ("suta", "suta", [], True), ("dsuta", "dsuta", ["--steps=5"], False),
            ("dsuta", "dsuta", ["--steps=5"], True),
            ("dsuta+dynamic", "dsuta", ["--steps=5", "--reset=dynamic", "--reset_K=10"], False),
            ("dsuta+dynamic", "dsuta", ["--steps=5", "--reset=dynamic", "--reset_K=10"], True)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in (os.path.join(ROOT, ".site"), ROOT, os.environ.get("PYTHONPATH")) if p]))
    res = {}
    rep.say(f"{'run':<26}{'process s':>10}{'method s':>10}{'audio s':>9}{'s/aud s':>9}"
            f"  transcripts")
    for tag, hp, extra, graphs in runs:
        name = f"{tag}{' captured' if graphs else ''}"
        out = os.path.join(work, "decode", f"{tag}{'_graphs' if graphs else ''}")
        cmd = [sys.executable, "-m", "tta_brain.decode", hp, f"--source={model}",
               f"--stream_csv={stream}", f"--output_folder={out}", f"--data_root={data}",
               f"--device={args.device}", "--noprogressbar", *extra,
               f"--cuda_graphs={'on' if graphs else 'off'}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            rep.say(f"{name:<26} FAILED (exit {proc.returncode}): "
                    f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
            res[name] = dict(failed=proc.returncode, tail=(proc.stderr or "")[-2000:])
            continue
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        with open(os.path.join(out, "transcripts.csv")) as f:
            hyps = [line.rstrip("\n") for line in f]
        r = dict(process_s=wall, method_s=s["wall_time_s"], audio_s=s["audio_s"],
                 s_per_audio_s=s["time_per_audio_s"], hyps=hyps)
        same = ""
        if graphs and tag in res:
            ref = res[tag]["hyps"]
            same = f"{sum(a == b for a, b in zip(ref, hyps)) - 1}/{len(hyps) - 1} rows as eager"
        res[name if graphs else tag] = r
        rep.say(f"{name:<26}{wall:>10.1f}{r['method_s']:>10.2f}{r['audio_s']:>9.1f}"
                f"{r['s_per_audio_s']:>9.4f}  {same}")
    rep.say("process s includes start-up (imports, model load); method s = adapt + predict "
            "(summary.json wall_time_s)")
    rep.data["decode"] = {k: {kk: vv for kk, vv in v.items() if kk != "hyps"}
                          for k, v in res.items()}


def section_memory(args, rep, work):
    import torch
    from tta_brain.methods import UttInfo
    model = _base_model(work, args)
    wavs = _wavs(40, 2.0, 4.0, seed=3)              # 40 distinct lengths
    res = {}
    for graphs in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        m = _method("dsuta", model, args.device, graphs, lr=2e-5, steps=5, buffer_size=5)
        marks = {}
        for i, w in enumerate(wavs):
            m.process(w, UttInfo(id=f"m{i}", position=i, domain="d"))
            if (i + 1) % 10 == 0:
                marks[i + 1] = (round(torch.cuda.memory_allocated() / 2 ** 20, 1),
                                round(torch.cuda.memory_reserved() / 2 ** 20, 1))
        tag = "captured" if graphs else "eager"
        res[tag] = dict(marks=marks, peak_alloc_mb=torch.cuda.max_memory_allocated() / 2 ** 20,
                        stats=_stats(m))
        rep.say(f"dsuta {tag}: (allocated, reserved) MB after utterance " +
                ", ".join(f"{k}: {v}" for k, v in marks.items()) +
                f"; peak allocated {res[tag]['peak_alloc_mb']:.0f} MB; {_stats(m)}")
        m.step.release()
        del m
    c = res["captured"]["marks"]
    growth = c[40][1] - c[20][1]
    rep.say(f"memory: reserved 20 -> 40 utterances with graphs: {growth:+.1f} MB "
            f"({'flat' if growth <= 64 else 'GROWS'})")
    rep.data["memory"] = res


def main(argv=None):
    args = parse_args(argv)
    why = preflight(args.device)
    if why:
        print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    _determinism()
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
    rep.say("All figures below are from this run; nothing here is the earlier H200 measurement "
            "unless labelled so.")
    rep.data["device"] = name
    cost = {"transcripts": 40, "step": 40, "bench": 120, "decode": 150, "memory": 40}  # rough s
    status = {}
    for name in args.sections:
        spent = time.perf_counter() - t_start
        if spent + cost[name] > args.budget_s:
            rep.say(f"\n== {name}: SKIPPED (budget: {spent:.0f} s spent, ~{cost[name]} s needed)")
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
        rep.say(f"({name}: {time.perf_counter() - t0:.0f} s)")
        rep.save()
    rep.data["status"] = status
    rep.say(f"\ngpu_check: {status} in {time.perf_counter() - t_start:.0f} s")
    rep.save()
    return 0 if all(v == "done" for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
