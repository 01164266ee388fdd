#!/usr/bin/env python3
"""Speed benchmark: source, SUTA, DSUTA and DSUTA + dynamic reset on the same stream, one process.

For every method it prints the wall time per audio second, the passes per utterance (adaptation
forward/backward, inference forward, auxiliary forward), the ratio to SUTA and the *overhead*:

    overhead = wall - (adapt fwd+bwd count x T_fb + (infer + aux) forward count x T_f + S)

where ``T_fb`` (one forward with grad + SUTA loss + backward) and ``T_f`` (one no-grad forward to
the logits) are the costs of one pass on an input length already seen, and ``S`` the extra cost
of the first pass of an utterance (a new input length: per-shape kernel set-up, fresh memory),
``T_fb(new) - T_fb`` for a method whose first pass is an adaptation step, ``T_f(new) - T_f`` for
the source model. All are measured on the same utterances in the same process, interleaved with
the method runs. Everything else a method does (optimiser steps, state copies, decoding, the LII
loss values, Python) is overhead. The "pass ratio" column is what the passes alone predict
relative to SUTA: the limit of the method's maths.

A method that adapts in train mode (AWMC; SDPL with ``train_mode``) runs its adaptation passes
with dropout, LayerDrop and SpecAugment, which cost more than eval-mode passes: its ``T_fb`` (and
``S``) are then those of a third unit pass, ``unit_fb_train`` (the same forward + loss + backward
with the model in train mode), timed alongside whenever such a method is benchmarked; its
inference and auxiliary forwards stay at the eval-mode ``T_f``. The table marks such methods
with ``(train)``.

Timing protocol: every entry (the methods and the unit passes) first processes ``--warmup``
utterances (which also brings DSUTA + dynamic reset, with its small default ``--reset_K``, to the
detection stage: two LII forwards per utterance). Then ``--repeats`` rounds of ``--n_utts``
utterances; each utterance is processed by every entry in turn (rotating who goes first), so the
load of a shared machine falls on all entries alike. Every method keeps its own model copy and
its state across rounds, as on one long stream. Reported: medians over rounds of the time per
audio second; ratios and overhead fractions are medians of per-round values (each against the
same round's SUTA / unit times). On CPU the same numbers are also given in the process's CPU
time (``time.process_time``), which other processes' load does not inflate: a cross-check.

``--lengths fresh`` (default) makes the first pass of every utterance meet an input length the
process has not seen, as on a real stream: each round has its own utterances and each entry gets
its own variant of each (shortened by 20 ms x its index, one frame at every CNN layer), so
length-specific set-up is paid as on a real stream. The unit passes run every input twice and
time both runs (new length, seen length). ``--lengths repeat`` reuses the same utterances in
every round (after the first round nothing is new).

Note: with the per-utterance CNN feature cache active (``cache_features``, only when no
feature-encoder parameter adapts, e.g. ``--adapt layernorm``) a method's passes are cheaper than
the unit passes, and its overhead comes out negative by the CNN's share.
The backprop-free methods (lame, t3a, foa, ebats) count one adaptation forward per CMA-ES
candidate (no backward); their population runs as one batch from its insertion point, so their
overhead comes out negative. ``--population`` times E-BATS and FOA with the population batched,
one candidate at a time from the shared prefix, and the reference's loop (every candidate's
forward from the input), checking the transcripts agree; on the tests' tiny model unless ``--model``.

Usage::

    python tools/bench_speed.py                              # synthetic model (or a random one), CPU
    python tools/bench_speed.py --n_utts 20 --seconds 4 --repeats 5 --json bench.json
    python tools/bench_speed.py --stream recipes/synthetic/.../MD-Easy.csv --data_root /data --n_utts 30
    python tools/bench_speed.py --w2v2_base --device cuda:0  # random wav2vec2-base-sized model, GPU
    python tools/bench_speed.py --device cuda:0 --precision bf16 --compile
    python tools/bench_speed.py --w2v2_base --device cuda:0 --cuda_graphs off   # eager steps
    python tools/bench_speed.py --population --n_utts 6 --seconds 2   # E-BATS/FOA: batched population
    python tools/bench_speed.py --two_lengths 3,8 --json fixed.json   # fixed cost per utterance

``--two_lengths A,B`` (A < B) times one pass of ``--n_utts`` utterances per length (no rounds:
``--repeats`` is refused) and writes its figures to ``--json`` as well (``two_lengths_json``).

Runtime options (``--precision``, ``--compile``, ``--cache_features``, ``--onednn_backward``,
``--cuda_graphs``) go to every entry's lobe (``tta_brain.lobes.runtime.Runtime``), ``--slow_grad`` to
DSUTA. ``--cuda_graphs`` (auto | on | off; CUDA, fp32: auto and on replay the methods'
adaptation steps from captured graphs, ``tta_brain.gpu``); the unit passes stay eager, so the
overhead column of a captured method
can come out negative. ``tools/gpu_check.py`` runs the eager and the captured benchmark side by
side.
"""
import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench_args import (at_least, auto_or, device, finite, output_file, positive, seed,  # noqa: E402
                        positives)
from tta_brain.hparams import rules  # noqa: E402
from tta_brain.hparams.rules import HparamsError  # noqa: E402
from tta_brain.methods import losses  # noqa: E402
from tta_brain.lobes.hf_ctc import HFCTCLobe  # noqa: E402
from tta_brain.methods import UttInfo, build_method  # noqa: E402
from tta_brain.lobes.runtime import Runtime, process_settings  # noqa: E402
from tta_brain.lobes.testing import BASE_960H, TINY, save_random_ctc_model  # noqa: E402
from tta_brain.methods.params import select_parameters  # noqa: E402
from tta_brain.methods.resets import make_reset_policy  # noqa: E402

SYNTH_MODEL = os.path.join(ROOT, "recipes", "synthetic", "source_model")
SYNTH_CONF = os.path.join(ROOT, "recipes", "synthetic", "conf", "source_model.yaml")
# The synthetic recipe's source model (recipes/synthetic/conf/source_model.yaml), used when that
# file cannot be read.
SYNTH_CFG = dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4, intermediate_size=768,
                 conv_dim=(64,) * 7, conv_kernel=(10, 3, 3, 3, 3, 2, 2), conv_stride=(5, 2, 2, 2, 2, 2, 2),
                 conv_bias=True, feat_extract_norm="group", do_stable_layer_norm=True,
                 num_conv_pos_embeddings=64, num_conv_pos_embedding_groups=16)
UNITS = ("unit_fb", "unit_f")
TRAIN_UNIT = "unit_fb_train"    # timed too when a benchmarked method adapts in train mode
ALL_METHODS = ("source", "suta", "dsuta", "dsuta+dynamic")
#: The field's gradient methods (``--methods tent,eata,sar,cotta,cea``) run at their own defaults
#: (the class defaults, which are the packaged yamls'), not with --adapt / --suta_steps; EATA's and
#: SAR's reliability filters are opened so every utterance takes its step (a random model is
#: never reliable: the worst case), EATA's Fisher term comes from other generated speech.
FIELD = {"tent": {}, "eata": {"e_margin_factor": 10.0}, "sar": {"e_margin_factor": 10.0},
         "cotta": {}, "cea": {}, "lame": {}, "t3a": {}, "foa": {}, "ebats": {}}
STATS_KINDS = {"eata": ("fisher",), "foa": ("hidden",), "ebats": ("hidden", "tokens")}


# ------------------------------------------------------------------------------ model
def build_random_model(out_dir, w2v2_base=False, seed=0):
    """A randomly initialised CTC model: wav2vec2-base-960h's architecture, or the synthetic
    recipe's source model's (``recipes/synthetic/conf/source_model.yaml``)."""
    if w2v2_base:
        return save_random_ctc_model(out_dir, seed, **dict(BASE_960H, layerdrop=0.0,
                                                           mask_time_prob=0.0))
    cfg = dict(SYNTH_CFG)
    try:
        import yaml
        with open(SYNTH_CONF) as f:
            cfg = {k: tuple(v) if isinstance(v, list) else v
                   for k, v in yaml.safe_load(f)["model"].items()}
    except (OSError, KeyError, ImportError):
        pass
    return save_random_ctc_model(out_dir, seed, **dict(cfg, layerdrop=0.0, mask_time_prob=0.0))


# ------------------------------------------------------------------------------ audio
def generated_stream(n_utts, seconds, seed=0):
    """Speech-like waveforms (harmonic tones with a syllable-rate envelope + noise), lengths
    uniform in [0.75, 1.25] x ``seconds``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_utts):
        sec = seconds * (0.75 + 0.5 * torch.rand((), generator=g).item())
        n = int(16000 * sec)
        t = torch.arange(n) / 16000
        f0 = 100 + 100 * torch.rand((), generator=g).item()
        env = 0.5 * (1 + torch.sin(2 * torch.pi * (2 + 3 * torch.rand((), generator=g).item()) * t))
        wav = env * sum(torch.sin(2 * torch.pi * f0 * h * t) / h for h in (1, 2, 3, 4))
        wav = 0.3 * wav + 0.05 * torch.randn(n, generator=g)
        out.append((UttInfo(id=f"gen{i}", position=i, domain="gen", segment=0), wav.float()))
    return out


def csv_stream(path, data_root, n_utts, max_duration=20.0):
    from tta_brain.data.audio import load_audio
    from tta_brain.data.manifest import ManifestError, read_manifest
    out = []
    try:
        for row in read_manifest(path, replacements={"data_root": data_root or ""}):
            if float(row.get("duration") or 0) > max_duration:
                continue
            info = UttInfo(id=row["ID"], position=len(out), domain=row.get("domain", ""),
                           segment=int(row.get("segment") or 0))
            out.append((info, load_audio(row["wav"])))
            if n_utts and len(out) >= n_utts:
                break
    except (ManifestError, OSError, ValueError) as e:     # a bad manifest or audio file (AudioError)
        raise SystemExit(f"ERROR: --stream {path}: {' '.join(str(e).split())}") from None
    return out


# ------------------------------------------------------------------------------ entries
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class UnitPass:
    """The reference passes: one forward with grad + SUTA loss + backward (``fb``; ``fb_train``:
    the same with the model in train mode, as a train-mode method adapts), or one no-grad
    forward to the logits (``f``), with the same adapted-parameter selection and backward
    kernels as the methods, on inputs prepared beforehand (a method normalises an utterance once,
    whatever its pass count), gradients zeroed in place as the methods do. ``prime`` runs the
    pass once untimed, so that the timed ``process`` is the steady-state cost."""

    def __init__(self, lobe, adapt_params, kind):
        self.lobe, self.kind = lobe, kind
        self.train = kind == "fb_train"
        lobe.model.eval()
        lobe.model.requires_grad_(False)
        self.params = [p for _, p, _ in select_parameters(lobe.model, adapt_params)]
        for p in self.params:
            p.requires_grad_(True)
        self.counts = {}
        self.prepared = {}

    def _pass(self, x):
        if self.kind == "f":
            with torch.no_grad():
                self.lobe.logits(x)
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        if self.train:
            self.lobe.model.train()
        loss = losses.suta_loss(self.lobe.logits(x), blank_id=self.lobe.blank_id).mean()
        if self.train:
            self.lobe.model.eval()
        self.lobe.runtime.backward(loss, self.params, self.lobe.device)

    def prime(self, wav, info):
        """The first run on this input (prepared outside the timing)."""
        self.prepared[info.id] = x = self.lobe.prepare(wav)
        self._pass(x)

    def process(self, wav, info=None):
        x = self.prepared.pop(info.id, None) if info is not None else None
        self._pass(self.lobe.prepare(wav) if x is None else x)
        return ""


def make_entry(name, args, model_dir, device):
    runtime = Runtime(precision=args.precision, compile=args.compile,
                      cache_features=args.cache_features,
                      cpu_native_backward=not args.onednn_backward,
                      cuda_graphs=getattr(args, "cuda_graphs", "auto"),
                      cuda_graph_warmup=getattr(args, "cuda_graph_warmup", 1),
                      cuda_graph_buckets=getattr(args, "cuda_graph_buckets", "auto"),
                      cuda_graph_cache=getattr(args, "cuda_graph_cache", "auto"),
                      convolutions=getattr(args, "convolutions", "native"))
    lobe = HFCTCLobe(model_dir, device=str(device), runtime=runtime)
    adapt = [{"select": s} for s in args.adapt.split(",")]
    if name in UNITS or name == TRAIN_UNIT:
        return UnitPass(lobe, adapt, name[len("unit_"):])
    base, _, reset = name.partition("+")
    if base in FIELD:
        kw = dict(FIELD[base], model=lobe, **field_stats(base, lobe, args))
        if reset:
            kw["reset_policy"] = make_reset_policy(reset, K=args.reset_K)
        return build_method(base, **kw)
    kw = dict(model=lobe, lr=args.lr)
    if base != "source":
        kw.update(adapt_params=adapt)
    if base == "dsuta":
        kw.update(steps=args.dsuta_steps, buffer_size=args.buffer_size)
        if args.slow_grad != "reuse":
            kw["slow_grad"] = args.slow_grad
    elif base != "source":
        kw["steps"] = args.suta_steps
    if reset:
        kw["reset_policy"] = make_reset_policy(reset, K=args.reset_K, patience=args.reset_patience,
                                               threshold=args.reset_threshold)
    return build_method(base, **kw)


def field_stats(name, lobe, args):
    """The ``source_stats`` of EATA (Fisher information), FOA and E-BATS (hidden / token
    statistics) on 4 other generated utterances, in a temporary file (removed at exit)."""
    if name not in STATS_KINDS:
        return {}
    import atexit
    import shutil
    from tta_brain.methods import source_stats as ss
    clean = [lobe.prepare(w) for _, w in generated_stream(4, args.seconds, args.seed + 1)]
    record = ss.SourceStats(stats={k: ss.KINDS[k](lobe, clean, {}) for k in STATS_KINDS[name]},
                            manifest="generated", manifest_sha1="", model="",
                            model_params_sha1=ss.params_sha1(lobe.model), n_utts=len(clean))
    folder = tempfile.mkdtemp(prefix=f"bench_{name}_")
    atexit.register(shutil.rmtree, folder, True)
    ss.save(record, os.path.join(folder, "stats.pt"))
    return {"source_stats": os.path.join(folder, "stats.pt")}


def timed(entry, wav, info, device):
    """(wall, process CPU) seconds of one ``entry.process``."""
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    entry.process(wav, info)
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


FRAME = 320      # samples per output frame of the wav2vec2 CNN (total stride)


def variant(info, wav, r, j, fresh):
    """Entry ``j``'s copy of an utterance in round ``r``: shortened by ``j`` frames when fresh."""
    if fresh and j:
        cut = min(FRAME * j, max(wav.numel() - 16000, 0))
        wav = wav[:wav.numel() - cut]
    pos = (r + 2) * 100000 + info.position          # warm-up: r = -1, profile: r = -2
    return UttInfo(id=f"{info.id}@r{r}e{j}", position=pos, domain=info.domain,
                   segment=info.segment), wav


# ------------------------------------------------------------------------------ CMA-ES population
POPULATION_MODES = {"batched": dict(population_batch=0),           # the default
                    "one at a time": dict(population_batch=1),     # same prefix, a loop
                    "reference loop": dict(population_batch=1, shared_prefix=False)}


def population_speed(args, model_dir, device):
    """``--population``: E-BATS and FOA with the CMA-ES population in one batch vs one candidate
    at a time (from the shared prefix), vs the reference's loop (each candidate's forward from the
    input), on the same utterances, interleaved (rotating who goes first): wall and CPU time per
    audio second, speed-ups and whether the transcripts agree. Source statistics come from other
    generated speech."""
    utts = generated_stream(args.n_utts, args.seconds, args.seed)
    audio = sum(w.numel() for _, w in utts) / 16000
    res = {}
    for name in ("ebats", "foa"):
        runs = {}
        for mode, kw in POPULATION_MODES.items():
            lobe = HFCTCLobe(model_dir, device=str(device))
            runs[mode] = dict(method=build_method(name, model=lobe, **kw, **field_stats(name, lobe, args)),
                              wall=0.0, cpu=0.0, hyps=[])
        modes = list(runs)
        for i, (info, wav) in enumerate(utts):
            for mode in modes[i % 3:] + modes[:i % 3]:
                r = runs[mode]
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                r["hyps"].append(r["method"].process(wav, info))
                sync(device)
                r["wall"] += time.perf_counter() - t0
                r["cpu"] += time.process_time() - c0
        b = runs["batched"]
        n = b["method"].counts["adapt_forward"] / len(utts)
        res[name] = {mode: dict(s_per_audio_s=r["wall"] / audio, cpu_s_per_audio_s=r["cpu"] / audio,
                                speedup_of_batched_wall=r["wall"] / b["wall"],
                                speedup_of_batched_cpu=r["cpu"] / b["cpu"],
                                same_transcripts=r["hyps"] == b["hyps"]) for mode, r in runs.items()}
        print(f"{name}: {n:.0f} candidates per utterance; s per audio s (wall / CPU), batched's speed-up")
        for mode, r in res[name].items():
            print(f"  {mode:<15}{r['s_per_audio_s']:>9.4f} /{r['cpu_s_per_audio_s']:>8.4f}   "
                  f"{r['speedup_of_batched_wall']:>5.1f}x / {r['speedup_of_batched_cpu']:>4.1f}x   "
                  f"same transcripts: {r['same_transcripts']}", flush=True)
    return res


# ------------------------------------------------------------------------------ two lengths
def fixed_cost(short, long):
    """``(fixed s per utterance, s per audio s)`` of the line through two (audio s, s) points;
    nan, nan where both have the same audio length (no line)."""
    (a1, t1), (a2, t2) = short, long
    if a2 == a1:
        return float("nan"), float("nan")
    slope = (t2 - t1) / (a2 - a1)
    return t1 - slope * a1, slope


def _cells(*values, width=12):
    """Right-aligned table cells, each after a space: a wide value widens its cell, it never
    runs into its neighbour."""
    return "".join(f" {v:>{width}.4f}" if isinstance(v, float) else f" {v:>{width}}"
                   for v in values)


def two_lengths(args, model_dir, device):
    """``--two_lengths A,B``: seconds per utterance of each method at about A and at about B
    seconds (every utterance a new length, after ``--warmup`` utterances of about each length:
    a warm process, which with length buckets has met the buckets it is timed on), and the
    per-utterance fixed cost: the intercept of time = fixed + slope x audio seconds through the
    two."""
    secs = list(args.two_lengths)
    print(f"{'method':<16}" + _cells(f"s/utt {secs[0]:g} s", f"s/utt {secs[1]:g} s",
                                     "fixed s/utt", "s/audio s"), flush=True)
    res = {}
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        e = make_entry(name, args, model_dir, device)
        for k, sec in enumerate(secs):
            for info, wav in generated_stream(args.warmup, sec, args.seed + 7 + 100 * k):
                e.process(wav, info)
        points = []
        for k, sec in enumerate(secs):
            utts = generated_stream(args.n_utts, sec, args.seed + 11 + k)
            wall = sum(timed(e, wav, info, device)[0] for info, wav in utts)
            points.append((sum(w.numel() for _, w in utts) / 16000 / len(utts), wall / len(utts)))
        fixed, per_s = fixed_cost(*points)
        res[name] = dict(points=points, fixed_s_per_utt=fixed, s_per_audio_s=per_s)
        print(f"{name:<16}" + _cells(points[0][1], points[1][1], fixed, per_s), flush=True)
    return res


def two_lengths_json(res, args, model_desc, device):
    """What ``--two_lengths`` writes to ``--json``: the run (model, device, threads, torch,
    options), ``lengths_s`` (A, B) and per method ``points`` (one per length: the mean audio
    seconds per timed utterance and the wall seconds per utterance), ``fixed_s_per_utt`` and
    ``s_per_audio_s`` (null where there is no line: both points of the same audio length)."""
    def number(x):
        return x if x == x else None            # nan is not JSON
    return dict(mode="two_lengths", model=model_desc, device=str(device),
                threads=torch.get_num_threads(), torch=torch.__version__,
                lengths_s=list(args.two_lengths), n_utts_per_length=args.n_utts,
                warmup_per_length=args.warmup, options=vars(args),
                methods={m: dict(points=[dict(audio_s_per_utt=a, s_per_utt=t)
                                         for a, t in r["points"]],
                                 fixed_s_per_utt=number(r["fixed_s_per_utt"]),
                                 s_per_audio_s=number(r["s_per_audio_s"]))
                         for m, r in res.items()})


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="save_pretrained CTC dir (default: the synthetic "
                   "recipe's source model if trained, else a random model of its size)")
    p.add_argument("--w2v2_base", action="store_true",
                   help="random wav2vec2-base-sized model (for GPU timing)")
    p.add_argument("--stream", default=None, help="stream manifest CSV (default: generated audio)")
    p.add_argument("--data_root", default="", help="replaces $data_root in --stream")
    p.add_argument("--n_utts", type=positive(int), default=10, help="utterances per round")
    p.add_argument("--seconds", type=positive(float), default=3.0, help="mean length of generated utterances")
    p.add_argument("--lengths", default=None, choices=("fresh", "repeat"),
                   help="fresh (default): every pass meets a new input length, as on a real "
                   "stream; repeat: the rounds reuse the same utterances")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   type=device)
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help="comma-separated: source, suta, dsuta, dsuta+dynamic, dsuta+fixed, csuta, "
                   "tent, eata, sar, cotta, cea, ...")
    p.add_argument("--threads", type=positive(int), default=1, help="torch.set_num_threads (CPU); 1 is the "
                   "most stable on a shared machine")
    p.add_argument("--repeats", type=positive(int), default=None, help="rounds (default 3; "
                   "not with --two_lengths, which times one pass of --n_utts per length)")
    p.add_argument("--warmup", type=at_least(int, 0), default=6, help="utterances each entry processes first "
                   "(>= reset_K/2 + 1, so DSUTA + dynamic reset is timed in its detection stage)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--adapt", default="layernorm,cnn", help="parameter selectors (paper: layernorm,cnn)")
    p.add_argument("--lr", type=positive(float), default=2e-5)
    p.add_argument("--suta_steps", type=positive(int), default=10)
    p.add_argument("--dsuta_steps", type=positive(int), default=5)
    p.add_argument("--buffer_size", type=positive(int), default=5)
    p.add_argument("--reset_K", type=at_least(int, 4), default=10, help="reset K (dynamic: small, "
                   "so that the timed stream is in the detection stage: 2 LII forwards per "
                   "utterance; >= 4, with dsuta+dynamic at least 2 x --buffer_size)")
    p.add_argument("--reset_patience", type=positive(int), default=2)
    p.add_argument("--reset_threshold", type=finite(float), default=2.0)
    p.add_argument("--slow_grad", default="reuse", choices=("reuse", "recompute"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    p.add_argument("--cache_features", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--onednn_backward", action="store_true",
                   help="CPU: keep oneDNN in the backward (cpu_native_backward=False)")
    p.add_argument("--cuda_graphs", default="auto", choices=("auto", "on", "off"),
                   help="CUDA: replay the adaptation steps from captured graphs (Runtime.cuda_graphs)")
    p.add_argument("--cuda_graph_warmup", type=at_least(int, 0), default=1,
                   help="eager steps of a new length before its capture (0: none once warm)")
    p.add_argument("--cuda_graph_buckets", type=auto_or(at_least(float, 0)), default="auto",
                   help="length buckets of the captured steps (Runtime.cuda_graph_buckets; "
                        "auto: 0.1 on CUDA where exact, as decode; 0: off)")
    p.add_argument("--cuda_graph_cache", type=auto_or(positive(int)), default="auto",
                   help="captured graphs kept (Runtime.cuda_graph_cache; auto: as decode)")
    p.add_argument("--convolutions", default="native", choices=("native", "gemm"),
                   help="the CNN's convolutions: native (cuDNN / oneDNN) or gemm (matrix "
                        "products, Runtime.convolutions), as decode's run option")
    p.add_argument("--deterministic", default="true", choices=("true", "false"),
                   help="CUDA: deterministic kernels, as decode's run option (default true)")
    p.add_argument("--tf32", default="torch", choices=("torch", "off", "on"),
                   help="CUDA: TF32 use, as decode's run option (default torch: fp32 matmuls)")
    p.add_argument("--json", default=None, type=output_file, help="write the results here "
                   "(with --two_lengths: lengths_s [A, B] and per method its points [{audio_s_per_"
                   "utt, s_per_utt} at A, at B], fixed_s_per_utt and s_per_audio_s)")
    p.add_argument("--profile", default=None, help="cProfile this entry over the first round")
    p.add_argument("--two_lengths", default=None, type=positives(float, 2), metavar="A,B",
                   help="instead of the table: s per utterance of each method at about A and B "
                   "seconds (A < B) and the fixed cost per utterance (the intercept), e.g. 3,8; "
                   "--n_utts utterances per length after --warmup, one pass (no --repeats)")
    p.add_argument("--population", action="store_true", help="only E-BATS and FOA: the CMA-ES "
                   "population in one batch vs one candidate at a time (same transcripts?); on the "
                   "tests' tiny model unless --model")
    args = p.parse_args(argv)
    if args.two_lengths:
        if args.two_lengths[0] >= args.two_lengths[1]:
            p.error(f"--two_lengths {args.two_lengths[0]:g},{args.two_lengths[1]:g}: A must be "
                    f"shorter than B")
        if args.repeats is not None:
            p.error("--repeats: not with --two_lengths (one timed pass of --n_utts utterances "
                    "per length)")
    elif args.repeats is None:
        args.repeats = 3
    for opt, mode in (("lengths", "two_lengths"), ("lengths", "population"),
                      ("profile", "two_lengths"), ("profile", "population")):
        if getattr(args, opt) is not None and getattr(args, mode):      # else silently unused
            p.error(f"--{opt}: not with --{mode}, which does not use it")
    args.lengths = args.lengths or "fresh"
    if args.stream and not os.path.isfile(args.stream):
        p.error(f"--stream {args.stream}: no such file")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        p.error(f"--model {args.model}: not a save_pretrained CTC model folder (no config.json)")
    from tta_brain.methods import METHODS
    tokens = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.profile is not None and args.profile not in (*UNITS, TRAIN_UNIT, *tokens):
        p.error(f"--profile {args.profile}: not an entry of this run (entries: "
                f"{', '.join((*UNITS, *tokens))}; {TRAIN_UNIT} when a method adapts in train "
                f"mode)")
    for token in tokens:
        base, plus, reset = token.partition("+")
        if base not in METHODS or (plus and reset not in ("dynamic", "fixed", "oracle")):
            p.error(f"--methods: unknown method token {token!r} (methods: "
                    f"{', '.join(sorted(METHODS))}; resets: +dynamic, +fixed, +oracle)")
        if token == "dsuta+dynamic":                      # the runs' rule, as decode says it
            try:
                rules.check_dynamic_reset("dsuta+dynamic", {"reset_K": args.reset_K,
                                                            "buffer_size": args.buffer_size})
            except HparamsError as e:
                p.error(f"{e} (--reset_K, --buffer_size)")
    return args


def load_utterances(args):
    """(warm-up utterances, one list of timed utterances per round)."""
    n, R, W = args.n_utts, args.repeats, args.warmup
    need = W + (n * R if args.lengths == "fresh" else n)
    if args.stream:
        utts = csv_stream(args.stream, args.data_root, need)
        if len(utts) < W + n:
            raise SystemExit(f"{args.stream}: {len(utts)} usable utterances, need {W + n}")
        if len(utts) < need:
            print(f"note: {args.stream} has {len(utts)} utterances (< {need}): rounds reuse "
                  f"utterances (lengths still differ per entry)")
    else:
        utts = generated_stream(need, args.seconds, args.seed)
    warm, rest = utts[:W], utts[W:]
    if args.lengths == "fresh":
        rounds = [[rest[(r * n + i) % len(rest)] for i in range(n)] for r in range(R)]
    else:
        rounds = [rest[:n]] * R
    return warm, rounds


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    process_settings(device, args.deterministic == "true", args.tf32)   # as decode's run options
    tmp = None
    model_dir = args.model
    if model_dir is None:
        if not args.w2v2_base and os.path.isfile(os.path.join(SYNTH_MODEL, "config.json")):
            model_dir = SYNTH_MODEL
        else:
            tmp = tempfile.TemporaryDirectory(prefix="bench_speed_")
            model_dir = build_random_model(tmp.name, w2v2_base=args.w2v2_base, seed=args.seed)
    model_desc = model_dir if tmp is None else ("random wav2vec2-base" if args.w2v2_base
                                                 else "random synthetic-size wav2vec2")
    if args.population:
        tiny = tempfile.TemporaryDirectory(prefix="bench_pop_")
        if args.model is None:          # the tests' tiny random wav2vec2 (31 k parameters)
            model_dir = save_random_ctc_model(tiny.name, args.seed, **TINY)
            model_desc = "tiny random wav2vec2 (lobes.testing.TINY)"
        print(f"model: {model_desc}; device: {device}, threads: {torch.get_num_threads()}; "
              f"{args.n_utts} generated utterances (mean {args.seconds} s)", flush=True)
        try:
            return population_speed(args, model_dir, device)
        finally:
            tiny.cleanup()
            if tmp is not None:
                tmp.cleanup()
    if args.two_lengths:
        print(f"model: {model_desc}; device: {device}, threads: {torch.get_num_threads()}; "
              f"{args.n_utts} utterances per length after {args.warmup} warm-up; cuda_graphs: "
              f"{args.cuda_graphs}", flush=True)
        try:
            res = two_lengths(args, model_dir, device)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(two_lengths_json(res, args, model_desc, device), f, indent=1)
                print(f"wrote {args.json}")
            return res
        finally:
            if tmp is not None:
                tmp.cleanup()
    fresh = args.lengths == "fresh"
    warm, rounds = load_utterances(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    built = {m: make_entry(m, args, model_dir, device) for m in methods}
    train_mode = {m: bool(getattr(e, "train_mode", False)) for m, e in built.items()}
    unit_names = list(UNITS) + ([TRAIN_UNIT] if any(train_mode.values()) else [])
    names = unit_names + methods
    if args.profile is not None and args.profile not in names:    # (no method adapts in train mode)
        raise SystemExit(f"--profile {args.profile}: not an entry of this run (entries: "
                         f"{', '.join(names)})")
    entries = {n: built[n] if n in built else make_entry(n, args, model_dir, device)
               for n in names}
    n_adapted = max((getattr(e, "num_adapted", 0) for e in entries.values()), default=0)
    mean_s = statistics.mean(w.numel() for rnd in rounds for _, w in rnd) / 16000
    print(f"model: {model_desc} ({sum(p.numel() for p in entries['unit_f'].lobe.parameters()) / 1e6:.2f}M "
          f"params, {n_adapted / 1e3:.1f}k adapted: {args.adapt})")
    print(f"device: {device}, threads: {torch.get_num_threads()}, torch {torch.__version__}; "
          f"{args.repeats} rounds x {args.n_utts} utts (mean {mean_s:.2f} s; lengths: "
          f"{args.lengths}) after {len(warm)} warm-up; precision: {args.precision}, compile: {args.compile}, "
          f"cache_features: {args.cache_features}, slow_grad: {args.slow_grad}, "
          f"cpu_native_backward: {not args.onednn_backward}, cuda_graphs: {args.cuda_graphs}, "
          f"convolutions: {args.convolutions}", flush=True)

    for j, (name, e) in enumerate(entries.items()):      # warm-up (and reach a steady state)
        for info, wav in warm:
            info, wav = variant(info, wav, -1, j, fresh)
            if isinstance(e, UnitPass):
                e.prime(wav, info)
            e.process(wav, info)
    sync(device)
    if args.profile:
        import cProfile
        import pstats
        j = names.index(args.profile)
        prof = cProfile.Profile()
        prof.enable()
        for info, wav in rounds[0]:
            entries[args.profile].process(*reversed(variant(info, wav, -2, j, fresh)))
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)

    clocks = ("wall", "cpu") if device.type == "cpu" else ("wall",)
    rate = {c: {n: [] for n in names + [u + "_new" for u in unit_names]} for c in clocks}  # s / audio s
    counts = {n: [] for n in names}
    gc.collect()
    gc.disable()                    # no collector pauses charged to whichever entry triggers them
    for r, utts in enumerate(rounds):
        gc.collect()
        acc = {c: dict.fromkeys(names, 0.0) for c in clocks}
        new = {c: dict.fromkeys(unit_names, 0.0) for c in clocks}
        audio = dict.fromkeys(names, 0.0)
        before = {n: dict(getattr(entries[n], "counts", {})) for n in names}
        for i, (info0, wav0) in enumerate(utts):
            k = (r * len(utts) + i) % len(names)             # rotate who goes first
            for n in names[k:] + names[:k]:
                info, wav = variant(info0, wav0, r, names.index(n), fresh)
                if isinstance(entries[n], UnitPass):
                    entries[n].prepared[info.id] = entries[n].lobe.prepare(wav)
                    w, c = timed(entries[n], wav, info, device)        # new length
                    new["wall"][n] += w
                    if "cpu" in new:
                        new["cpu"][n] += c
                    entries[n].prepared[info.id] = entries[n].lobe.prepare(wav)
                w, c = timed(entries[n], wav, info, device)
                acc["wall"][n] += w
                if "cpu" in acc:
                    acc["cpu"][n] += c
                audio[n] += wav.numel() / 16000
        for n in names:
            for c in clocks:
                rate[c][n].append(acc[c][n] / audio[n])
                if n in unit_names:
                    rate[c][n + "_new"].append(new[c][n] / audio[n])
            after = getattr(entries[n], "counts", {})
            counts[n].append({k: v - before[n].get(k, 0) for k, v in after.items()})
        print(f"round {r + 1}/{args.repeats} (wall s per audio s): " + ", ".join(
            f"{n} {rate['wall'][n][-1]:.4f}" for n in names), flush=True)
    gc.enable()

    n_total = sum(len(u) for u in rounds)
    per_utt = {m: {k: sum(d.get(k, 0) for d in counts[m]) / n_total
                   for k in ("adapt_forward", "adapt_backward", "infer_forward", "aux_forward")}
               for m in methods}
    res = {m: {"counts_per_utt": per_utt[m]} for m in methods}
    units = {}
    for clock in clocks:
        t = rate[clock]
        units[clock] = {u: dict(s_per_audio_s=statistics.median(t[u]), rounds=t[u],
                                new_length_s_per_audio_s=statistics.median(t[u + "_new"]),
                                new_length_rounds=t[u + "_new"]) for u in unit_names}
        pass_t = {}
        for m in methods:
            c = per_utt[m]
            # a forward without a backward (non-finite loss) costs about a no-grad forward;
            # the first pass of an utterance meets a new length (S in the module docstring)
            # a train-mode method's adaptation passes are costed at the train-mode unit
            fb_unit = TRAIN_UNIT if train_mode[m] else "unit_fb"
            first = fb_unit if c["adapt_backward"] >= 1 else "unit_f"
            pass_t[m] = [c["adapt_backward"] * fb + (c["adapt_forward"] - c["adapt_backward"]
                         + c["infer_forward"] + c["aux_forward"]) * f + (new - seen)
                         for fb, f, new, seen in zip(t[fb_unit], t["unit_f"], t[first + "_new"],
                                                     t[first])]
        for m in methods:
            over = [w - p for w, p in zip(t[m], pass_t[m])]
            r = dict(s_per_audio_s=statistics.median(t[m]), rounds=t[m], pass_s_per_audio_s=pass_t[m],
                     train_mode=train_mode[m],
                     overhead_s_per_audio_s=statistics.median(over),
                     overhead_frac=statistics.median(o / w for o, w in zip(over, t[m])))
            if "suta" in methods:
                r["ratio_to_suta"] = statistics.median(a / b for a, b in zip(t[m], t["suta"]))
                r["pass_ratio_to_suta"] = statistics.median(
                    a / b for a, b in zip(pass_t[m], pass_t["suta"]))
            res[m][clock] = r
    for clock in clocks:
        u = units[clock]
        fb, f = u["unit_fb"]["s_per_audio_s"], u["unit_f"]["s_per_audio_s"]
        fbn, fn = u["unit_fb"]["new_length_s_per_audio_s"], u["unit_f"]["new_length_s_per_audio_s"]
        title = "WALL TIME" if clock == "wall" else \
            "CPU TIME of this process (cross-check, insensitive to other processes' load)"
        print(f"\n{title}; unit costs per audio second (median): forward+loss+backward "
              f"{fb:.4f} s, no-grad forward {f:.4f} s (ratio {fb / f:.2f}); on a new length "
              f"{fbn:.4f} s and {fn:.4f} s")
        if TRAIN_UNIT in u:
            ft, ftn = u[TRAIN_UNIT]["s_per_audio_s"], u[TRAIN_UNIT]["new_length_s_per_audio_s"]
            print(f"train mode (dropout, LayerDrop, SpecAugment): forward+loss+backward {ft:.4f} s "
                  f"({ft / fb:.2f} x eval), on a new length {ftn:.4f} s; methods marked (train) "
                  f"are costed with it")
        hdr = (f"{'method':<16}{'s/audio s':>10}{'fwd+bwd':>9}{'infer':>7}{'aux':>6}"
               f"{'ratio':>8}{'pass ratio':>11}{'overhead s/aud s':>18}{'overhead %':>11}")
        print(hdr)
        print("-" * len(hdr))
        for m in methods:
            r, c = res[m][clock], per_utt[m]
            fbs = f"{c['adapt_forward']:.1f}" if c["adapt_forward"] == c["adapt_backward"] else \
                f"{c['adapt_forward']:.1f}/{c['adapt_backward']:.1f}"
            ratio = f"{r['ratio_to_suta']:.3f}" if "ratio_to_suta" in r else "-"
            pratio = f"{r['pass_ratio_to_suta']:.3f}" if "pass_ratio_to_suta" in r else "-"
            label = f"{m} (train)" if r["train_mode"] else m
            print(f"{label:<16}{r['s_per_audio_s']:>10.4f}{fbs:>9}{c['infer_forward']:>7.1f}"
                  f"{c['aux_forward']:>6.1f}{ratio:>8}{pratio:>11}"
                  f"{r['overhead_s_per_audio_s']:>18.4f}{100 * r['overhead_frac']:>10.1f}%")
    print("passes per utterance; ratio = time / SUTA's time (median over rounds); pass ratio = "
          "what the passes alone predict (counts x unit costs, the first pass of an utterance at "
          "its new-length cost); overhead = time - that")
    if args.json:
        out = dict(model=model_desc, device=str(device), threads=torch.get_num_threads(),
                   torch=torch.__version__, n_utts_per_round=args.n_utts, mean_utt_s=mean_s,
                   options=vars(args), units=units, methods=res)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if tmp is not None:
        tmp.cleanup()
    return res


if __name__ == "__main__":
    main()
