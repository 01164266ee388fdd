"""Batched sweeps (tta_brain.sweep, tta_brain.methods.batched): R runs of suta / csuta in one
process give the transcripts of the separate runs, each in an ordinary run folder.

Measured on the tiny model (lr up to 1e-2, up to 4 steps, 20 utterances): the adapted parameters
of a batched run and of its separate run differ by at most ~6e-5 (AdamW's normalised steps
amplify the last-bit differences of the batched forward where a gradient is ~0); the tolerance
below is 1e-3."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, kill_9_mid_run
from fake_corpora import write_stream
from tta_brain import decode, grid
from tta_brain import sweep
from tta_brain.run.folder import load_run

RECORDS = ("transcripts.csv", "resets.csv", "rejects.csv", "lii.csv", "wer.txt")
PARAM_TOL = 1e-3

SUTA = [["--lr=1e-3", "--steps=3"], ["--lr=3e-3", "--steps=2"],
        ["--lr=1e-2", "--steps=4", "--em_coef=0.5", "--temperature=1.0"]]
CSUTA = [["--lr=1e-3"], ["--lr=1e-2", "--steps=2", "--reset=fixed", "--reset_every=5"],
         ["--lr=3e-3", "--reset=oracle"], ["--lr=1e-2", "--reset=fixed", "--reset_every=3",
                                           "--seed=3"]]


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model_dir):
    root = write_stream(tmp_path_factory.mktemp("sweep_stream"))
    return {"root": root, "csv": root / "stream.csv", "model": tiny_model_dir}


def args(data, out, *extra, method="csuta"):
    return [method, f"--source={data['model']}", f"--stream_csv={data['csv']}",
            f"--output_folder={out}", f"--data_root={data['root']}", "--noprogressbar",
            "--ckpt_every=4", *extra]


def ckpt_params(out):
    (path,) = Path(out, "save").glob("CKPT+*/stream.ckpt")
    return torch.load(path, weights_only=False)["method"]["params"]


def separate(data, tmp, method, cfgs):
    outs = [tmp / f"sep{i}" for i in range(len(cfgs))]
    for out, cfg in zip(outs, cfgs):
        decode.main(args(data, out, *cfg, method=method))
    return outs


def assert_same_runs(batched, separate_outs):
    for b, s in zip(batched, separate_outs):
        for name in RECORDS:
            assert (b / name).read_text() == (s / name).read_text(), (b, name)
        rb, rs = load_run(b), load_run(s)            # ordinary run folders the report reads
        assert rb.summary.counts == rs.summary.counts
        assert rb.summary.fingerprint["hparams"] == rs.summary.fingerprint["hparams"]
        assert (b / "hyperparams.yaml").read_text().replace(str(b), "") == \
            (s / "hyperparams.yaml").read_text().replace(str(s), "")
        pb, ps = ckpt_params(b), ckpt_params(s)
        diff = max(float((x - y).abs().max()) for x, y in zip(pb, ps))
        assert diff < PARAM_TOL, (b, diff)


@pytest.mark.parametrize("method,cfgs", [("suta", SUTA), ("csuta", CSUTA)])
def test_batched_runs_equal_separate_runs(data, tmp_path, method, cfgs, capsys):
    seps = separate(data, tmp_path, method, cfgs)
    outs = [tmp_path / f"bat{i}" for i in range(len(cfgs))]
    summaries = sweep.run([args(data, o, *c, method=method) for o, c in zip(outs, cfgs)])
    assert all(s is not None for s in summaries)
    assert_same_runs(outs, seps)
    if method == "csuta":                            # the resets happened, per run
        assert [len(load_run(o).summary.resets) for o in outs] == [0, 4, 2, 6]
    # a second invocation skips every run and writes nothing
    stamps = {o: (o / "transcripts.csv").stat().st_mtime_ns for o in outs}
    capsys.readouterr()
    assert sweep.run([args(data, o, *c, method=method) for o, c in zip(outs, cfgs)]) == \
        [None] * len(cfgs)
    assert capsys.readouterr().out.count("finished with the same settings") == len(cfgs)
    assert stamps == {o: (o / "transcripts.csv").stat().st_mtime_ns for o in outs}


def test_refusals_are_one_line_and_write_nothing(data, tmp_path):
    cases = [
        ([args(data, tmp_path / "a", method="dsuta"), args(data, tmp_path / "b", method="dsuta")],
         "method dsuta is not batched"),
        ([args(data, tmp_path / "a"), args(data, tmp_path / "b", "--reset=dynamic")],
         "reset dynamic is not batched"),
        ([args(data, tmp_path / "a"), args(data, tmp_path / "b", "--max_duration=1")],
         "option max_duration differs"),
        ([args(data, tmp_path / "a"), args(data, tmp_path / "b", method="suta")], "yaml"),
    ]
    for argvs, expected in cases:
        with pytest.raises(sweep.Refused) as e:
            sweep.run(argvs)
        assert expected in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    res = subprocess.run([sys.executable, "-m", "tta_brain.sweep", *cases[0][0][0], "--",
                          *cases[0][0][1]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith("ERROR: not batched: run 1")


def test_killed_sweep_resumes(data, tmp_path):
    """kill -9 at the first checkpoint; the rerun (two runs by the sweep, one by a separate
    decode: the checkpoint is the method's own) gives the separate runs' records."""
    cfgs = CSUTA[:3]
    seps = separate(data, tmp_path, "csuta", cfgs)
    outs = [tmp_path / f"bat{i}" for i in range(3)]
    argvs = [args(data, o, *c, "--ckpt_every=2") for o, c in zip(outs, cfgs)]
    cmd = [sys.executable, "-m", "tta_brain.sweep", *argvs[0], "--", *argvs[1], "--",
           *argvs[2]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    kill_9_mid_run(cmd, outs[0], env)
    time.sleep(0.1)
    decode.main(argvs[1])
    sweep.run([argvs[0], argvs[2]])
    assert "Resuming" in (outs[0] / "log.txt").read_text()   # (the others may have restarted)
    for b, s in zip(outs, seps):
        for name in RECORDS:
            assert (b / name).read_text() == (s / name).read_text(), (b, name)


def grid_args(data, exp, *extra):
    return ["--exp_dir", str(exp), "--source", data["model"], "--data_root", str(data["root"]),
            "--streams", f"s={data['csv']}", "--methods", "suta csuta+fixed", "--seeds", "0",
            "--decode_opts=--noprogressbar --reset_every=5", "--sweep", "lr=1e-3,1e-2",
            "--nj", "1", "--poll", "0.2", *extra]


@pytest.mark.slow
def test_grid_batch_runs_makes_the_same_folders(data, tmp_path):
    assert grid.main(grid_args(data, tmp_path / "plain")) == 0
    assert grid.main(grid_args(data, tmp_path / "batched", "--batch_runs", "4")) == 0
    plain = sorted(p.parent.relative_to(tmp_path / "plain")
                   for p in (tmp_path / "plain").rglob("summary.json"))
    batched = sorted(p.parent.relative_to(tmp_path / "batched")
                     for p in (tmp_path / "batched").rglob("summary.json"))
    assert plain == batched and len(plain) == 4
    for rel in plain:
        for name in RECORDS:
            assert (tmp_path / "plain" / rel / name).read_text() == \
                (tmp_path / "batched" / rel / name).read_text(), (rel, name)
    log = "".join(p.read_text() for p in (tmp_path / "batched").rglob("log.txt"))
    assert "Batched sweep of 2 runs" in log


def test_grid_groups_runs_into_batches(data, tmp_path):
    """--batch_runs R: runs of one (stream, method yaml, source) in batches of at most R; a batch
    that cannot run batched is split into separate runs with a logged line."""
    a = grid.parse_args(grid_args(data, tmp_path, "--batch_runs", "3"))
    runs = grid.plan_runs(a)
    grid.check_done(runs)
    units = grid.batches(runs, 3)
    assert sorted(len(u) for u in units) == [2, 2]
    assert all(len({r.argv[0] for r in u}) == 1 for u in units)
    a1 = grid.parse_args(grid_args(data, tmp_path))
    assert [len(u) for u in grid.batches(grid.plan_runs(a1), a1.batch_runs)] == [1] * 4
    bad = grid.parse_args(grid_args(data, tmp_path, "--batch_runs", "3",
                                    "--sweep", "precision=fp32,bf16"))
    runs = grid.plan_runs(bad)
    grid.check_done(runs)
    assert all(len(u) == 1 for u in grid.batches(runs, 3))
