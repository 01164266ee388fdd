#!/usr/bin/env python3
"""Memory benchmark: peak memory of a full decode (``tta_brain.decode``) vs the stream length.

For every length N (default 50, 100, 200, 400 utterances) a fresh process decodes the first N
utterances of one generated two-domain stream with dsuta + dynamic reset (checkpoints, record
CSVs, summary: the whole recipe path) and reports

* peak RSS of the process (``VmHWM``), and its RSS at the end;
* RSS right after utterance 50, 100, 200, ... (the state carried along the stream);
* on CUDA, the peak of allocated and reserved device memory (``torch.cuda.max_memory_*``).

Nothing per utterance beyond the written records should be kept, so all figures stay flat; the
last line says whether the peak RSS of the longest stream exceeds the shortest one's by more than
``--tolerance_mb`` (exit status 1 then).

Utterance lengths: by default the stream cycles through ``--n_lengths 8`` distinct durations, so
the shape-keyed caches of the CPU kernels (oneDNN's primitive cache, LRU with 1024 entries, and
the heap those kernels fragment) are warm after a few utterances and what is left to see is
tta-brain's own state. With ``--n_lengths 0`` every utterance has its own length, as in a real
corpus: the RSS then creeps up by a few tens of MB until those library caches are full (about
+70 MB after ~3000 distinct shapes for the default model, flat afterwards; the same happens with a
bare forward/backward loop, without tta-brain), less with ``TTABrain``'s periodic ``malloc_trim``.

Usage::

    python tools/bench_memory.py                                   # CPU, generated tiny model
    python tools/bench_memory.py --lengths 50 100 200 400 800 --device cuda:0
    python tools/bench_memory.py --source /models/wav2vec2-base-960h --seconds 2 6 --device cuda:0
    python tools/bench_memory.py --decode_opts "--steps=5 --reset_K=50"

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tta_brain.testing import save_random_ctc_model  # noqa: E402
WORDS = ("ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL")
SR = 16000


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


def child(args):
    """Decode one stream in this process and print one JSON line of measurements."""
    import torch

    from tta_brain import decode
    from tta_brain.brain import TTABrain
    marks, rss_at = set(args.marks), {}
    orig = TTABrain.evaluate_batch

    def measured(self, batch, stage=None):
        hyp = orig(self, batch)
        done = batch[1].position + 1
        if done in marks:
            rss_at[done] = round(rss_mb(), 1)
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
    res = {"n": summary["n_utts"], "peak_rss_mb": round(peak_rss_mb(), 1),
           "end_rss_mb": round(rss_mb() or 0, 1), "rss_at": rss_at,
           "resets": len(summary["resets"]), "wer": round(summary["wer"], 2),
           "wall_s": round(time.time() - t0, 1)}
    if cuda:
        res["cuda_peak_alloc_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
        res["cuda_peak_reserved_mb"] = round(torch.cuda.max_memory_reserved() / 2 ** 20, 1)
    print("BENCH_MEMORY " + json.dumps(res), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[50, 100, 200, 400])
    p.add_argument("--device", default="cpu")
    p.add_argument("--source", help="CTC model dir or hub name (default: a generated tiny one)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seconds", type=float, nargs=2, default=(0.5, 1.0),
                   help="utterance durations: uniform in [min, max] s")
    p.add_argument("--n_lengths", type=int, default=8,
                   help="distinct utterance lengths (0: every utterance its own random length)")
    p.add_argument("--block", type=int, default=25, help="utterances per domain block")
    p.add_argument("--hparams", default="dsuta", help="method name or yaml (default: dsuta)")
    p.add_argument("--decode_opts", default="--reset=dynamic --reset_K=20 --buffer_size=5 "
                   "--steps=2 --lr=1e-3 --ckpt_every=50",
                   help="overrides passed to tta_brain.decode")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs")
    p.add_argument("--workdir", help="keep inputs and outputs here (default: a temp dir)")
    p.add_argument("--tolerance_mb", type=float, default=20.0)
    p.add_argument("--json", help="write the measurements here")
    # internal: one measured run
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--data_root", help=argparse.SUPPRESS)
    p.add_argument("--marks", type=int, nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    lengths = sorted(set(args.lengths))
    work = args.workdir or tempfile.mkdtemp(prefix="bench_memory_")
    os.makedirs(work, exist_ok=True)
    source = args.source or make_model(os.path.join(work, "model"), args.hidden, args.layers)
    rows = make_audio(work, lengths[-1], args.seconds, args.block, args.n_lengths)
    marks = sorted({m for m in (50, 100, 200, 400, 800, 1600, 3200) if m <= lengths[-1]}
                   | set(lengths))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "PYTHONPATH": ROOT}
    print(f"device {args.device} | model {source if args.source else 'generated wav2vec2 '}"
          f"{'' if args.source else f'(hidden {args.hidden}, {args.layers} layers)'} | "
          f"{args.hparams} {args.decode_opts} | utterances "
          f"{args.seconds[0]}-{args.seconds[1]} s "
          f"({f'{args.n_lengths} distinct lengths' if args.n_lengths else 'random lengths'}) | "
          f"work dir {work}", flush=True)
    results = []
    for n in lengths:
        stream = os.path.join(work, f"stream_{n}.csv")
        write_stream(stream, rows[:n])
        out = os.path.join(work, f"exp_{n}")
        shutil.rmtree(out, ignore_errors=True)      # a finished run would just be resumed
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--stream", stream,
               "--out", out, "--data_root", work, "--device", args.device,
               "--hparams", args.hparams, "--decode_opts=" + args.decode_opts,
               "--source", source, "--marks", *map(str, [m for m in marks if m <= n])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_MEMORY ")]
        if proc.returncode != 0 or not line:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"run with {n} utterances failed (exit {proc.returncode})")
        res = json.loads(line[0].split(" ", 1)[1])
        results.append(res)
        at = ", ".join(f"@{k}: {v:.1f}" for k, v in res["rss_at"].items())
        cuda = (f" | CUDA peak alloc {res['cuda_peak_alloc_mb']:.1f} MB, reserved "
                f"{res['cuda_peak_reserved_mb']:.1f} MB" if "cuda_peak_alloc_mb" in res else "")
        print(f"{n:6d} utts | peak RSS {res['peak_rss_mb']:8.1f} MB | end RSS "
              f"{res['end_rss_mb']:8.1f} MB | RSS after utterance ({at}) MB{cuda} | "
              f"{res['resets']} resets | WER {res['wer']:.1f}% | {res['wall_s']:.0f} s", flush=True)
    growth = results[-1]["peak_rss_mb"] - results[0]["peak_rss_mb"]
    flat = growth <= args.tolerance_mb
    line = (f"peak RSS {lengths[0]} -> {lengths[-1]} utterances: {growth:+.1f} MB "
            f"({100 * growth / results[0]['peak_rss_mb']:+.2f}%)")
    if "cuda_peak_alloc_mb" in results[0]:
        g = results[-1]["cuda_peak_alloc_mb"] - results[0]["cuda_peak_alloc_mb"]
        line += f"; CUDA peak allocated {g:+.1f} MB"
        flat = flat and g <= args.tolerance_mb
    print(f"{line} -> {'FLAT' if flat else 'GROWS'} (tolerance {args.tolerance_mb:.0f} MB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"},
                       "results": results, "growth_mb": growth, "flat": flat}, f, indent=1)
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
