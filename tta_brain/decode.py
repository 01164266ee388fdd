"""Decode a stream with a TTA method: the SpeechBrain recipe skeleton.

    python -m tta_brain.decode recipes/hparams/dsuta.yaml --source=<model dir or hub name> \\
        --stream_csv=<stream manifest> --output_folder=<exp dir> [--reset=dynamic] [--key=value]

Every ``--key=value`` that is not a SpeechBrain run option overrides the yaml (a later one wins
over an earlier one with the same key). ``--device=cuda:0``
and ``--noprogressbar`` work as in any SpeechBrain recipe. Rerunning the same command resumes an
interrupted run (even one killed with ``kill -9``) from its last checkpoint.

Mistakes in the command, the yaml or the stream manifest stop the run with one ``ERROR:`` line
naming the file and the key (set ``TTA_DEBUG=1`` for the Python traceback). The seed and the
library versions go to ``log.txt``, ``env.log`` and ``summary.json``.
"""
import json
import logging
import os
import re
import shutil
import sys

import speechbrain as sb
import torch
import ruamel.yaml
import ruamel.yaml.error
import yaml
from hyperpyyaml import load_hyperpyyaml

from tta_brain.brain import ResumeError, TTABrain, load_stream, versions
from tta_brain.data.manifest import ManifestError

logger = logging.getLogger(__name__)

USAGE = ("usage: python -m tta_brain.decode <method.yaml> --source=<model> --stream_csv=<csv> "
         "--output_folder=<dir> [--data_root=<dir>] [--key=value ...]")
#: Errors raised while the yaml builds its objects (model, method, reset policy) that come from
#: the configuration, not from a bug: reported as one line.
_CONFIG_ERRORS = (ValueError, TypeError, ImportError, AttributeError, RuntimeError, OSError)


def _fail(message):
    """Stop with a one-line message (no traceback unless TTA_DEBUG is set)."""
    if os.environ.get("TTA_DEBUG") and sys.exc_info()[1] is not None:
        raise
    raise SystemExit(f"ERROR: {message}")


def _describe(err):
    """hyperpyyaml wraps constructor errors as ``(context, message)`` tuples: join them."""
    parts = [str(a) for a in err.args] or [type(err).__name__]
    return ": ".join(parts)


def _known_yamls(folder):
    try:
        return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
    except OSError:
        return []


def load_hparams(hparams_file, overrides, device=None):
    """Load a method yaml with overrides; errors name the file and the bad key."""
    if not os.path.isfile(hparams_file):
        folder = os.path.dirname(hparams_file) or "."
        known = _known_yamls(folder)
        hint = f" (methods in {folder}: {', '.join(known)})" if known else ""
        raise SystemExit(f"ERROR: hparams file not found: {hparams_file}{hint}")
    with open(hparams_file, encoding="utf-8") as f:
        text = f.read()
    if device is not None and re.search(r"^device:", text, re.M):
        # the lobe is built on the run device, so every state snapshot lives there too
        if isinstance(overrides, str):
            overrides = f"{overrides}\ndevice: {device}\n"
        else:
            overrides = {**(overrides or {}), "device": device}
    if isinstance(overrides, str) and overrides.strip():
        checker = ruamel.yaml.YAML()
        checker.allow_duplicate_keys = True      # a later --key=value wins, as in hyperpyyaml
        try:
            checker.load(overrides)
        except ruamel.yaml.error.YAMLError as e:
            _fail(f"bad --key=value override: {' '.join(str(e).split())}\n{overrides}")
    try:
        return load_hyperpyyaml(text, overrides)
    except KeyError as e:
        _fail(f"{hparams_file}: {e.args[0]} (check the spelling of the --key=value overrides)")
    except (yaml.YAMLError, ruamel.yaml.error.YAMLError) as e:
        msg = str(e).replace("<unicode string>", hparams_file)
        _fail(f"{hparams_file}: yaml syntax error (in the file or a --key=value override): "
              f"{' '.join(msg.split())}")
    except TypeError as e:
        _fail(f"{hparams_file}: {_describe(e)} (check the spelling of the keys passed to that "
              f"class in the yaml)")
    except _CONFIG_ERRORS as e:
        _fail(f"{hparams_file}: {_describe(e)}")


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


def last_wins(argv):
    """Drop a ``--key=value`` when a later one sets the same key (recipes append ``.opts``
    files: a later file overrides an earlier one; hyperpyyaml rejects duplicate keys)."""
    last = {a.split("=", 1)[0]: i for i, a in enumerate(argv) if a.startswith("--") and "=" in a}
    return [a for i, a in enumerate(argv)
            if not (a.startswith("--") and "=" in a) or last[a.split("=", 1)[0]] == i]


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit(USAGE)
    argv = last_wins(argv)
    # cuBLAS reads this when it starts; harmless on CPU
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    hparams_file, run_opts, overrides = sb.parse_arguments(argv)
    device = getattr(run_opts, "device", None)
    hparams = load_hparams(hparams_file, overrides, device)
    for key in ("model", "method", "stream_csv", "output_folder"):
        if key not in hparams:
            _fail(f"{hparams_file}: no '{key}' key (a method yaml needs model, method, "
                  f"stream_csv and output_folder)")
    _determinism(device or hparams.get("device"))
    seed = hparams.get("seed")
    if seed is None:
        seed = 0
        sb.utils.seed_everything(seed)
        logger.warning("%s has no 'seed'; seeded with 0", hparams_file)
    stream_csv, out = str(hparams["stream_csv"]), str(hparams["output_folder"])
    try:   # before the experiment folder exists: a bad manifest leaves nothing behind
        load_stream(stream_csv, hparams.get("data_root"))
    except ManifestError as e:
        _fail(f"{e} (--stream_csv)")
    sb.create_experiment_directory(experiment_directory=out, hyperparams_to_save=hparams_file,
                                   overrides=overrides)
    _log_run(out, argv, seed)
    if not os.path.exists(os.path.join(out, "stream.csv")):
        shutil.copyfile(stream_csv, os.path.join(out, "stream.csv"))
    checkpointer = sb.utils.checkpoints.Checkpointer(os.path.join(out, "save"))
    brain = TTABrain(modules={"model": hparams["model"]}, hparams=hparams, run_opts=run_opts,
                     checkpointer=checkpointer)
    try:
        summary = brain.evaluate(stream_csv, data_root=hparams.get("data_root"))
    except (ManifestError, ResumeError) as e:
        logger.error("%s", e)
        _fail(str(e))
    print(f"{summary['method']} | {summary['stream']} | WER {summary['wer']:.2f}% | "
          f"{summary['n_utts']} utts, {summary['n_skipped']} skipped, {len(summary['resets'])} resets"
          f" | {summary['time_per_audio_s']:.3f} s per audio s")
    return summary


if __name__ == "__main__":
    main()
