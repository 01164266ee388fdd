"""Decode a stream with a TTA method: the SpeechBrain recipe skeleton.

    python -m tta_brain.decode recipes/hparams/dsuta.yaml --source=<model dir or hub name> \\
        --stream_csv=<stream manifest> --output_folder=<exp dir> [--reset=dynamic] [--key=value]

Every ``--key=value`` that is not a SpeechBrain run option overrides the yaml. ``--device=cuda:0``
and ``--noprogressbar`` work as in any SpeechBrain recipe. Rerunning the same command resumes an
interrupted run from its last checkpoint.
"""
import logging
import os
import re
import shutil
import sys

import speechbrain as sb
from hyperpyyaml import load_hyperpyyaml

from tta_brain.brain import TTABrain

logger = logging.getLogger(__name__)


def load_hparams(hparams_file, overrides, device=None):
    """Load a method yaml with overrides; errors name the file and the bad key."""
    if not os.path.isfile(hparams_file):
        raise SystemExit(f"ERROR: hparams file not found: {hparams_file}")
    with open(hparams_file, encoding="utf-8") as f:
        text = f.read()
    if device is not None and re.search(r"^device:", text, re.M):
        # the lobe is built on the run device, so every state snapshot lives there too
        if isinstance(overrides, str):
            overrides = f"{overrides}\ndevice: {device}\n"
        else:
            overrides = {**(overrides or {}), "device": device}
    try:
        return load_hyperpyyaml(text, overrides)
    except KeyError as e:
        raise SystemExit(f"ERROR: {hparams_file}: {e.args[0]} (check the spelling of the "
                         f"--key=value overrides)") from None
    except ValueError as e:
        raise SystemExit(f"ERROR: {hparams_file}: {e}") from None


def main(argv=None):
    hparams_file, run_opts, overrides = sb.parse_arguments(sys.argv[1:] if argv is None else argv)
    hparams = load_hparams(hparams_file, overrides, getattr(run_opts, "device", None))
    out = hparams["output_folder"]
    sb.create_experiment_directory(experiment_directory=out, hyperparams_to_save=hparams_file,
                                   overrides=overrides)
    stream_csv = hparams["stream_csv"]
    if not os.path.isfile(stream_csv):
        raise SystemExit(f"ERROR: stream manifest not found: {stream_csv} (--stream_csv=...)")
    if not os.path.exists(os.path.join(out, "stream.csv")):
        shutil.copyfile(stream_csv, os.path.join(out, "stream.csv"))
    checkpointer = sb.utils.checkpoints.Checkpointer(os.path.join(out, "save"))
    brain = TTABrain(modules={"model": hparams["model"]}, hparams=hparams, run_opts=run_opts,
                     checkpointer=checkpointer)
    summary = brain.evaluate(stream_csv, data_root=hparams.get("data_root"))
    print(f"{summary['method']} | {summary['stream']} | WER {summary['wer']:.2f}% | "
          f"{summary['n_utts']} utts, {summary['n_skipped']} skipped, {len(summary['resets'])} resets"
          f" | {summary['time_per_audio_s']:.3f} s per audio s")
    return summary


if __name__ == "__main__":
    main()
