#!/usr/bin/env python3
"""Batched sweep vs separate runs (``tta_brain.sweep``, issue #22 item 6).

CPU (default): R runs of ``--method`` (suta, csuta, dsuta, tent, eata / sar with every step
kept, cotta with its defaults, cea with ``--steps`` in each stage, sgem, sdpl, awmc in eval mode
(the tiny model's dropout is not batched); lr 1e-4 x 1, 2, 3, ...; the backprop-free lame, t3a,
foa and ebats at their defaults, each run its own CMA-ES seed, LAME its own k, T3A its own filter;
``--reset`` for the continual ones, the dynamic reset with ``K = max(4, n_utts // 3)``) of the
tests' tiny model over
the same generated utterances, batched (one batch of ``tta_brain.sweep``) vs one after another in
this process; s per audio second of all R runs together for both, the ratio, and whether the
transcripts agree::

    python tools/bench_sweep.py [--runs 4] [--n_utts 6] [--steps 10] [--seconds 2]
        [--method dsuta --reset dynamic]

``gpu_bench`` (what ``tools/gpu_check.py``'s ``sweep`` section runs): a generated stream decoded by
R runs (SUTA, or the check's ``--sweep_method``; different lr, or :func:`run_setting`'s for a
backprop-free method) as one ``python -m tta_brain.sweep``
process vs R
``python -m tta_brain.decode`` processes started together on the same device; throughput = R x the
stream's audio seconds over the span of the decode loops (first "Decoding" to last summary line of
the runs' log.txt: process start-up and model loading left out) and over the processes' wall time.
"""
import argparse
import datetime
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

from bench_args import at_least, output_file, positive  # noqa: E402  (after the path set-up)
from tta_brain.run.summary import read_summary  # noqa: E402


#: the backprop-free methods: no lr or steps; a sweep's runs differ in :func:`run_setting`
FREE = ("lame", "t3a", "foa", "ebats")
#: methods without a reset policy in these benchmarks (episodic, or none by default)
NO_POLICY = ("suta", "tent", "cea", "sgem", "sdpl", "lame")


def run_setting(method, r, lr=1e-4):
    """Run ``r``'s own setting ``(key, value)`` in a benchmark sweep of ``method``: lr ``lr``
    x (r + 1) for the gradient methods; for the backprop-free ones what a user sweeps (CMA-ES:
    the seed; LAME: its k; T3A: its filter)."""
    return {"ebats": ("cma_seed", r), "foa": ("cma_seed", r), "lame": ("knn", 3 + r),
            "t3a": ("filter_K", 2 + 2 * r)}.get(method, ("lr", lr * (r + 1)))


def cpu_bench(runs, n_utts, steps, seconds, threads=1, model=None, method="suta", reset="none"):
    import torch
    torch.set_num_threads(threads)
    from bench_memory import speech_like_wavs
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.lobes.testing import TINY, save_random_ctc_model
    from tta_brain.methods import UttInfo, build_method
    from tta_brain.methods.resets import make_reset_policy
    from tta_brain.sweep import batch_for
    if model is None:
        model = save_random_ctc_model("/tmp/bench_sweep_tiny", 0, **dict(
            TINY, feat_extract_norm="group", do_stable_layer_norm=False))
    wavs = speech_like_wavs(n_utts, 0.9 * seconds, 1.1 * seconds, seed=3)
    audio = sum(w.numel() for w in wavs) / 16000
    settings = [dict([run_setting(method, r)]) for r in range(runs)]
    block = max(2, n_utts // 3)          # the fixed period, and the oracle's domain blocks
    info = lambda i: UttInfo(position=i, segment=i // block)    # noqa: E731
    policy = lambda: (None if method in NO_POLICY else
                      make_reset_policy(reset, every=block, K=max(4, n_utts // 3)))
    # EATA: every step kept (a random model's entropy is near ln V, above the default E0; its
    # mean posteriors are so alike that |cos| rounds to 1.0, the default d_margin), no Fisher
    # term (no statistics file)
    own = {"eata": dict(e_margin_factor=1.0, d_margin=1.01, fisher_alpha=0.0),
           "sar": dict(e_margin_factor=1.01),                      # SAR: no pass filtered
           "cotta": dict(seed=0),                                  # CoTTA: its defaults
           "cea": dict(steps2=steps),                              # CEA: --steps per stage
           "awmc": dict(train_mode=False)}.get(method, {})         # AWMC: no dropout draws
    if method in FREE:                                             # no lr or steps
        from types import SimpleNamespace
        from bench_speed import field_stats
        own = field_stats(method, HFCTCLobe(model), SimpleNamespace(seconds=seconds, seed=0))
    else:
        own["steps"] = steps
    build = lambda setting: build_method(method, model=HFCTCLobe(model), **setting, **own,
                                         reset_policy=policy())
    build(settings[0]).process(wavs[0], UttInfo())       # warm-up (first passes), untimed
    seps = [build(setting) for setting in settings]      # built (model loads) untimed, as the batch
    sep_hyps, t0 = [], time.perf_counter()
    for m in seps:
        sep_hyps.append([m.process(w, info(i)) for i, w in enumerate(wavs)])
    t_sep = time.perf_counter() - t0
    ms = [build(setting) for setting in settings]
    batch = batch_for(ms[0])(ms[0].lobe, ms)
    bat_hyps, t0 = [[] for _ in settings], time.perf_counter()
    for i, w in enumerate(wavs):
        batch.process(list(range(runs)), w, info(i))
        for r, v in enumerate(batch.views):
            bat_hyps[r].append(v.process(w))
    t_bat = time.perf_counter() - t0
    resets = lambda ms: [sum(e.kind == "reset" for e in m.events) for m in ms]   # noqa: E731
    res = dict(method=method, reset=reset, runs=runs, n_utts=n_utts, steps=steps, audio_s=audio,
               separate_s_per_audio_s=t_sep / audio, batched_s_per_audio_s=t_bat / audio,
               speedup=t_sep / t_bat, same_transcripts=sep_hyps == bat_hyps,
               resets_separate=resets(seps), resets_batched=resets(batch.views))
    label = method + ("" if method in NO_POLICY else f"+{reset}")
    what = "default search" if method in FREE else f"{steps} steps"
    print(f"{runs} {label} runs x {n_utts} utterances ({audio:.1f} audio s each), {what}, "
          f"{threads} thread(s): separate {t_sep / audio:.3f} s per audio s (all runs), batched "
          f"{t_bat / audio:.3f}: {t_sep / t_bat:.2f}x; same transcripts: {res['same_transcripts']}"
          + ("" if method in NO_POLICY else f"; resets per run {res['resets_separate']} "
             f"(batched {res['resets_batched']})"))
    return res


def _span(folders):
    """(first 'Decoding' time, last summary time) over the runs' log.txt."""
    fmt = "%Y-%m-%d %H:%M:%S,%f"
    starts, ends = [], []
    for f in folders:
        for line in open(os.path.join(f, "log.txt"), encoding="utf-8"):
            stamp = line[:23]
            if " - tta_brain.run.brain - INFO - Decoding " in line:
                starts.append(datetime.datetime.strptime(stamp, fmt))
            elif " - tta_brain.run.summary - INFO - " in line:
                ends.append(datetime.datetime.strptime(stamp, fmt))
    return (max(ends) - min(starts)).total_seconds()


def gpu_bench(model, stream, data_root, work, device="cuda", runs=8, steps=10, timeout=400,
              method="suta", opts=()):
    """Batched sweep vs ``runs`` concurrent decode processes on one device; a dict of figures.
    ``method``: the method token, ``opts``: decode options of every run (e.g. its reset). Arms:
    ``separate``, ``batched`` (the sweep's default: its steps captured as CUDA graphs where the
    batch allows) and ``batched_eager`` (the sweep with ``--cuda_graphs=off``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    lrs = [[f"--steps={steps}", f"--lr={1e-5 * (r + 1):.0e}"] if method not in FREE else
           ["--{}={}".format(*run_setting(method, r))] for r in range(runs)]

    def argv(out, own):
        return [method, *opts, f"--source={model}", f"--stream_csv={stream}", f"--output_folder={out}",
                f"--data_root={data_root}", f"--device={device}", "--noprogressbar",
                "--overwrite", *own]
    res = {}
    for arm in ("separate", "batched", "batched_eager"):
        outs = [os.path.join(work, arm, f"run{r}") for r in range(runs)]
        t0 = time.perf_counter()
        if arm != "separate":
            cmd = [sys.executable, "-m", "tta_brain.sweep"]
            for r, o in enumerate(outs):
                cmd += (["--"] if r else []) + argv(o, lrs[r]) + (
                    ["--cuda_graphs=off"] if arm == "batched_eager" else [])
            procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)]
        else:
            procs = [subprocess.Popen([sys.executable, "-m", "tta_brain.decode", *argv(o, lr)],
                                      cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
                     for o, lr in zip(outs, lrs)]
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
        wall = time.perf_counter() - t0
        os.makedirs(os.path.join(work, arm), exist_ok=True)
        for i, e in enumerate(errs):               # whole, for a failure's diagnosis
            with open(os.path.join(work, arm, f"stderr{i}.txt"), "w", encoding="utf-8") as f:
                f.write(e)
        bad = [next((ln for ln in reversed(e.splitlines()) if "Error" in ln or "ERROR" in ln),
                    e.strip()[-300:]) for p, e in zip(procs, errs) if p.returncode]
        if bad or any(p.returncode for p in procs):
            raise RuntimeError(f"{arm}: {bad[:1] or 'failed'} (whole stderr: "
                               f"{os.path.join(work, arm, 'stderr*.txt')})")
        audio = sum(read_summary(o).audio_s for o in outs)
        span = _span(outs)
        hyps = [open(os.path.join(o, "transcripts.csv")).read() for o in outs]
        res[arm] = dict(wall_s=wall, loop_s=span, audio_s=audio, hyps=hyps,
                        audio_per_s_loop=audio / span, audio_per_s_wall=audio / wall)
        res[arm]["graphs"] = _graph_line(outs[0])
    res["ratio_loop"] = res["batched"]["audio_per_s_loop"] / res["separate"]["audio_per_s_loop"]
    res["ratio_wall"] = res["batched"]["audio_per_s_wall"] / res["separate"]["audio_per_s_wall"]
    res["captured_over_eager"] = (res["batched"]["audio_per_s_loop"]
                                  / res["batched_eager"]["audio_per_s_loop"])
    hyps = {arm: res[arm].pop("hyps") for arm in ("separate", "batched", "batched_eager")}
    res["same_runs"] = sum(a == b for a, b in zip(hyps["batched"], hyps["separate"]))
    res["same_runs_captured_eager"] = sum(a == b for a, b in zip(hyps["batched"],
                                                                 hyps["batched_eager"]))
    return res


def _graph_line(folder) -> str:
    """What the sweep's log says of its captured steps ('' for none)."""
    for line in open(os.path.join(folder, "log.txt"), encoding="utf-8"):
        if "Batched steps as CUDA graphs:" in line:
            return line.split("Batched steps as CUDA graphs:", 1)[1].strip()
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=positive(int), default=4, help="runs in the sweep (default 4)")
    p.add_argument("--n_utts", type=positive(int), default=6,
                   help="utterances of the stream (default 6)")
    p.add_argument("--steps", type=positive(int), default=10,
                   help="steps per utterance of the gradient methods (default 10)")
    p.add_argument("--seconds", type=at_least(float, 0.1), default=2.0,
                   help="mean utterance length in seconds (each 0.9-1.1x; >= 0.1, shorter gives "
                        "the model no frame; default 2)")
    p.add_argument("--threads", type=positive(int), default=1,
                   help="torch CPU threads (default 1)")
    p.add_argument("--method", default="suta",
                   choices=("suta", "csuta", "dsuta", "tent", "eata", "sar", "cotta", "cea",
                            "sgem", "sdpl", "awmc") + FREE, help="the swept method")
    p.add_argument("--reset", default="none", choices=("none", "fixed", "oracle", "dynamic"),
                   help="every run's reset policy (not for " + ", ".join(NO_POLICY) + ")")
    p.add_argument("--json", default=None, type=output_file,
                   help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    if a.method in NO_POLICY and a.reset != "none":      # else labelled, but run without one
        p.error(f"--reset {a.reset}: {a.method} runs without a reset policy here")
    res = cpu_bench(a.runs, a.n_utts, a.steps, a.seconds, a.threads, method=a.method,
                    reset=a.reset)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
