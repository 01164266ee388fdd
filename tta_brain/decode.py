"""Decode a stream with a TTA method: the SpeechBrain recipe skeleton.

    python -m tta_brain.decode <method or yaml> --source=<model dir or hub name> \\
        --stream_csv=<stream manifest> --output_folder=<exp dir> [--reset=dynamic] [--key=value]

``<method>`` is a packaged method (``python -m tta_brain.decode --help`` lists them) or the path of
a yaml. Every ``--key=value`` that is not a run option overrides the yaml (a later one wins over
an earlier one); ``python -m tta_brain.decode <method> --help`` lists the keys with their
defaults. Run options: ``--device``, ``--precision``, ``--compile``, ``--noprogressbar``;
SpeechBrain's training options are refused. Rerunning the same command resumes an interrupted run
(even one killed with ``kill -9``) from its last checkpoint.

Mistakes in the command, the yaml or the stream manifest stop the run with one ``ERROR:`` line
naming the file and the key (set ``TTA_DEBUG=1`` for the Python traceback).
"""
import json
import logging
import os
import shutil
import sys

import speechbrain as sb
import torch

from tta_brain import hparams as hp_files
from tta_brain.brain import TTABrain
from tta_brain.checkpoint import ResumeError
from tta_brain.cli import UsageError, help_text, parse_arguments, record_hparams
from tta_brain.data.loader import load_stream
from tta_brain.data.manifest import ManifestError
from tta_brain.envinfo import versions
from tta_brain.records import RecordError

logger = logging.getLogger(__name__)


def _fail(message):
    """Stop with a one-line message (no traceback unless TTA_DEBUG is set)."""
    if os.environ.get("TTA_DEBUG") and sys.exc_info()[1] is not None:
        raise
    raise SystemExit(f"ERROR: {message}")


def _determinism(device):
    """Deterministic kernels where they matter (CUDA); CPU kernels are deterministic already."""
    if device is not None and str(device).startswith("cuda"):
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        # warn_only: CTC loss backward (AWMC, SDPL) has no deterministic CUDA kernel
        torch.use_deterministic_algorithms(True, warn_only=True)


def _log_run(out, argv, seed):
    """Seed, versions and command in log.txt and env.log (SpeechBrain wrote the pip freeze)."""
    vers = versions()
    logger.info("Command: python -m tta_brain.decode %s", " ".join(argv))
    logger.info("Seed: %s", seed)
    logger.info("Versions: %s", json.dumps(vers))
    with open(os.path.join(out, "env.log"), "a", encoding="utf-8") as f:
        f.write("\n==============================\ntta-brain run\n")
        f.write(f"Command: python -m tta_brain.decode {' '.join(argv)}\n")
        f.write(f"Seed: {seed}\n")
        for k, v in vers.items():
            f.write(f"{k}: {v}\n")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_arguments(argv)
        if args.help:
            print(help_text(args.method))
            return None
        path = hp_files.find(args.method)
        resolved = hp_files.resolve(path, args.overrides)
    except (UsageError, hp_files.HparamsError) as e:
        _fail(str(e))
    for key in ("model", "method", "stream_csv", "output_folder"):
        if key not in resolved:
            _fail(f"{path}: no '{key}' key (a method yaml needs model, method, stream_csv and "
                  f"output_folder; `include: [run]` gives the last three)")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # cuBLAS reads it at start-up
    _determinism(resolved.get("device"))
    stream_csv, out = str(resolved["stream_csv"]), str(resolved["output_folder"])
    try:   # before the experiment folder exists: a bad manifest or model leaves nothing behind
        load_stream(stream_csv, resolved.get("data_root"))
    except ManifestError as e:
        _fail(f"{e} (--stream_csv)")
    try:
        hparams = hp_files.load(path, args.overrides)
    except hp_files.HparamsError as e:
        _fail(str(e))
    seed = hparams.get("seed")
    if seed is None:
        seed = 0
        sb.utils.seed_everything(seed)
        logger.warning("%s has no 'seed'; seeded with 0", path)
    sb.create_experiment_directory(experiment_directory=out)
    with open(os.path.join(out, "hyperparams.yaml"), "w", encoding="utf-8") as f:
        f.write(hp_files.resolved_text(path, args.overrides))
    _log_run(out, argv, seed)
    logger.info("%s", hparams["method"].describe())
    if not os.path.exists(os.path.join(out, "stream.csv")):
        shutil.copyfile(stream_csv, os.path.join(out, "stream.csv"))
    checkpointer = sb.utils.checkpoints.Checkpointer(os.path.join(out, "save"))
    brain = TTABrain(modules={"model": hparams["model"]}, hparams=hparams,
                     run_opts=args.run_opts, checkpointer=checkpointer,
                     record_hparams=record_hparams(resolved))
    try:
        summary = brain.evaluate(stream_csv, data_root=hparams.get("data_root"))
    except (ManifestError, ResumeError, RecordError) as e:
        logger.error("%s", e)
        _fail(str(e))
    wer = "-" if summary.wer is None else f"{summary.wer:.2f}%"
    print(f"{summary.method} | {summary.stream} | WER {wer} | {summary.n_utts} utts, "
          f"{summary.n_skipped} skipped, {len(summary.resets)} resets | "
          f"{summary.time_per_audio_s:.3f} s per audio s")
    return summary


if __name__ == "__main__":
    main()
