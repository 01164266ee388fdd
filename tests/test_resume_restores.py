"""What a resume restores besides the records (mutation audit): the run's time and audio
seconds (the summary's time per audio second) and every random generator a method may draw
from, numpy's and Python's included."""
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from fake_corpora import write_stream
from tta_brain import decode
from tta_brain.run.brain import TTABrain
from tta_brain.run.checkpoint import STATE_FILE, StreamState

RUN = ["--steps=1", "--lr=0.05", "--noprogressbar"]


def args(root, model, out, *extra):
    return ["suta", f"--source={model}", f"--stream_csv={root / 'stream.csv'}",
            f"--output_folder={out}", f"--data_root={root}", *RUN, *extra]


def test_a_resumed_run_keeps_its_time_and_audio_seconds(tmp_path, tiny_model_dir, monkeypatch):
    root = write_stream(tmp_path / "data", n=10)
    ref = tmp_path / "ref"
    decode.main(args(root, tiny_model_dir, ref, "--ckpt_every=0"))
    out = tmp_path / "exp"
    orig = TTABrain.evaluate_batch

    def boom(self, batch, stage=None):
        if batch[1].position == 7:
            raise RuntimeError("simulated crash")
        return orig(self, batch)
    monkeypatch.setattr(TTABrain, "evaluate_batch", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        decode.main(args(root, tiny_model_dir, out, "--ckpt_every=3"))
    monkeypatch.setattr(TTABrain, "evaluate_batch", orig)
    saved = torch.load(next((out / "save").glob(f"CKPT+*/{STATE_FILE}")), weights_only=False)
    assert saved["cursor"] == 6 and saved["audio_time"] > 0 and saved["wall_time"] > 0
    decode.main(args(root, tiny_model_dir, out, "--ckpt_every=3"))
    got, want = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    assert got["audio_s"] == pytest.approx(want["audio_s"], rel=1e-9)     # every row counted once
    assert got["wall_time_s"] >= saved["wall_time"]      # the time before the crash counts too
    assert got["counts"] == want["counts"]               # the method's passes before it too
    for name in ("transcripts.csv", "resets.csv", "wer.txt"):
        assert (out / name).read_text() == (ref / name).read_text(), name


class _Method:
    batch = None

    def __init__(self):
        self.w = 0

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, sd):
        self.w = sd["w"]


def test_a_checkpoint_restores_every_random_generator(tmp_path):
    state = StreamState(_Method(), fingerprint={"stream_sha1": "x"})
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state._save(tmp_path / STATE_FILE)
    want = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    torch.manual_seed(9), np.random.seed(9), random.seed(9)        # a new process's generators
    StreamState(_Method(), fingerprint={"stream_sha1": "x"})._load(tmp_path / STATE_FILE)
    got = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    assert got == want
