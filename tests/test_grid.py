"""Run identity, one writer per folder and grids of runs on real engines.

- decode: a second writer on a folder stops at once naming the holder, the first finishes intact;
  a rerun with other settings is refused and changes nothing, ``--overwrite`` starts over, a rerun
  with the same settings is skipped;
- the local engine (submitit local workers) gives the transcripts of serial runs; a worker killed
  with ``kill -9`` mid-grid fails that run only, and rerunning the grid completes it (resumed from
  its checkpoint), skipping the finished runs;
- the same grid through a real Slurm cluster (skipped without one, except under CI=true), with a
  job cancelled (``scancel``) mid-grid.
"""
import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fake_corpora import write_stream
from tta_brain import decode, grid
from tta_brain.run import grid_plan, identity
from tta_brain.run.identity import LOCK_FILE

import compare_runs  # tools/, on the path from conftest.py

REPO = Path(__file__).resolve().parents[1]

RUN = ["--noprogressbar", "--ckpt_every=3"]             # run options: not in run names
METHOD = {"source": [], "suta": ["--steps=2", "--lr=0.05"], "csuta": ["--steps=2", "--lr=0.05"],
          "dsuta": ["--steps=2", "--lr=0.05", "--reset_K=4", "--buffer_size=2"]}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model_dir):
    root = write_stream(tmp_path_factory.mktemp("grid_stream"), n=24, block=6)
    conf = root / "conf"                 # the recipe's method settings (conf/<method>.opts)
    conf.mkdir()
    for method, opts in METHOD.items():
        (conf / f"{method}.opts").write_text("\n".join(opts) + "\n")
    return {"root": root, "csv": root / "stream.csv", "model": tiny_model_dir, "conf": conf}


def decode_argv(data, out, method="suta", *extra):
    return [method, f"--source={data['model']}", f"--stream_csv={data['csv']}",
            f"--output_folder={out}", f"--data_root={data['root']}", *RUN,
            *METHOD.get(method, METHOD["suta"]),
            *extra]


def grid_argv(data, exp, methods, seeds="0 1", *extra):
    return ["--exp_dir", str(exp), "--source", data["model"], "--data_root", str(data["root"]),
            "--streams", f"s={data['csv']}", "--methods", methods, "--seeds", seeds,
            "--conf_dir", str(data["conf"]), f"--decode_opts={' '.join(RUN)}", "--poll", "0.5",
            *extra]


def serial(data, exp, methods, seeds=("0", "1")):
    """The grid's runs decoded one after another in this process: the reference."""
    for token in methods.split():
        base, _, reset = token.partition("+")
        for seed in seeds:
            decode.main(decode_argv(data, exp / "s" / token / f"seed{seed}", base,
                                    *([f"--reset={reset}"] if reset else []), f"--seed={seed}",
                                    "--stream_name=s"))


def finished_grid(argv):
    """The runs a grid of ``argv`` plans, decoded one after another in this process as its jobs
    decode them (``grid.DecodeJob``: ``decode.main`` of the run's argv): a finished grid to
    start a test from, without a job process per run."""
    for run in grid.plan_runs(grid.parse_args(argv)):
        decode.main(run.argv)


def snapshot(folder):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(folder).iterdir()
            if p.is_file()}


def wait_for(cond, what, timeout=240):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def holder_pid(folder):
    try:
        return json.loads((Path(folder) / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


# ----------------------------------------------------------------------------- one folder
@pytest.mark.slow
def test_second_writer_stops_at_once_and_the_first_finishes_intact(data, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "exp"
    decode.main(decode_argv(data, ref, "dsuta", "--reset=dynamic"))
    cmd = [sys.executable, "-m", "tta_brain.decode", *decode_argv(data, out, "dsuta", "--reset=dynamic")]
    first = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: holder_pid(out) == first.pid or first.poll() is not None, "the lock")
    t0 = time.time()
    second = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first run ended too early: the test would prove nothing"
    assert second.returncode == 1 and time.time() - t0 < 60
    assert f"is being written by pid {first.pid} on " in second.stderr, second.stderr[-2000:]
    assert second.stderr.count("\n") <= 2                       # one line, no traceback
    assert first.wait(timeout=300) == 0, first.stdout.read()[-3000:]
    assert compare_runs.compare(ref, out) == []


def test_compare_runs_follows_run_folders_gathered_by_links(tmp_path):
    """Runs gathered into a folder by symlinks were not found ("nothing to compare"); now a
    linked folder is followed, and a link loop ends."""
    real, linked = tmp_path / "real" / "s" / "suta", tmp_path / "linked" / "s"
    real.mkdir(parents=True)
    (real / "summary.json").write_text("{}")
    linked.mkdir(parents=True)
    (linked / "suta").symlink_to(real)
    (linked / "loop").symlink_to(tmp_path / "linked")
    assert list(compare_runs.runs(tmp_path / "linked")) == ["s/suta"]
    from tta_brain.run.folder import walk              # the report's walk is the same one
    assert [os.path.relpath(d, tmp_path / "linked") for d, files in walk(tmp_path / "linked")
            if "summary.json" in files] == ["s/suta"]


def test_the_results_walk_leaves_out_checkpoint_plot_and_hidden_folders(tmp_path):
    """A results root's walk does not descend into runs' checkpoints (``save/``: hundreds of
    files a run, over a network file system), plots or hidden folders."""
    from tta_brain.run.folder import walk
    run = tmp_path / "s" / "suta" / "seed0"
    for sub in ("save/CKPT+1", "plots", ".snapshot/old", "__pycache__"):
        (run / sub).mkdir(parents=True)
        (run / sub / "summary.json").write_text("{}")
    (run / "summary.json").write_text("{}")
    assert [os.path.relpath(d, tmp_path) for d, _ in walk(tmp_path)] == [
        ".", "s", "s/suta", "s/suta/seed0"]


def test_compare_runs_never_reads_nothing_as_the_same(tmp_path, capsys):
    """A mistyped or empty root used to print '0 same, 0 different' and exit 0."""
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "s" / "suta").mkdir(parents=True)
    b.mkdir()
    assert compare_runs.main([str(a), str(tmp_path / "typo")]) == 2
    assert f"{tmp_path / 'typo'}: no such directory" in capsys.readouterr().err
    assert compare_runs.main([str(a), str(b)]) == 2                # neither holds a run folder
    assert "nothing to compare" in capsys.readouterr().err
    (a / "s" / "suta" / "summary.json").write_text("{}")
    assert compare_runs.main([str(a), str(b)]) == 1                # one side only: missing
    assert f"s/suta: only under {a}\n" in capsys.readouterr().out
    (b / "s" / "suta").mkdir(parents=True)     # unfinished there (was said as if missing)
    assert compare_runs.main([str(a), str(b)]) == 1
    assert f"s/suta: only under {a} (under {b}: unfinished, no summary.json)\n" in (
        capsys.readouterr().out)                                    # was json's traceback
    (b / "s" / "suta" / "summary.json").write_text('{"method": "su')
    assert compare_runs.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"{a / 's' / 'suta' / 'summary.json'}: not a summary of this tta_brain version" in out
    (a / "s" / "suta" / "transcripts.csv").write_bytes(b"ID,hyp\nu1,\xff\xfe\n")  # was a traceback
    (b / "s" / "suta" / "transcripts.csv").write_text("ID,hyp\nu1,A\n")
    assert compare_runs.main([str(a), str(b)]) == 1
    assert f"transcripts.csv: {a / 's' / 'suta' / 'transcripts.csv'} is not a UTF-8 CSV" in (
        capsys.readouterr().out)


def test_compare_runs_shows_the_first_differing_row_of_each_side(tmp_path):
    """The line for a record file that differs shows its first differing row as each side has
    it, a row one side lacks as ``-`` (a run that wrote more rows than the other)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for root, text in ((a, "ID,hyp\nu1,A\nu2,B\n"), (b, "ID,hyp\nu1,A\nu2,C\nu3,D\n")):
        root.mkdir()
        (root / "transcripts.csv").write_text(text)
    assert compare_runs.compare(a, b)[0] == ("transcripts.csv: 3 vs 4 rows, first difference at "
                                             "row 2: ['u2', 'B'] != ['u2', 'C']")
    (a / "transcripts.csv").write_text("ID,hyp\nu1,A\n")              # b has one row more
    assert compare_runs.compare(a, b)[0] == ("transcripts.csv: 2 vs 4 rows, first difference at "
                                             "row 2: - != ['u2', 'C']")


def test_compare_runs_says_every_difference_of_two_real_runs(data, tmp_path, capsys):
    """compare_runs proves that a change decoded the same: a copy of a real run is "same"
    (exit 0); one changed row of any record file (the last row too) or one changed result field
    of summary.json is DIFFERENT (exit 1), naming that file or field. Timings are not compared."""
    ref = tmp_path / "ref" / "s" / "dsuta"
    decode.main(decode_argv(data, ref, "dsuta", "--reset=dynamic"))
    names = ("transcripts.csv", "resets.csv", "lii.csv", "rejects.csv")
    assert all((ref / name).is_file() for name in names)

    def copy():
        out = tmp_path / "exp"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(tmp_path / "ref", out)
        return out / "s" / "dsuta"

    def changed(name):
        assert compare_runs.main([str(tmp_path / "ref"), str(tmp_path / "exp")]) == 1, name
        out = capsys.readouterr().out
        assert "s/dsuta: DIFFERENT" in out and "0 same, 1 different or missing" in out, out
        return out

    summary = json.loads((ref / "summary.json").read_text())
    summary["wall_time_s"] += 1.0                                  # not a result: the same
    (copy() / "summary.json").write_text(json.dumps(summary))
    assert compare_runs.main([str(tmp_path / "ref"), str(tmp_path / "exp")]) == 0
    assert "s/dsuta: same" in capsys.readouterr().out
    for name in names:
        rows = (ref / name).read_text().splitlines()
        n = len(rows) - 1
        rows[-1] = rows[-1] + "x"              # its last row, one cell: the first difference
        (copy() / name).write_text("\n".join(rows) + "\n")
        assert f"{name}: {n + 1} vs {n + 1} rows, first difference at row {n}: " in changed(name)
        (copy() / name).unlink()               # a record one run has and the other has not
        assert f"{name}: missing on one side" in changed(name)
    for key in ("method", "stream", "seed", "wer", "wer_per_domain", "n_utts", "n_words", "n_err",
                "n_skipped", "skipped", "resets", "boundaries", "counts"):
        value = summary[key]
        other = (value + "x" if isinstance(value, str)
                 else value + 1 if isinstance(value, (int, float))
                 else value + [99] if isinstance(value, list) else {**value, "x": 1})
        (copy() / "summary.json").write_text(json.dumps({**summary, key: other}))
        assert f"summary {key}: {value!r} != {other!r}" in changed(key)


@pytest.mark.slow
def test_rerun_with_other_settings_is_refused_overwrite_and_skip(data, tmp_path):
    out = tmp_path / "exp"
    decode.main(decode_argv(data, out))
    before = snapshot(out)
    with pytest.raises(SystemExit) as e:
        decode.main(decode_argv(data, out, "suta", "--steps=3", "--lr=0.01"))
    msg = str(e.value)
    assert msg.startswith(f"ERROR: {out} holds a run with other settings (")
    assert "hparams.steps: 2 != 3" in msg and "hparams.lr: 0.05 != 0.01" in msg
    assert "--overwrite" in msg and "\n" not in msg
    assert snapshot(out) == before                               # nothing written, not even logs
    summary = decode.main(decode_argv(data, out))                # same settings: skipped
    assert summary.fingerprint["hparams"]["steps"] == 2 and snapshot(out) == before
    summary = decode.main(decode_argv(data, out, "suta", "--steps=3", "--overwrite"))
    assert summary.fingerprint["hparams"]["steps"] == 3
    s = json.loads((out / "summary.json").read_text())
    assert s["hparams"]["steps"] == 3 and s["counts"]["adapt_forward"] == 3 * 24


def test_the_audio_the_stream_names_is_part_of_the_fingerprint(data, tmp_path):
    """A noisy set mixed again (another seed, another noise file) keeps the stream manifest's
    paths: its finished runs were skipped as "the same settings" with the old audio's WER. The
    audio's content is fingerprinted (hashed once, then known by its stat from the manifest
    folder's hash cache); a run recorded before that matches."""
    root = tmp_path / "data"
    shutil.copytree(data["root"], root)
    argv = decode_argv({**data, "root": root, "csv": root / "stream.csv"}, tmp_path / "exp",
                       "source")
    first = decode.main(argv)
    assert first.fingerprint["audio_sha1"] and (root / ".sha1_cache.json").is_file()
    wav = sorted(root.rglob("*.wav"))[3]
    kept = wav.read_bytes()
    import soundfile
    audio, sr = soundfile.read(wav)
    soundfile.write(wav, audio * 0.5, sr, subtype="PCM_16")
    with pytest.raises(SystemExit) as e:
        decode.main(argv)
    assert "holds a run with other settings (audio_sha1: " in str(e.value)
    assert "the audio files the stream names changed since that run" in str(e.value)
    wav.write_bytes(kept)                                         # the same audio again
    assert decode.main(argv).fingerprint == first.fingerprint     # skipped
    older = {k: v for k, v in first.fingerprint.items() if k != "audio_sha1"}
    now = decode.plan(argv).fingerprint
    assert identity.differences(older, now) == [] == identity.differences(older, now, recorded=True)


def test_a_wrong_data_root_on_a_finished_run_is_said_as_missing_audio(data, tmp_path):
    """A finished run's rerun with its audio not found (a wrong --data_root, a corpus moved, a
    relative corpus path from another folder) was refused as audio "mixed again or replaced",
    with --overwrite as the way out: that deleted the run's records and then decoded nothing.
    The refusal now says how many files are missing and the first, in decode and the grid."""
    argv = decode_argv(data, tmp_path / "exp", "source")
    decode.main(argv)
    wrong = [a if not a.startswith("--data_root=") else f"--data_root={tmp_path / 'nowhere'}"
             for a in argv]
    with pytest.raises(SystemExit) as e:
        decode.main(wrong)
    msg = str(e.value)
    assert "audio_sha1: 24 of the 24 audio files the stream names are not found now (first: " \
           f"{tmp_path / 'nowhere'}" in msg and "a wrong --data_root" in msg, msg
    assert "mixed again or replaced" not in msg and "\n" not in msg
    plan = decode.plan(wrong)
    assert plan.status == "differs" and "not found now" in plan.diffs[0]   # the grid's words
    assert decode.main(argv).n_utts == 24                                  # the run is kept


def test_a_path_option_written_key_equals_tilde_is_under_the_home_folder(data, tmp_path,
                                                                        monkeypatch):
    """``--output_folder=~/exp`` (the README's form: the shell expands no ~ there) wrote a folder
    named ~ in the working directory; so did the grid's ``--exp_dir=~/g``, the statistics'
    ``--out=~/s.pt`` and the report's ``--out`` / ``--plots_dir``."""
    from tta_brain import stats
    from tta_brain.report import results
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    argv = [a if not a.startswith("--output_folder=") else "--output_folder=~/exp"
            for a in decode_argv(data, tmp_path / "unused", "source")]
    assert decode.plan(argv).out == str(home / "exp")
    assert decode.main(argv).n_utts == 24 and (home / "exp" / "summary.json").is_file()
    assert not (tmp_path / "~").exists()
    g = grid.parse_args(grid_argv(data, "~/g", "source", "0"))
    assert g.exp_dir == str(home / "g")
    assert stats.parse_args(["--source", "m", "--manifest", "c.csv", "--out=~/s.pt"])[0].out \
        == str(home / "s.pt")
    r = results.parse_args(["--exp_dir=~/exp", "--out=~/R.md", "--plots_dir=~/p"])
    assert (r.exp_dir, r.out, r.plots_dir) == tuple(str(home / n) for n in ("exp", "R.md", "p"))


@pytest.mark.slow
def test_an_interrupted_run_is_only_resumed_with_its_own_settings(data, tmp_path):
    out = tmp_path / "exp"
    cmd = [sys.executable, "-m", "tta_brain.decode", *decode_argv(data, out, "csuta")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    wait_for(lambda: list((out / "save").glob("CKPT+*/stream.ckpt")), "a checkpoint")
    proc.kill()
    proc.wait()
    assert not (out / "summary.json").exists()
    with pytest.raises(SystemExit, match="other settings .*hparams.steps: 2 != 5"):
        decode.main(decode_argv(data, out, "csuta", "--steps=5"))
    summary = decode.main(decode_argv(data, out, "csuta"))
    assert summary.n_utts == 24 and "Resuming" in (out / "log.txt").read_text()


# ----------------------------------------------------------------------------- local engine
def test_plan_names_runs_by_their_overrides(data, tmp_path):
    args = grid.parse_args(grid_argv(data, tmp_path, "suta dsuta+dynamic", "0", "--sweep",
                                     "lr=0.1,0.2"))
    runs = grid.plan_runs(args)
    assert [r.name for r in runs] == ["s/suta_lr0.1/seed0", "s/suta_lr0.2/seed0",
                                      "s/dsuta+dynamic_lr0.1/seed0", "s/dsuta+dynamic_lr0.2/seed0"]
    assert "--reset=dynamic" in runs[2].argv and runs[1].argv[-2:] == ["--lr=0.2",
                                                                      "--method_tag=suta_lr0.2"]
    assert runs[2].argv[-1] == "--method_tag=dsuta+dynamic_lr0.1"    # reports do not pool it
    assert "--reset_K=4" in runs[2].argv and "--reset_K=4" not in runs[0].argv   # conf/<method>
    assert {r.total for r in runs} == {24}              # the stream's rows (its header left out)
    args.decode_opts = "--ckpt_every=5 --temperature=2"      # run options stay out of names
    assert grid.plan_runs(args)[0].name == "s/suta_temperature2_lr0.1/seed0"
    # the --decode_opts=--overwrite a grid suggests for a run with other settings reruns it in
    # its own folder (named overwrite, it was decoded beside it and the old run stayed)
    args.decode_opts = "--temperature=2 --overwrite --device=cpu"
    assert grid.plan_runs(args)[0].name == "s/suta_temperature2_lr0.1/seed0"


def test_a_tag_too_long_for_a_folder_name_is_cut_with_a_digest(data, tmp_path):
    """A path option in --decode_opts names the run folder whole: over 255 bytes the run failed
    when it made its folder. Such a tag keeps its head and gets a digest of the whole; a tag that
    fits (every folder a grid made) is as before."""
    args = grid.parse_args(grid_argv(data, tmp_path, "eata", "0"))
    names = []
    for last in ("a", "b"):
        args.decode_opts = f"--source_stats=/{'x' * 120}/{'y' * 120}/{last}.pt"
        run = grid.plan_runs(args)[0]
        folder = run.name.split("/")[1]
        assert len(folder.encode()) == 255 and folder.startswith("eata_source_stats-xxx")
        assert run.argv[-1] == f"--method_tag={folder}"
        names.append(folder)
    assert names[0] != names[1]
    assert grid_plan.fit_tag("eata", "lr0.1") == "lr0.1"
    tag = "k" * (255 - len("eata_"))
    assert grid_plan.fit_tag("eata", tag) == tag and grid_plan.fit_tag("eata", tag + "k") != tag


def test_a_tag_names_a_runs_own_options_in_one_folder_name():
    """The folder name of a run's own options (what finds its earlier runs): each key with its
    value, ``_`` between options, a run of other characters one ``-`` (a list value, a path), the
    run options left out."""
    assert grid_plan.inference_tag(["--lr=1e-4", "--reset_K=50"]) == "lr1e-4_reset_K50"
    assert grid_plan.inference_tag(["--adapt_params=[ln, cnn]", "--device=cuda:1",
                                    "--overwrite", "--source_stats=/a b//s.pt"]) == \
        "adapt_params-ln-cnn-_source_stats-a-b-s.pt"


def test_a_stream_spec_before_its_files_exist_splits_at_the_first_equals_sign(tmp_path):
    """A dry run names its streams before the files are written: NAME=CSV at the first '='
    (the manifest's path may hold more); an empty NAME is the manifest's file name."""
    assert grid_plan.stream_spec(f"md={tmp_path}/snr=20/md_easy.csv") == \
        ("md", f"{tmp_path}/snr=20/md_easy.csv")
    assert grid_plan.stream_spec(f"={tmp_path}/x.csv") == ("x", f"{tmp_path}/x.csv")
    assert grid_plan.stream_spec(f"{tmp_path}/y.csv") == ("y", f"{tmp_path}/y.csv")


def test_a_stream_not_written_yet_is_one_line_unless_a_dry_run(data, tmp_path):
    argv = grid_argv(data, tmp_path, "suta", "0") + ["--streams", f"t={tmp_path / 'no.csv'}"]
    with pytest.raises(SystemExit, match=re.escape(f"ERROR: --streams t={tmp_path / 'no.csv'}: "
                                                   f"stream {tmp_path / 'no.csv'} not found; run "
                                                   f"the earlier stages first")):
        grid.plan_runs(grid.parse_args(argv))
    for extra in (["--dry_run"], ["--check"]):          # planned before the stages that write it
        runs = grid.plan_runs(grid.parse_args(argv + extra))
        assert [r.total for r in runs if r.name.startswith("t/")] == [0]
    # a folder (not a manifest): said as such, a dry run too (it said "not found")
    argv = grid_argv(data, tmp_path, "suta", "0") + ["--streams", f"d={tmp_path}"]
    for extra in ([], ["--dry_run"]):
        with pytest.raises(SystemExit, match=re.escape(f"ERROR: --streams d={tmp_path}: "
                                                       f"{tmp_path} is a folder, not a stream "
                                                       f"manifest (a CSV file)")):
            grid.plan_runs(grid.parse_args(argv + extra))


def test_a_bad_stream_manifest_is_said_naming_the_grids_option(data, tmp_path, capsys):
    """A manifest error found when a run starts (a column missing) was said per run naming
    decode's option (--stream_csv), which a grid's user never gave; now its --streams item."""
    import csv
    rows = list(csv.DictReader(open(data["csv"], newline="")))
    bad = tmp_path / "no_wrd.csv"
    with open(bad, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "wrd"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    argv = grid_argv(data, tmp_path / "exp", "source", "0 1", "--nj", "1")
    argv[argv.index("--streams") + 1] = f"b={bad}"
    assert grid.main(argv) == 1
    out = capsys.readouterr().out
    said = [ln for ln in out.splitlines() if "missing required column(s) wrd" in ln]
    assert len(said) == 4 and all(ln.endswith(f"(--streams b={bad})") for ln in said), out
    assert "b/source/seed0" in said[0] and "b/source/seed1" in said[1]
    assert "--stream_csv" not in out


def test_a_reset_tag_is_checked_before_anything_runs(data, tmp_path):
    """``suta+dynamic`` (suta has no reset block) and ``dsuta+bogus`` were planned (and printed
    by --dry_run) and each of their runs failed at its start; now one line before anything."""
    for token, said in (("suta+dynamic", "suta has no reset policy"),
                        ("dsuta+bogus", "'bogus' is not a reset policy (one of none, fixed"),
                        ("sutaa", "no packaged method 'sutaa' (packaged: ")):   # said "method"
        with pytest.raises(SystemExit, match=re.escape(f"--methods {token}: {said}")):
            grid.plan_runs(grid.parse_args(grid_argv(data, tmp_path, f"dsuta+dynamic {token}",
                                                     "0", "--dry_run")))
    own = tmp_path / "hp"                     # one's own yaml named with a '+': no tag
    own.mkdir()
    shutil.copy(hparams_find("suta"), own / "suta+mine.yaml")
    (own / "suta.yaml").write_text(hparams_find("suta").read_text())   # its own yaml wins
    runs = grid.plan_runs(grid.parse_args(grid_argv(data, tmp_path, "suta+mine", "0",
                                                    "--hparams_dir", str(own))))
    assert [r.name for r in runs] == ["s/suta+mine/seed0"]
    assert not any(a.startswith("--reset") for a in runs[0].argv)
    assert runs[0].argv[0] == str(own / "suta+mine.yaml")
    assert runs[0].argv[-1] == "--method_tag=suta+mine"       # its yaml says suta: see below


def test_an_own_yaml_with_a_bad_include_line_is_one_line(data, tmp_path):
    """An own yaml (``--hparams_dir``) whose include line names no block stopped the grid with
    the HparamsError's traceback (the grid reads every yaml's keys as it plans); now the one
    line decode gives, before any folder is written."""
    own = tmp_path / "hp"
    own.mkdir()
    (own / "suta.yaml").write_text("include: [nosuch]\nsteps: 1\n")
    exp = tmp_path / "exp"
    with pytest.raises(SystemExit) as e:
        grid.main(grid_argv(data, exp, "suta", "0", "--hparams_dir", str(own), "--dry_run"))
    assert str(e.value) == (f"ERROR: {own / 'suta.yaml'}: include 'nosuch' not found (blocks: "
                            f"run, reset, or a .yaml path relative to {own})")
    assert not exp.exists()


def test_a_yaml_of_ones_own_is_reported_by_its_token(data, tmp_path):
    """A copy of a packaged yaml under another name (``mycsuta.yaml``: its method_tag says
    csuta) had its folder named ``mycsuta`` while its runs were labelled csuta: the report pooled
    them with csuta's as seeds of one method. Now the grid labels them by the token; packaged
    tokens, and yamls whose label is their token, get no label of the grid's (as before)."""
    own = tmp_path / "hp"
    own.mkdir()
    shutil.copy(hparams_find("csuta"), own / "mycsuta.yaml")
    text = hparams_find("suta").read_text()
    (own / "suta2.yaml").write_text(text.replace("method_tag: suta ", "method_tag: suta2 "))
    (own / "dyn.yaml").write_text(hparams_find("csuta").read_text() + "reset: dynamic\n")
    argv = grid_argv(data, tmp_path, "csuta csuta+dynamic dsuta+dynamic mycsuta mycsuta+dynamic "
                     "suta2 dyn", "0", "--hparams_dir", str(own))
    runs = grid.plan_runs(grid.parse_args(argv))
    labels = {r.name.split("/")[1]: [a for a in r.argv if a.startswith("--method_tag")]
              for r in runs}
    assert labels == {"csuta": [], "csuta+dynamic": [], "dsuta+dynamic": [], "suta2": [],
                      "mycsuta": ["--method_tag=mycsuta"],
                      "mycsuta+dynamic": ["--method_tag=mycsuta+dynamic"],
                      "dyn": ["--method_tag=dyn+dynamic"]}      # its own default reset
    swept = grid.plan_runs(grid.parse_args(argv + ["--sweep", "lr=0.1"]))
    assert [a for a in swept[3].argv if a.startswith("--method_tag")] == \
        ["--method_tag=mycsuta_lr0.1"]
    mine = grid.plan_runs(grid.parse_args(argv + ["--decode_opts=--method_tag=x"]))
    assert all(r.argv.count("--method_tag=x") == 1 and sum(a.startswith("--method_tag") for a in
                                                           r.argv) == 1 for r in mine)
    conf = tmp_path / "conf"                  # a recipe's own option sets the reset policy:
    shutil.copytree(data["conf"], conf)       # the label says it, as the yaml's would
    for name in ("mycsuta", "csuta", "dsuta"):
        (conf / f"{name}.opts").write_text("--reset=fixed\n--reset_every=4\n")
    plain = grid_argv(data, tmp_path, "csuta mycsuta dsuta", "0", "--hparams_dir", str(own))
    runs = grid.plan_runs(grid.parse_args(plain + ["--conf_dir", str(conf)]))
    labels = {r.name.split("/")[1]: [a for a in r.argv if a.startswith("--method_tag")]
              for r in runs}
    assert labels["mycsuta"] == ["--method_tag=mycsuta+fixed"]
    assert labels["csuta"] == labels["dsuta"] == []      # the yaml's csuta+fixed stands
    # a token's +reset beside an option file's other --reset: the folder would say dynamic for
    # fixed-reset runs (the option file came after the token's --reset and won)
    with pytest.raises(SystemExit, match=r"ERROR: .*csuta\.opts:1: --reset=fixed, but the token "
                       r"csuta\+dynamic names its reset \(dynamic\).*the token csuta\+fixed$"):
        grid.plan_runs(grid.parse_args(argv + ["--conf_dir", str(conf)]))
    # so beside --decode_opts or --sweep (dsuta+dynamic_resetfixed/ ran the fixed reset)
    for extra, where in ((["--decode_opts=--reset=fixed"], "--decode_opts"),
                         (["--sweep", "reset=fixed,dynamic"], "--sweep")):
        with pytest.raises(SystemExit, match=rf"ERROR: {where}: --reset=fixed, but the token "
                           r"dsuta\+dynamic names its reset \(dynamic\)"):
            grid.plan_runs(grid.parse_args(grid_argv(data, tmp_path, "dsuta+dynamic", "0")
                                           + extra))
    (conf / "dsuta.opts").write_text("--reset=dynamic\n")        # the same policy: no conflict
    runs = grid.plan_runs(grid.parse_args(grid_argv(data, tmp_path, "dsuta+dynamic", "0")
                                          + ["--conf_dir", str(conf)]))
    assert [a for a in runs[0].argv if a.startswith("--reset=")] == ["--reset=dynamic"] * 2


def test_a_yaml_of_ones_own_is_labelled_by_the_reset_its_run_takes(data, tmp_path):
    """``--reset`` given twice in a run's options (its option file, then an md option set): decode
    takes the last one, and so does the label of a yaml of one's own (``mycsuta``), so its
    multi-domain runs are not reported as the option file's reset."""
    own, conf = tmp_path / "hp", tmp_path / "conf"
    own.mkdir()
    shutil.copy(hparams_find("csuta"), own / "mycsuta.yaml")
    shutil.copytree(data["conf"], conf)
    (conf / "mycsuta.opts").write_text("--reset=fixed\n--reset_every=4\n")
    argv = grid_argv(data, tmp_path / "exp", "mycsuta", "0", "--hparams_dir", str(own),
                     "--conf_dir", str(conf), "--streams", f"md={data['csv']}", "--md_streams",
                     "md", "--md_recipe_opts=--reset=dynamic --reset_K=10")
    runs = {r.name: r for r in grid.plan_runs(grid.parse_args(argv))}
    for name, reset in (("s/mycsuta/seed0", "fixed"), ("md/mycsuta/seed0", "dynamic")):
        run = runs[name]
        assert [a for a in run.argv if a.startswith("--reset=")][-1] == f"--reset={reset}"
        assert run.argv[-1] == f"--method_tag=mycsuta+{reset}"
        _, hp = decode.settings(run.argv)
        assert (hp.values["reset"], hp.values["method_tag"]) == (reset, f"mycsuta+{reset}")


def test_an_option_ones_own_yaml_cannot_build_stops_the_grid_in_one_line(data, tmp_path,
                                                                          capsys):
    """A key of a yaml of one's own that its method does not take (``em_coeff`` under
    ``method:``) failed every run of the grid at its build, one failure and log per run (and its
    dry run said nothing); now the grid stops first with one line naming the file, its line
    and the key, as build_method says it, without loading the model."""
    own = tmp_path / "hp"
    own.mkdir()
    text = hparams_find("suta").read_text()
    bad = text.replace("    em_coef: !ref <em_coef>", "    em_coeff: !ref <em_coef>")
    (own / "mysuta.yaml").write_text(bad)
    line = bad.splitlines().index("    em_coeff: !ref <em_coef>") + 1
    argv = grid_argv(data, tmp_path / "exp", "source mysuta", "0 1", "--hparams_dir", str(own))
    for extra in ([], ["--dry_run"], ["--check"]):
        with pytest.raises(SystemExit) as e:
            grid.main(argv + extra)
        assert str(e.value) == (f"ERROR: {own / 'mysuta.yaml'}:{line}: method 'suta' has no "
                                "option(s) em_coeff; valid: adapt_params, em_coef, episodic, lr, "
                                "make_step, model, optimizer, reset_policy, steps, temperature, "
                                "train_mode (every run of it would fail; none was started)")
        assert "DRY-RUN" not in capsys.readouterr().out
        assert not (tmp_path / "exp").exists()
    # two keys it does not take: the line named is the first's, the message names both
    worse = bad.replace("    temperature: !ref <temperature>", "    temperatur: !ref <temperature>")
    assert line < worse.splitlines().index("    temperatur: !ref <temperature>") + 1
    (own / "mysuta.yaml").write_text(worse)
    with pytest.raises(SystemExit) as e:
        grid.main(argv + ["--dry_run"])
    assert str(e.value).startswith(f"ERROR: {own / 'mysuta.yaml'}:{line}: method 'suta' has no "
                                   "option(s) em_coeff, temperatur; valid: ")
    # a method of one's own, registered when its yaml imports its module: the build tells
    (own / "mysuta.yaml").write_text(bad.replace("    name: suta", "    name: mine"))
    assert grid.main(argv + ["--dry_run"]) == 0
    (own / "mysuta.yaml").write_text(text)
    assert grid.main(argv + ["--dry_run"]) == 0
    # a yaml it cannot read (a syntax error): each run's settings check says it, as before
    (own / "mysuta.yaml").write_text(text + "a: [1\n")
    assert grid.main(argv + ["--dry_run"]) == 1
    assert capsys.readouterr().out.count("mysuta.yaml: yaml syntax error") == 2


def test_a_dry_run_says_which_runs_will_not_run_and_fails(data, tmp_path, capsys):
    """``--sweep "steps=-1,abc"`` was printed by --dry_run as two good runs (rc 0); each failed
    at its start in the real grid. Now the dry run checks every run's settings as its start
    would, names each bad run with the key, and exits 1; good runs are still listed."""
    exp = tmp_path / "exp"
    rc = grid.main(grid_argv(data, exp, "suta dsuta+dynamic", "0", "--sweep", "steps=-1,abc,2",
                             "--dry_run"))
    out = capsys.readouterr().out
    assert rc == 1
    assert out.count("DRY-RUN: ") == 6
    bad = [line for line in out.splitlines() if "will not run" in line]
    assert len(bad) == 4 and all("steps must be an integer >= 0" in line for line in bad)
    assert "grid: s/suta_steps-1/seed0 will not run: ERROR: " in out
    assert "s/suta_steps2/seed0 will not run" not in out
    assert not exp.exists()                                     # a dry run writes nothing
    assert grid.main(grid_argv(data, exp, "suta", "0", "--sweep", "steps=1,2", "--dry_run")) == 0


def hparams_find(name):
    from tta_brain import hparams
    return hparams.find(name)


def test_labels_are_not_part_of_the_fingerprint(data, tmp_path):
    """A run's report label (the grid's --method_tag for a tagged run, --stream_name) does not
    change what it computes: same fingerprint, also against one recorded with a label."""
    plain = decode.plan(decode_argv(data, tmp_path / "x"))
    named = decode.plan(decode_argv(data, tmp_path / "x", "suta", "--method_tag=suta_lr1",
                                    "--stream_name=other"))
    assert plain.fingerprint == named.fingerprint
    older = {**plain.fingerprint, "hparams": {**plain.fingerprint["hparams"], "method_tag": "suta"}}
    assert identity.differences(older, named.fingerprint) == []
    assert identity.differences(older, decode.plan(decode_argv(
        data, tmp_path / "x", "suta", "--steps=3")).fingerprint) == ["hparams.steps: 2 != 3"]


def test_the_yamls_nested_values_are_part_of_the_fingerprint(data, tmp_path):
    """A selector, an optimiser class or ``lr: !ref <lr> * 2`` in the method's block changed in
    one's own yaml or by an override: another run (they were left out, and such a run was skipped
    as "finished with the same settings"); a copy of the packaged yaml, reformatted and commented,
    is the packaged run; a fingerprint recorded before the digests matches them; a batched sweep
    refuses runs whose nested values differ."""
    from tta_brain import hparams as hp_files
    from tta_brain import sweep
    packaged = decode.plan(decode_argv(data, tmp_path / "x"))
    assert set(packaged.fingerprint["structure"]) >= {"model", "method", "adapt_params", "optimizer"}
    text = hp_files.find("suta").read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text("# my copy\n" + text.replace("#", "  # ").replace("\n\n", "\n"))
    assert decode.plan(decode_argv(data, tmp_path / "x", str(mine))).fingerprint == packaged.fingerprint
    changed = {
        "method": text.replace("    lr: !ref <lr>\n", "    lr: !ref <lr> * 2\n"),
        "optimizer": text.replace("!name:torch.optim.AdamW", "!name:torch.optim.SGD"),
    }
    for key, body in changed.items():
        assert body != text, key
        mine.write_text(body)
        other = decode.plan(decode_argv(data, tmp_path / "x", str(mine))).fingerprint
        assert [d.split(":")[0] for d in identity.differences(packaged.fingerprint, other)] == [
            f"structure.{key}"]
    selected = decode.plan(decode_argv(data, tmp_path / "x", "suta", "--adapt_params=[{select: all}]"))
    assert [d.split(":")[0] for d in identity.differences(packaged.fingerprint, selected.fingerprint)
            ] == ["structure.adapt_params"]
    older = {k: v for k, v in packaged.fingerprint.items() if k != "structure"}
    assert identity.differences(older, selected.fingerprint) == []        # not known: as before
    assert identity.differences(older, packaged.fingerprint, recorded=True) == []
    assert "the yaml's adapt_params differs from run 1's" in sweep.refusal([packaged, selected])


def test_auto_graph_defaults_keep_cpu_fingerprints(data, tmp_path):
    """``cuda_graph_buckets`` / ``cuda_graph_cache`` became ``auto`` (length buckets on CUDA):
    a CPU run, where nothing is captured, keeps the fingerprint of the values it had (0.0, 1),
    so a CPU folder decoded before is still this run's; a CUDA run is fingerprinted as ``auto``
    and a CUDA folder decoded without buckets differs by those keys."""
    auto = decode.plan(decode_argv(data, tmp_path / "x"))
    assert auto.record["cuda_graph_buckets"] == auto.record["cuda_graph_cache"] == "auto"
    assert (auto.fingerprint["hparams"]["cuda_graph_buckets"],
            auto.fingerprint["hparams"]["cuda_graph_cache"]) == (0.0, 1)
    explicit = decode.plan(decode_argv(data, tmp_path / "x", "suta", "--cuda_graph_buckets=0.0",
                                       "--cuda_graph_cache=1"))
    assert explicit.fingerprint == auto.fingerprint
    on_cuda = dict(auto.record, device="cuda:1")
    new = identity.fingerprint(on_cuda, auto.stream_csv, len(auto.rows))
    assert (new["hparams"]["device"], new["hparams"]["cuda_graph_buckets"]) == ("cuda", "auto")
    old = identity.fingerprint(dict(on_cuda, cuda_graph_buckets=0.0, cuda_graph_cache=1),
                               auto.stream_csv, len(auto.rows))
    assert identity.differences(old, new) == ["hparams.cuda_graph_buckets: 0.0 != 'auto'",
                                              "hparams.cuda_graph_cache: 1 != 'auto'"]


def test_a_key_added_later_with_its_old_default_matches_older_fingerprints(data, tmp_path):
    """A folder decoded before a run-block key existed (its fingerprint lacks the key) is the
    same run as one with the key at the default that computes what it computed; another value
    differs."""
    new = decode.plan(decode_argv(data, tmp_path / "x")).fingerprint
    assert new["hparams"]["cuda_graph_buckets"] == 0.0
    older = {**new, "hparams": {k: v for k, v in new["hparams"].items()
                                if k != "cuda_graph_buckets"}}
    assert identity.differences(older, new) == []
    bucketed = decode.plan(decode_argv(data, tmp_path / "x", "suta",
                                       "--cuda_graph_buckets=0.1")).fingerprint
    assert identity.differences(older, bucketed) == ["hparams.cuda_graph_buckets: 0.0 != 0.1"]
    # tf32: a CPU run computed the same either way; a CUDA run had SpeechBrain's TF32 matmuls
    older = {**new, "hparams": {k: v for k, v in new["hparams"].items() if k != "tf32"}}
    assert new["hparams"]["tf32"] == "torch" and identity.differences(older, new) == []
    cuda_new = {**new, "hparams": {**new["hparams"], "device": "cuda"}}
    cuda_old = {**older, "hparams": {**older["hparams"], "device": "cuda"}}
    assert identity.differences(cuda_old, cuda_new) == ["hparams.tf32: 'on' != 'torch'"]
    assert identity.differences(cuda_old, {**cuda_new, "hparams": {**cuda_new["hparams"],
                                                                   "tf32": "on"}}) == []


def test_one_rule_for_an_option_a_method_lacks(data, tmp_path, caplog):
    """A key no method of the grid has is an error before anything runs; a key some lack is
    not passed to those (nor named in their folders), logged once."""
    args = grid.parse_args(grid_argv(data, tmp_path, "source suta", "0 1", "--sweep",
                                     "lr=0.1,0.2"))
    args.decode_opts = "--steps=1"
    with caplog.at_level(logging.INFO, logger="tta_brain.grid"):
        runs = grid.plan_runs(args)
    assert [r.name for r in runs] == ["s/source/seed0", "s/source/seed1",
                                      "s/suta_steps1_lr0.1/seed0", "s/suta_steps1_lr0.1/seed1",
                                      "s/suta_steps1_lr0.2/seed0", "s/suta_steps1_lr0.2/seed1"]
    assert not any(a.startswith(("--steps", "--lr")) for a in runs[0].argv)
    assert caplog.text.count("source: --decode_opts --steps=1 is not a key of its yaml") == 1
    caplog.clear()                                      # once per method, not once per stream
    args.streams = [f"s={data['csv']}", f"t={data['csv']}"]
    with caplog.at_level(logging.INFO, logger="tta_brain.grid"):
        grid.plan_runs(args)
    assert caplog.text.count("source: --decode_opts --steps=1 is not a key of its yaml") == 1
    for opts, where in (("--stepz=1", "--decode_opts"), ("", "--sweep")):
        args.decode_opts = opts
        args.sweep = ["lrr=0.1"] if where == "--sweep" else []
        with pytest.raises(SystemExit, match=f"ERROR: {where} --(stepz|lrr): no method of this "
                                             f"grid has the key"):
            grid.plan_runs(args)


@pytest.mark.slow
def test_local_grid_equals_serial_runs_and_survives_a_killed_worker(data, tmp_path):
    methods = "suta dsuta+dynamic"
    ref = tmp_path / "ref"
    serial(data, ref, methods)
    exp = tmp_path / "exp"
    # reset_K etc. are dsuta keys: the grid passes them with the recipe (md) options only
    cmd, proc, victim = grid_until_checkpoint(data, exp, methods, "0 1")
    pid = freeze_mid_run(victim)
    assert proc.poll() is None, "the grid ended before the worker could be killed"
    os.kill(pid, signal.SIGKILL)       # the decode process of that run (it holds the lock)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out[-3000:]
    assert "FAILED s/dsuta+dynamic/seed0" in out and "logs:" in out
    assert "Slurm state" not in out                  # a local worker: said as such
    assert "grid finished: 3 done, 0 running, 1 failed" in out
    rerun = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "(4 runs, 3 already finished)" in rerun.stdout
    assert "Resuming" in (victim / "log.txt").read_text()
    assert compare_runs.main([str(ref), str(exp)]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("sigint", ["default", "ignored", "ctrl-c"])
def test_stopped_local_grid_leaves_no_worker_and_resumes(data, tmp_path, sigint):
    """SIGTERM to the grid (as Ctrl-C) cancels its local workers, which bypass SIGTERM
    themselves: none goes on decoding after the grid has gone; the rerun resumes. Also for a
    grid started with SIGINT ignored (``grid ... &`` in a script), which its workers inherited:
    they went on decoding to the end of their runs. Ctrl-C (SIGINT to the grid's process group,
    its workers' controllers in it) is said once: each controller printed its KeyboardInterrupt
    traceback among the grid's lines."""
    exp = tmp_path / "exp"
    cmd, proc, victim = grid_until_checkpoint(data, exp, "suta dsuta+dynamic", "0",
                                              sigint_ignored=sigint == "ignored",
                                              own_group=sigint == "ctrl-c")
    pid = holder_pid(victim)
    assert proc.poll() is None and pid, "the grid ended before it could be stopped"
    if sigint == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)     # as the terminal sends it: to the whole group
    else:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert "cancelled" in out and "grid: interrupted" in out, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    grid_dir = str(exp / ".grid")
    wait_for(lambda: not holder_pid_alive(victim) and not workers_of(grid_dir),
             "the workers' exit", 30)
    assert not (victim / "summary.json").exists()
    rerun = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "Resuming" in (victim / "log.txt").read_text()
    assert json.loads((victim / "summary.json").read_text())["n_utts"] == 24


def test_a_local_job_starts_deaf_to_ctrl_c():
    """A local job's controller starts with SIGINT ignored (Ctrl-C, sent to the whole process
    group, stops the grid alone, which cancels its jobs); the grid's own handler is back after
    the start. (Python's handler set for the test: a test run started in the background ignores
    SIGINT.)"""
    probe = [sys.executable, "-c",
             "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"]
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with grid._sigint_ignored():
            child = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == "True", child.stdout + child.stderr
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        after = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert after.stdout.strip() == "False"
    finally:
        signal.signal(signal.SIGINT, before)


def grid_until_checkpoint(data, exp, methods, seeds, sigint_ignored=False, own_group=False):
    """A local grid of 2 workers started in the background (``own_group``: in a process group
    of its own, as a shell starts a foreground job), returned once its run
    ``dsuta+dynamic/seed0`` has a checkpoint (or the grid ended): (command, process, that run)."""
    cmd = [sys.executable, "-m", "tta_brain.grid",
           *grid_argv(data, exp, methods, seeds, "--nj", "2")]
    # SIGINT as a shell leaves it: ignored in a script's background job, else Python's own (set
    # either way: a test run started in the background would hand its ignoring on)
    sigint = signal.SIG_IGN if sigint_ignored else signal.SIG_DFL
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
                            start_new_session=own_group)
    victim = exp / "s" / "dsuta+dynamic" / "seed0"
    wait_for(lambda: list((victim / "save").glob("CKPT+*/stream.ckpt")) or proc.poll() is not None,
             "a checkpoint of the victim")
    return cmd, proc, victim


def workers_of(grid_dir):
    """Processes whose command line names ``grid_dir`` (the grid's submitit workers)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if grid_dir in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("extra,expected", [
    (["--seeds", ""], "--seeds '': names no seed"),      # was a grid of 0 runs, exit 0
    (["--seeds", "0 x"], "--seeds '0 x': seeds are integers"),
    (["--seeds", "-1 0"], "--seeds '-1 0': seeds are integers from 0 to 4294967295"),  # ran seed 0
    (["--seeds", "4294967296"], "--seeds '4294967296': seeds are integers from 0 to"),  # 2**32
    (["--methods", " "], "--methods ' ': names no method"),
    (["--streams", ""], "--streams 's.csv' '': an empty stream name"),  # was folders under /
    (["--conf_dir", "/no/conf"], "--conf_dir /no/conf: no such folder"),   # were silently
    (["--hparams_dir", "/no/hp"], "--hparams_dir /no/hp: no such folder"),  # left out
    (["--slurm_conf", "s.yaml"], "--slurm_conf s.yaml: read by --engine slurm only"),  # ran here
])
def test_an_empty_or_malformed_grid_list_is_one_line(extra, expected, capsys):
    argv = ["--exp_dir", "e", "--source", "m", "--streams", "s.csv", "--methods", "suta"]
    with pytest.raises(SystemExit) as e:
        grid.parse_args(argv + extra)
    assert e.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("sweep,expected", [
    (["lr=1e-4", "lr=2e-4"], "--sweep 'lr=1e-4' 'lr=2e-4': lr given twice; list its values in "
                             "one: lr=1e-4,2e-4"),      # was one run, lr=2e-4
    (["lr=1e-4,,2e-4"], "--sweep 'lr=1e-4,,2e-4': use key=v1,v2,..."),
    (["lr="], "--sweep 'lr=': use key=v1,v2,..."),
    (["device=cpu,cuda"], "--sweep 'device=cpu,cuda': device says where or how a run goes"),
    (["lr=1,2", "ckpt_every=5,10"], "--sweep 'ckpt_every=5,10': ckpt_every says"),  # were 2 runs
    (["lr=1e-4,0.0001"], "--sweep 'lr=1e-4,0.0001': 1e-4 and 0.0001 are the same value (its runs "
                         "would be one run decoded twice); list it once"),   # were 2 folders
    (["reset=fixed,dynamic,fixed"], "--sweep 'reset=fixed,dynamic,fixed': fixed and fixed are"),
    (["source_stats=st/a.pt,st:a.pt"], "--sweep 'source_stats=st/a.pt,st:a.pt': st/a.pt and st:a.pt "
                                       "name the same run folder (source_statsst-a.pt)"),  # was 1 run
    (["lr=1e-4, 3e-4"], "--sweep 'lr=1e-4,': use key=v1,v2,..."),   # was lr-3e-4 (a negative lr?)
    (["lr=1e-4,3e-4 steps=1,3", "steps=2"], "--sweep 'steps=1,3' 'steps=2': steps given twice"),
])
def test_a_sweep_that_would_lose_values_is_refused(sweep, expected):
    from tta_brain.run.grid_plan import sweep_points
    with pytest.raises(SystemExit, match=re.escape(f"ERROR: {expected}")):
        sweep_points(sweep)
    assert sweep_points(["lr=1,2", "steps=3"]) == [["--lr=1", "--steps=3"], ["--lr=2", "--steps=3"]]
    # an axis written as an option (--lr=...) is the same axis, so the same folders
    assert sweep_points(["--lr=1,2"]) == [["--lr=1"], ["--lr=2"]]
    # several axes in one argument (a recipe's quoted --sweep): each its own axis (the second
    # key was read as part of a value: runs with --lr='3e-4 steps=1' and --lr=3)
    assert sweep_points(["lr=1e-4,3e-4  steps=1,3"]) == [
        ["--lr=1e-4", "--steps=1"], ["--lr=1e-4", "--steps=3"],
        ["--lr=3e-4", "--steps=1"], ["--lr=3e-4", "--steps=3"]]


def test_options_a_run_would_not_read_are_left_out_of_it(data, tmp_path, caplog):
    """``--reset_every`` without a fixed reset was accepted and read by nothing: a plain run
    named ``csuta_reset_every7``, and the recipe's K and period reached every multi-domain run.
    The grid leaves such an option out of the runs that would not read it (the log says so),
    refuses one that no run reads, decode refuses it; a run's identity leaves such keys out,
    so a folder decoded with one is the run without it."""
    argv = grid_argv(data, tmp_path / "exp", "csuta csuta+fixed", "0", "--md_streams", "s",
                     "--md_recipe_opts=--reset_K=10 --reset_every=5")
    plain, fixed = grid.plan_runs(grid.parse_args(argv + ["--decode_opts=--reset_every=7"]))
    assert (plain.name, fixed.name) == ("s/csuta/seed0", "s/csuta+fixed_reset_every7/seed0")
    assert not [a for a in plain.argv if a.startswith("--reset")]
    assert [a for a in fixed.argv if a.startswith("--reset")] == [
        "--reset=fixed", "--reset_every=5", "--reset_every=7"]        # (the last one wins)
    caplog.clear()                  # (the plan above said it too where an earlier test set INFO)
    with caplog.at_level(logging.INFO, logger="tta_brain.grid"):   # said once, not per stream
        grid.plan_runs(grid.parse_args(argv + ["--decode_opts=--reset_every=7", "--streams",
                                               f"t={data['csv']}"]))
    assert caplog.text.count("csuta: --reset_every=7 is not read by its run") == 1
    with pytest.raises(SystemExit, match=re.escape(
            "ERROR: --decode_opts --reset_K: no run of this grid reads it (with reset = 'none': "
            "it is only used with reset = dynamic)")):
        grid.plan_runs(grid.parse_args(argv + ["--decode_opts=--reset_K=20"]))
    with pytest.raises(SystemExit,
                       match="reset_every = 7 \\(an override\\) with reset = 'none': it is only "
                             "used with reset = fixed, and would not change the run"):
        decode.plan(decode_argv(data, tmp_path / "d", "csuta", "--reset_every=7"))
    a = decode.plan(decode_argv(data, tmp_path / "a", "csuta")).fingerprint
    old = json.loads(json.dumps(a))
    old["hparams"]["reset_K"] = 10          # as the recipe's multi-domain csuta runs were made
    assert identity.differences(old, a) == [] == identity.differences(old, a, recorded=True)
    old["hparams"]["reset"] = "dynamic"     # read: a difference
    assert [d.split(":")[0] for d in identity.differences(old, a)] == [
        "hparams.reset", "hparams.reset_K", "hparams.reset_lii_count", "hparams.reset_patience",
        "hparams.reset_test_size", "hparams.reset_threshold"]


def test_option_files_and_sets_apply_in_their_order(data, tmp_path):
    """A run's options come from <method>.opts, <method>_md.opts (a --md_streams stream, named
    by its last part when the stream's name has folders: ``snr20/md``), <token>.opts, the md
    option sets (the recipe's, then the user's) and --decode_opts, later ones winning: the last
    --lr of its argv is what decode takes."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "dsuta.opts").write_text("--lr=0.1\n--steps=1\n")
    (conf / "dsuta_md.opts").write_text("--lr=0.2\n")
    (conf / "dsuta+dynamic.opts").write_text("--lr=0.3\n")
    argv = grid_argv(data, tmp_path / "exp", "dsuta dsuta+dynamic", "0") + [
        "--conf_dir", str(conf), "--streams", f"snr20/md={data['csv']}", "--md_streams", "md",
        "--md_recipe_opts=--steps=3", "--md_decode_opts=--steps=4"]
    runs = {r.name: r for r in grid.plan_runs(grid.parse_args(argv))}

    def last(run, key):
        return [a for a in runs[run].argv if a.startswith(f"--{key}=")][-1]
    assert (last("s/dsuta/seed0", "lr"), last("s/dsuta/seed0", "steps")) == ("--lr=0.1", "--steps=1")
    assert last("s/dsuta+dynamic/seed0", "lr") == "--lr=0.3"
    assert (last("snr20/md/dsuta/seed0", "lr"), last("snr20/md/dsuta/seed0", "steps")) == \
        ("--lr=0.2", "--steps=4")
    assert last("snr20/md/dsuta+dynamic/seed0", "lr") == "--lr=0.3"
    # a token's md stream reads its method's <method>_md.opts (dsuta_md.opts for dsuta+dynamic)
    assert [a for a in runs["snr20/md/dsuta+dynamic/seed0"].argv if a.startswith("--lr=")] == [
        "--lr=0.1", "--lr=0.2", "--lr=0.3"]


def test_options_a_run_would_not_read_are_judged_on_the_values_its_yaml_reads(data, tmp_path):
    """The grid judged its yamls' defaults on their text: a yaml of one's own with a quoted
    ``reset: "fixed"`` made ``--reset_every`` 'read by no run' (decode takes it), and SGEM's
    ``lm_path: null`` (the text 'null') made ``--lm_weight`` read, passed to runs that decode
    then refused one by one."""
    hp = tmp_path / "hp"
    hp.mkdir()
    text = (REPO / "tta_brain" / "hparams" / "csuta.yaml").read_text()
    (hp / "myfix.yaml").write_text(text.replace("\nsteps: 1 ", '\nreset: "fixed"\nsteps: 1 ', 1))
    argv = grid_argv(data, tmp_path / "exp", "myfix", "0", "--hparams_dir", str(hp))
    run, = grid.plan_runs(grid.parse_args(argv + ["--decode_opts=--reset_every=7"]))
    assert run.name == "s/myfix_reset_every7/seed0" and "--reset_every=7" in run.argv
    decode.plan(run.argv)                                   # decode takes it too
    argv = grid_argv(data, tmp_path / "exp", "sgem suta", "0")
    with pytest.raises(SystemExit, match=re.escape(
            "ERROR: --decode_opts --lm_weight: no run of this grid reads it (without lm_path")):
        grid.plan_runs(grid.parse_args(argv + ["--decode_opts=--lm_weight=0.3"]))


def test_grid_option_lists_are_read_as_decode_reads_them(data, tmp_path):
    """``--lr 1e-4`` (decode's space form) in ``--decode_opts`` or an ``.opts`` file is one
    override, named ``lr1e-4`` (it was refused as a key '1e-4'); a stray word, an open quote or
    a key that the sweep replaces in every run is one line naming where it was written."""
    argv = grid_argv(data, tmp_path / "exp", "suta", "0")

    def plan(*extra):
        return grid.plan_runs(grid.parse_args(argv + list(extra)))
    spaced = plan("--decode_opts=--lr 1e-4 --noprogressbar --steps 2")
    assert [r.name for r in spaced] == ["s/suta_lr1e-4_steps2/seed0"]
    assert {"--lr=1e-4", "--noprogressbar", "--steps=2"} <= set(spaced[0].argv)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "suta.opts").write_text("# a comment\n--lr 2e-4\n--steps=1 3\n")
    for extra, expected in (
            (["--decode_opts=--noprogressbar 3"], "--decode_opts: '3' is no option's value"),
            (["--decode_opts=--lr='1e-4"], "--decode_opts: No closing quotation"),
            (["--conf_dir", str(conf)], f"{conf / 'suta.opts'}:3: '3' is no option's value"),
            (["--decode_opts=--lr=1e-4", "--sweep", "lr=2e-4,3e-4"],     # was lr=1e-4 unused
             "--decode_opts sets --lr and --sweep sweeps it"),
            (["--md_streams", "s", "--md_decode_opts=--steps=2", "--sweep", "steps=1,3"],
             "--md_decode_opts sets --steps and --sweep sweeps it"),
            # replaced the grid's own value: every seed folder ran seed 3
            (["--decode_opts=--seed=3"], "--decode_opts --seed: the grid sets it for every run "
                                         "(from --seeds); give it there"),
            (["--sweep", "seed=1,2"], "--sweep --seed: the grid sets it"),
            (["--sweep", "data_root=/a,/b"], "--sweep --data_root: the grid sets it for every "
                                             "run (from --data_root)"),
            (["--decode_opts=--output_folder=/tmp/x"], "--decode_opts --output_folder: the grid "
                                                       "sets it for every run (from --exp_dir)")):
        with pytest.raises(SystemExit, match=re.escape(f"ERROR: {expected}")):
            plan(*extra)
    # a recipe setting the sweep replaces (an indented comment is one: it was read as options)
    (conf / "suta.opts").write_text("  # mine\n--lr 2e-4\n")
    swept = plan("--conf_dir", str(conf), "--sweep", "lr=3e-4")
    a = swept[0].argv                                    # the later (the sweep's) one wins
    assert a.index("--lr=2e-4") < a.index("--lr=3e-4") and "lr3e-4" in swept[0].name
    # a refused value says where it was set (the yaml's error names only the packaged yaml)
    from tta_brain import decode
    (conf / "suta.opts").write_text("# mine\n--steps=2\n--lrr=2e-4\n")
    for extra, where in ((["--conf_dir", str(conf)], f"(--lrr from {conf / 'suta.opts'}:3)"),
                         (["--sweep", "steps=1,x"], "(--steps from --sweep)"),
                         (["--decode_opts=--lr=abc"], "(--lr from --decode_opts)"),
                         # the later list wins the key, and is named
                         (["--md_streams", "s", "--md_decode_opts=--lr=1",
                           "--decode_opts=--lr=abc"], "(--lr from --decode_opts)")):
        bad = [r for r in plan(*extra) if "stepsx" in r.name or "--sweep" not in extra]
        with pytest.raises(SystemExit) as e:
            decode.settings(bad[0].argv)
        assert bad[0].said(str(e.value)).endswith(where), (bad[0].said(str(e.value)), where)


@pytest.mark.parametrize("name", ["--decode_opts", "--md_decode_opts", "--md_recipe_opts"])
def test_an_option_list_given_after_a_space_names_the_equals_form(name, tmp_path, capsys):
    """``--decode_opts "--lr=1e-4"`` (the shell's space form): argparse reads the value as an
    option of its own and said only "expected one argument"; now the line says to write it after
    ``=`` (the README's form), which reads it as the value; a value with a space in it was
    always a value."""
    argv = ["--exp_dir", str(tmp_path), "--source", "m", "--streams", "s.csv", "--methods", "suta"]
    with pytest.raises(SystemExit) as e:
        grid.parse_args(argv + [name, "--lr=1e-4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err == (f"python -m tta_brain.grid: error: argument {name}: expected one argument; a "
                   f"value that starts with '-' goes after '=': {name}=\"--lr=1e-4\" "
                   f"(see --help)\n")
    key = name[2:]
    assert getattr(grid.parse_args(argv + [f"{name}=--lr=1e-4"]), key) == "--lr=1e-4"
    assert getattr(grid.parse_args(argv + [name, "--lr=1e-4 --steps=2"]), key) == \
        "--lr=1e-4 --steps=2"
    with pytest.raises(SystemExit):               # another option's error: as it was
        grid.parse_args(argv + ["--nj", "--lr=1e-4"])
    assert "goes after '='" not in capsys.readouterr().err


def test_two_streams_of_one_name_are_refused(data, tmp_path):
    """Two manifests under one name used to plan the first one's runs only (the second was
    dropped as a duplicate run); the same manifest twice is still one set of runs."""
    other = tmp_path / "other.csv"
    other.write_bytes(Path(data["csv"]).read_bytes())
    argv = grid_argv(data, tmp_path / "exp", "source", "0")
    i = argv.index("--streams") + 1
    with pytest.raises(SystemExit, match=re.escape(
            f"ERROR: --streams: the name 's' is given to {data['csv']} and {other} (their runs "
            f"would share {tmp_path / 'exp' / 's'}); name them apart: NAME=CSV")):
        grid.plan_runs(grid.parse_args(argv[:i + 1] + [f"s={other}"] + argv[i + 1:]))
    twice = grid.plan_runs(grid.parse_args(argv[:i + 1] + [f"s={data['csv']}"] + argv[i + 1:]))
    assert [r.name for r in twice] == ["s/source/seed0"]


def test_streams_and_sweeps_given_twice_and_paths_with_equals_signs(data, tmp_path):
    """A second --streams or --sweep replaced the first, silently (its runs were not planned);
    a manifest under ``snr=20/`` was split at its last ``=`` into a name and a missing file; a
    manifest named ``2020.csv`` failed every run (its stream name read as a number)."""
    folder = tmp_path / "snr=20"
    folder.mkdir()
    for name in ("2020.csv", "b.csv"):
        (folder / name).write_bytes(Path(data["csv"]).read_bytes())
    argv = ["--exp_dir", str(tmp_path / "exp"), "--source", data["model"], "--data_root",
            str(data["root"]), "--methods", "source", "--conf_dir", str(data["conf"]),
            f"--decode_opts={' '.join(RUN)}", "--nj", "1", "--poll", "0.5"]
    runs = grid.plan_runs(grid.parse_args(argv + [
        "--streams", str(folder / "2020.csv"), "--streams", f"n={folder / 'b.csv'}",
        "--sweep", "max_duration=10,20", "--sweep", "precision=fp32"]))
    assert [r.name for r in runs] == [f"{s}/source_{d}/seed0" for s in ("2020", "n")
                                      for d in ("max_duration10_precisionfp32",
                                                "max_duration20_precisionfp32")]
    assert f"--stream_csv={folder / 'b.csv'}" in runs[2].argv
    grid.main(argv + ["--streams", str(folder / "2020.csv")])
    summary = json.loads((tmp_path / "exp" / "2020" / "source" / "seed0" / "summary.json")
                         .read_text())
    assert summary["stream"] == "2020" and summary["n_utts"] == 24


def test_the_overwrite_the_grid_suggests_reruns_the_run_in_its_folder(data, tmp_path, capsys):
    """``--decode_opts=--overwrite``, what a refused run's message says to add, named the runs
    ``<method>_overwrite`` and decoded them there, beside the old ones, as another method."""
    exp = tmp_path / "exp"
    grid.main(grid_argv(data, exp, "source", "0", "--nj", "1"))
    conf = tmp_path / "conf"                # the recipe's settings changed (not in the tags)
    conf.mkdir()
    (conf / "source.opts").write_text("--max_duration=10\n")
    other = grid_argv(data, exp, "source", "0", "--nj", "1")
    other[other.index("--conf_dir") + 1] = str(conf)
    runs = grid.plan_runs(grid.parse_args(other))
    grid.check_done(runs)
    assert runs[0].status == "failed" and runs[0].message.endswith(
        "use another --exp_dir or --decode_opts=--overwrite")
    capsys.readouterr()
    assert grid.main(other) == 1                 # said before the other runs, not only after
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("grid: s/source/seed0 will not run: holds a run with other settings")
    suggested = runs[0].message.rsplit(" or ", 1)[1]    # as typed: argparse takes it
    bare = [a for a in other if not a.startswith("--decode_opts=")]
    assert grid.parse_args(bare + [suggested]).decode_opts == "--overwrite"
    again = [a + " --overwrite" if a.startswith("--decode_opts=") else a for a in other]
    runs = grid.plan_runs(grid.parse_args(again))
    grid.check_done(runs)
    assert [(r.name, r.status) for r in runs] == [("s/source/seed0", "queued")]
    grid.main(again)
    assert sorted(p.name for p in (exp / "s").iterdir()) == ["source"]
    assert json.loads((exp / "s" / "source" / "seed0" / "summary.json").read_text())[
        "hparams"]["max_duration"] == 10


def test_a_source_no_run_can_load_is_one_line_before_any_run(data, tmp_path, capsys):
    """A model path that is not there (or a hub name neither cached nor reachable) failed every
    run of the grid, one by one (459 failures for the LibriSpeech-C recipe's grid); now the
    grid says it once and starts none. A finished grid still says its runs are finished."""
    exp = tmp_path / "exp"
    missing = tmp_path / "models" / "w2v2"
    argv = grid_argv(data, exp, "source suta", "0 1", "--nj", "1")
    bad = argv[:argv.index("--source") + 1] + [str(missing)] + argv[argv.index("--source") + 2:]
    with pytest.raises(SystemExit) as e:
        grid.main(bad)
    assert str(e.value).startswith(f"ERROR: --source {missing}: source model directory not found")
    assert str(e.value).endswith("(every run would fail; none was started)")
    assert not list(exp.glob("s/*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=re.escape(f"{empty} holds no config.json")):
        grid.main(bad[:bad.index(str(missing))] + [str(empty)] + bad[bad.index(str(missing)) + 1:])


def test_a_mistyped_source_beside_finished_runs_is_said_as_such(data, tmp_path, capsys):
    """A mistyped --source (a recipe's --model) over an experiment folder of finished runs: the
    path read as the hub name ``hub:<path>``, so every run was refused as one of other
    settings, to --overwrite; the grid skipped its source check (no run was queued). Now the
    grid says the source once, and a decode names it too, the finished run kept."""
    exp = tmp_path / "exp"
    argv = grid_argv(data, exp, "source", "0", "--nj", "1")
    assert grid.main(argv) == 0
    missing = tmp_path / "models" / "w2v2"
    bad = argv[:argv.index("--source") + 1] + [str(missing)] + argv[argv.index("--source") + 2:]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        grid.main(bad)
    assert str(e.value).startswith(f"ERROR: --source {missing}: source model directory not found")
    assert "other settings" not in capsys.readouterr().out
    folder = exp / "s" / "source" / "seed0"
    with pytest.raises(SystemExit) as e:
        decode.main([f"--source={missing}" if a.startswith("--source=") else a
                     for a in decode_argv(data, folder, "source", "--stream_name=s")])
    said = str(e.value)
    assert "source model directory not found" in said and "other settings" not in said
    assert (folder / "summary.json").is_file()


def test_grid_check_prints_only_the_runs_that_would_not_run(data, tmp_path, capsys):
    """--check (what a recipe asks before its data stages): --dry_run's checks, silent when all
    runs can run."""
    exp = tmp_path / "exp"
    assert grid.main(grid_argv(data, exp, "suta", "0", "--sweep", "lr=1e-3,2e-3", "--check")) == 0
    assert "DRY-RUN" not in capsys.readouterr().out
    assert grid.main(grid_argv(data, exp, "suta", "0", "--sweep", "lr=1e-3,abc", "--check")) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("grid: s/suta_lrabc/seed0 will not run: ERROR: ")
    assert not exp.exists()
    import torch
    if not torch.cuda.is_available():    # this machine's devices, as its local runs meet them
        argv = grid_argv(data, exp, "suta", "0", "--check")
        argv[argv.index(next(a for a in argv if a.startswith("--decode_opts=")))] += \
            " --device=cuda:3"
        assert grid.main(argv) == 1
        assert "no CUDA device here" in capsys.readouterr().out
        assert grid.main(argv[:-1] + ["--dry_run"]) == 0     # commands for another machine


def test_a_run_another_process_is_writing_is_said_so_not_failed(data, tmp_path, capsys):
    """A rerun while another writer holds a run's folder (the worker of a grid killed with -9
    goes on) listed that run as failed ("2 failed"), for a run that was fine. Now it is said
    being written, with the writer, is not run, and the grid exits 1 (not complete); once the
    writer is gone the same command runs it."""
    exp = tmp_path / "exp"
    folder = exp / "s" / "source" / "seed1"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tta_brain.run.identity import FolderLock; "
         "FolderLock(sys.argv[1]).acquire('another writer'); print('held', flush=True); "
         "time.sleep(600)", str(folder)], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert grid.main(grid_argv(data, exp, "source", "0 1", "--nj", "2")) == 1
        out = capsys.readouterr().out
        assert (f"grid: s/source/seed1 is not run here: it is being written by pid {holder.pid} "
                f"on ") in out and "(since " in out and ": another writer)" in out
        assert "NOT RUN s/source/seed1: being written by pid" in out
        assert "FAILED" not in out and "will not run" not in out
        assert ("grid finished: 1 done, 0 running, 0 failed, 0 queued (2 runs, 0 already "
                "finished, 1 being written or queued by another process)") in out
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE]     # untouched
    finally:
        holder.kill()
        holder.wait()
    assert grid.main(grid_argv(data, exp, "source", "0 1", "--nj", "1")) == 0
    assert "grid finished: 1 done, 0 running, 0 failed, 0 queued (2 runs, 1 already finished)" \
        in capsys.readouterr().out


def test_a_run_an_earlier_grid_left_queued_on_slurm_is_busy_until_squeue_drops_it(
        data, tmp_path, monkeypatch):
    """The job an earlier Slurm grid noted in a run's folder (.slurm_job): while squeue lists it,
    the run is busy (not submitted twice); once squeue no longer does, the run is queued; a
    finished run is skipped whatever its note. squeue here is a script on PATH answering as
    Slurm's does (the real cluster: test_a_rerun_does_not_submit_again_what_...)."""
    bin_dir, listed = tmp_path / "bin", tmp_path / "listed"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {listed}\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    argv = grid_argv(data, tmp_path / "exp", "source", "0 1")
    runs = grid.plan_runs(grid.parse_args(argv))
    grid.mark_submitted(runs[0].folder, "4242_0")
    listed.write_text("17\n4242_0\n")
    grid.check_done(runs, device_here=False)
    assert [r.status for r in runs] == ["busy", "queued"]
    assert runs[0].message == ("queued on Slurm as job 4242_0 by an earlier grid (scancel 4242_0 "
                               "to run it here)")
    listed.write_text("17\n")                       # the job left the queue (it ended, or failed)
    runs = grid.plan_runs(grid.parse_args(argv))
    grid.check_done(runs, device_here=False)
    assert [r.status for r in runs] == ["queued", "queued"]
    decode.main(runs[0].argv)
    listed.write_text("4242_0\n")                   # (a job id Slurm gave again, say)
    runs = grid.plan_runs(grid.parse_args(argv))
    grid.check_done(runs, device_here=False)
    assert [r.status for r in runs] == ["skipped", "queued"]


def test_a_grid_started_from_another_thread_runs(data, tmp_path, capsys):
    """grid.main from a thread other than the main one (a notebook's, a server's) stopped with
    ValueError (signal only works in main thread) where it sets its SIGTERM handler, even with
    every run finished; now it runs (its SIGTERM left as it is) and says what it did."""
    import threading
    exp = tmp_path / "exp"
    argv = grid_argv(data, exp, "source", "0", "--nj", "1")
    finished_grid(argv)
    capsys.readouterr()
    before = signal.getsignal(signal.SIGTERM)
    got = {}

    def call():
        try:
            got["rc"] = grid.main(argv)
        except BaseException as e:      # noqa: B902 (what the thread saw, for the assertion)
            got["rc"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert got["rc"] == 0
    assert "grid finished: 0 done, 0 running, 0 failed, 0 queued (1 runs, 1 already finished)" \
        in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_dry_run_says_which_runs_the_grid_would_skip_or_refuse(data, tmp_path, capsys):
    """A dry run listed a finished run's command like any other, though the grid skips it (or
    refuses it, when its folder holds other settings or is damaged): now it says which."""
    exp = tmp_path / "exp"
    finished_grid(grid_argv(data, exp, "source", "0 1", "--nj", "1"))
    capsys.readouterr()
    dry = grid_argv(data, exp, "source", "0 1 2", "--dry_run")
    assert grid.main(dry) == 0
    out = capsys.readouterr().out
    assert out.count("DRY-RUN: ") == 3
    for seed in (0, 1):
        assert f"grid: s/source/seed{seed} is finished with the same settings: the grid " \
            f"skips it" in out
    assert "seed2 is finished" not in out and "will not run" not in out
    # --check prints only the runs that would not run: the skipped ones are not (silent, 0)
    assert grid.main(dry[:-1] + ["--check"]) == 0
    assert "grid: " not in capsys.readouterr().out
    summary = exp / "s" / "source" / "seed1" / "summary.json"
    summary.write_text(summary.read_text()[:40])
    cut = summary.read_bytes()
    assert grid.main(dry) == 0              # beside its last checkpoint: it is written again
    out = capsys.readouterr().out
    assert "seed1 will not run" not in out and out.count("DRY-RUN: ") == 3
    assert "seed1 is finished" not in out   # it resumes: nothing to skip it as finished
    shutil.rmtree(summary.parent / "save")  # without one: decoded again only if asked
    assert grid.main(dry) == 1
    out = capsys.readouterr().out
    assert "grid: s/source/seed0 is finished with the same settings" in out
    line = next(x for x in out.splitlines() if "seed1" in x and x.startswith("grid:"))
    assert line.startswith("grid: s/source/seed1 will not run: it ") and \
        "--decode_opts=--overwrite" in line
    assert summary.read_bytes() == cut                               # nothing written


def test_a_dry_run_over_a_finished_run_whose_stream_is_not_written_yet_refuses_nothing(
        data, tmp_path, capsys):
    """A finished run's folder whose stream manifest is not there now (an earlier stage writes
    it again): a dry run cannot tell whether the grid skips it, so it says nothing of it and
    succeeds."""
    stream = tmp_path / "stream.csv"
    shutil.copyfile(data["csv"], stream)
    exp = tmp_path / "exp"
    finished_grid(grid_argv({**data, "csv": stream}, exp, "source", "0", "--nj", "1"))
    stream.unlink()
    capsys.readouterr()
    assert grid.main(grid_argv({**data, "csv": stream}, exp, "source", "0", "--dry_run")) == 0
    out = capsys.readouterr().out
    assert out.count("DRY-RUN: ") == 1 and "will not run" not in out and " is finished" not in out


def test_an_exp_dir_that_cannot_be_made_is_one_line(data, tmp_path, capsys):
    blocker = tmp_path / "results"             # a file where the results folder should be
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:       # was submitit's NotADirectoryError traceback
        grid.main(grid_argv(data, blocker, "source", "0", "--nj", "1"))
    assert str(e.value).startswith(f"ERROR: --exp_dir {blocker}: cannot create {blocker}/.grid/")
    assert str(e.value).endswith(": Not a directory") and blocker.read_text() == ""


# ----------------------------------------------------------------------------- Slurm
@pytest.mark.parametrize("recipe", ["synthetic", "librispeech_c", "chime3"])
def test_the_recipes_slurm_conf_makes_an_executor(recipe, tmp_path):
    """Each recipe's conf/slurm.yaml as submitit takes it (its requeue count is a constructor
    argument, not a job parameter: the shipped files used to stop every --engine slurm grid)."""
    conf = REPO / "recipes" / recipe / "conf" / "slurm.yaml"
    args = argparse.Namespace(nj=4, slurm_conf=str(conf), exp_dir=str(tmp_path / "exp"))
    ex = grid.slurm_executor(args, tmp_path / "exp" / ".grid", submit=False)
    assert ex._executor.max_num_timeout == 30
    assert ex._executor.parameters == {
        "partition": "debug", "time": 240, "cpus_per_task": 2, "mem": "8GB", "gpus_per_node": 0,
        "signal_delay_s": 120, "array_parallelism": 4}
    assert not (tmp_path / "exp").exists()                  # made on submission only


@pytest.mark.parametrize("text,expected", [
    (None, "No such file or directory"),
    ("slurm_partition: debug\ntime_min: 10\n", "Unknown executor 'time' in parameter 'time_min'"),
    ("slurm_partiton: debug\n", "Unknown argument 'partiton' for executor 'slurm'"),
    ("mem_gb: 8G\n", 'Parameter "mem_gb" expected type'),
    ("a: [1\n", "yaml syntax error"),
    ("- slurm_partition\n", "expected key: value lines (submitit parameters), got a list"),
    ("timeout_min: 2\n", "timeout_min 2 leaves 30 s before Slurm's USR2 (slurm_signal_delay_s 90)"),
    ("timeout_min: 4\nslurm_signal_delay_s: 180\n", "timeout_min 4 leaves 60 s before"),
    # sbatch's own forms were not read (no check); the message names the key the conf sets
    ("slurm_time: '00:01:00'\n", "slurm_time '00:01:00' (1 min) leaves -30 s before Slurm's "
                                   "USR2 (slurm_signal_delay_s 90), which Slurm may send up to "
                                   "60 s early: raise slurm_time"),
    ("slurm_time: 1\n", "slurm_time 1 leaves -30 s before"),
    ("slurm_time: '0-0:02'\n", "slurm_time '0-0:02' (2 min) leaves 30 s before"),
])
def test_a_bad_slurm_conf_is_one_line_before_anything_runs(text, expected, tmp_path, data):
    conf = tmp_path / "slurm.yaml"
    if text is not None:
        conf.write_text(text)
    exp = tmp_path / "exp"
    res = subprocess.run([sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, exp, "suta", "0", "--engine", "slurm", "--slurm_conf", str(conf), "--dry_run")],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and f"ERROR: --slurm_conf {conf}: {expected}" in res.stderr
    assert "Traceback" not in res.stderr and "DRY-RUN" not in res.stdout and not exp.exists()


def test_a_slurm_time_limit_is_read_in_each_of_sbatchs_forms():
    """The time limit the USR2 check reads (sbatch(1), --time): minutes, MM:SS, HH:MM:SS,
    D-HH, D-HH:MM, D-HH:MM:SS; what is none of them (a bool: yaml's `yes`) is sbatch's to say."""
    assert [grid.slurm_minutes(v) for v in (90, 2.5, "7", "05:30", "02:03:30", "1-02",
                                            "1-02:03", "1-02:03:30")] == \
        [90.0, 2.5, 7.0, 5.5, 123.5, 1560.0, 1563.0, 1563.5]
    assert [grid.slurm_minutes(v) for v in (True, "abc", "1:2:3:4", "")] == [None] * 4


def test_a_machine_without_slurm_checks_the_conf_on_a_dry_run_and_refuses_to_submit(
        tmp_path, data):
    """Without ``srun`` (a laptop, CI before its cluster starts) a Slurm grid's dry run still
    checks the conf and prints the commands, and a real one is one line, not submitit's
    traceback (its executor refuses to be built there)."""
    no_srun = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                              if d and not os.path.exists(os.path.join(d, "srun")))
    conf = REPO / "recipes" / "synthetic" / "conf" / "slurm.yaml"
    exp = tmp_path / "exp"
    argv = [sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, exp, "suta", "0", "--engine", "slurm", "--slurm_conf", str(conf))]
    env = {**ENV, "PATH": no_srun}
    dry = subprocess.run(argv + ["--dry_run"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert dry.returncode == 0 and dry.stdout.count("DRY-RUN: ") == 1, dry.stderr[-2000:]
    bad = tmp_path / "bad.yaml"
    bad.write_text("slurm_partiton: debug\n")
    res = subprocess.run(argv[:-1] + [str(bad), "--dry_run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Unknown argument 'partiton'" in res.stderr
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "ERROR: --engine slurm: no `srun` on this machine's PATH: submit from a Slurm login node "
        "(--dry_run checks --slurm_conf anywhere)")
    assert not exp.exists()


def test_a_slurm_that_will_not_take_the_jobs_is_one_line_naming_why(tmp_path, data):
    """A login node without ``sbatch`` (``srun`` alone) and an ``sbatch`` that refuses the jobs
    (here a program that answers as sbatch does for a mistyped partition; the real cluster's
    answer is in test_slurm_grid_with_a_partition_it_lacks_is_one_line) are one line each, not
    submitit's traceback, and nothing is left queued."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").symlink_to(shutil.which("true"))
    python_dir = os.path.dirname(sys.executable)
    conf = REPO / "recipes" / "synthetic" / "conf" / "slurm.yaml"
    argv = [sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, tmp_path / "exp", "suta", "0", "--engine", "slurm", "--slurm_conf", str(conf))]
    env = {**ENV, "PATH": os.pathsep.join([str(bin_dir), python_dir, "/usr/bin", "/bin"])}
    if shutil.which("sbatch", path=env["PATH"]):
        env["PATH"] = os.pathsep.join([str(bin_dir), python_dir])
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "ERROR: --engine slurm: no `sbatch` on this machine's PATH: submit from a Slurm login "
        "node (--dry_run checks --slurm_conf anywhere)")
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: debug' >&2\n"
                      "echo 'sbatch: error: Batch job submission failed: Invalid partition name "
                      "specified' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (
        f"ERROR: --engine slurm: sbatch did not take the 1 job(s), nothing was submitted: "
        f"sbatch: error: Batch job submission failed: Invalid partition name specified (check "
        f"--slurm_conf {conf} and the cluster)")


@pytest.mark.slow
def test_slurm_grid_with_a_partition_it_lacks_is_one_line(data, tmp_path, slurm_cluster):
    conf = tmp_path / "slurm.yaml"
    conf.write_text("slurm_partition: nosuchpartition\ntimeout_min: 10\n")
    res = subprocess.run([sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, tmp_path / "exp", "suta", "0 1", "--engine", "slurm", "--slurm_conf", str(conf))],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ERROR: --engine slurm: sbatch did not take the 2 job(s), nothing was "
                           "submitted: sbatch: ") and "partition" in last.lower(), last
    assert last.endswith(f"(check --slurm_conf {conf} and the cluster)"), last


@pytest.mark.slow
def test_slurm_grid_equals_serial_runs_and_survives_scancel(data, tmp_path, slurm_cluster):
    methods = "source suta dsuta+dynamic"
    ref, exp = tmp_path / "ref", tmp_path / "exp"
    serial(data, ref, methods)
    cmd, env, proc = start_slurm_grid(data, tmp_path, exp, methods, "0 1", slurm_cluster)
    victim = exp / "s" / "dsuta+dynamic" / "seed1"
    pid = freeze_after_a_checkpoint(victim, proc)
    assert proc.poll() is None, "the grid ended before a job could be cancelled"
    job = slurm_job_of(pid)                      # the job whose process holds the folder lock
    subprocess.run(["scancel", job], check=True, env=env)
    # scancel sends SIGTERM, which submitit bypasses, and SIGKILL after Slurm's KillWait; this
    # tiny run would finish within KillWait, so the test delivers that SIGKILL itself
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1 and "FAILED s/dsuta+dynamic/seed1" in out, out[-3000:]
    said = next(ln for ln in out.splitlines() if ln.startswith("FAILED s/dsuta+dynamic/seed1"))
    # its Slurm state, not submitit's "Error stream produced:" header
    assert "the job ended without a result (Slurm state: CANCELLED" in said, said
    wait_for(lambda: holder_pid_alive(victim) is False, "the cancelled job's exit", 120)
    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "(6 runs, 5 already finished)" in rerun.stdout
    assert compare_runs.main([str(ref), str(exp)]) == 0


def one_task_at_a_time(data, tmp_path, method, slurm_conf_env):
    """``(command, environment)`` of a Slurm grid of ``method`` x seeds 0 1 2 whose array tasks
    ask two CPUs each, so the two-CPU node runs one while the others wait; Slurm's queue asked
    every 2 s."""
    conf = tmp_path / "slurm.yaml"
    conf.write_text("slurm_partition: debug\ntimeout_min: 10\ncpus_per_task: 2\nmem_gb: 1\n")
    cmd = [sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, tmp_path / "exp", method, "0 1 2", "--engine", "slurm", "--nj", "3",
        "--slurm_conf", str(conf))]
    return cmd, {**ENV, "SLURM_CONF": slurm_conf_env, "TTA_GRID_PENDING_EVERY": "2"}


@pytest.mark.slow
def test_a_job_cancelled_while_pending_fails_its_run_not_the_wait(data, tmp_path, slurm_cluster):
    """An array task cancelled before it started leaves no trace in squeue or sacct and
    submitit's state stays UNKNOWN: the grid waited for it for ever (and, stopped, named it as
    a job that goes on). Now it fails that run, naming the job; a rerun completes it."""
    cmd, env = one_task_at_a_time(data, tmp_path, "source", slurm_cluster)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def pending():         # one task running, two waiting for its CPUs (still one
            states = dict(ln.split("|") for ln in subprocess.run(    # record: 7_[1-2])
                ["squeue", "-h", "-r", "-o", "%i|%T"], env=env, capture_output=True,
                text=True).stdout.split())
            waiting = sorted(i for i, st in states.items() if st == "PENDING")
            if "RUNNING" in states.values() and len(waiting) == 2:
                return waiting[-1:]
            return proc.poll() is not None
        wait_for(pending, "one array task running, two pending", 120)
        task = pending()
        assert task is not True, "the grid ended before a task could be cancelled"
        subprocess.run(["scancel", task[0]], check=True, env=env)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", "-u", os.environ.get("USER", "root")], env=env)
    assert proc.returncode == 1, out[-3000:]
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED s/source/seed")]
    assert len(failed) == 1 and f"Slurm job {task[0]} left the queue without a result, and " \
        "Slurm keeps no record of it (cancelled before it started?)" in failed[0], out[-3000:]
    assert "go on:" not in out
    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0 and "(3 runs, 2 already finished)" in rerun.stdout, \
        rerun.stdout[-3000:]


@pytest.mark.slow
def test_a_rerun_does_not_submit_again_what_an_earlier_grid_left_pending(data, tmp_path,
                                                                         slurm_cluster):
    """A grid stopped (Ctrl-C, SIGTERM) leaves its Slurm jobs going; rerun at once, it submitted
    the still-pending runs again (they hold no folder lock yet): duplicates, and a run that
    finished said FAILED. Now they are said queued by the earlier grid, as running ones are
    said being written; once those jobs are done, a rerun finds everything finished."""
    cmd, env = one_task_at_a_time(data, tmp_path, "suta", slurm_cluster)

    def states():
        return dict(ln.split("|") for ln in subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i|%T"], env=env, capture_output=True,
            text=True).stdout.split())
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: list(states().values()).count("PENDING") == 2 or proc.poll() is not None,
                 "one task running, two pending", 120)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "go on:" in out, out[-2000:]
        before = states()
        rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=600)
        said = rerun.stdout
        assert rerun.returncode == 1, said[-3000:]
        queued = [ln for ln in said.splitlines() if "queued on Slurm as job" in ln
                  and ln.startswith("grid: s/suta/seed")]
        assert queued, said[-3000:]
        assert not [ln for ln in said.splitlines() if ln.startswith("FAILED")], said[-3000:]
        assert set(states()) <= set(before)               # nothing submitted again
        wait_for(lambda: not states(), "the earlier grid's jobs", 300)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["scancel", "-u", os.environ.get("USER", "root")], env=env)
    final = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0 and "(3 runs, 3 already finished)" in final.stdout, \
        final.stdout[-3000:]


def test_the_pending_line_names_jobs_that_never_start_and_counts_the_others():
    from tta_brain.run.grid_plan import Run
    runs = {j: [Run(f"s/{m}/seed0", Path(m), [])] for j, m in
            (("7_0", "source"), ("7_1", "suta"), ("7_2", "tent"))}
    line = grid.pending_line(runs, {"7_0": "Resources", "7_1": "PartitionConfig",
                                    "7_2": "Resources"})
    assert line == ("grid: pending on Slurm: s/suta/seed0 (job 7_1: PartitionConfig; it will not "
                    "start: its partition cannot give what --slurm_conf asks); 2 job(s) waiting "
                    "(Resources: 2)")
    assert grid.pending_line(runs, {}) == ""
    # Slurm's reason of a job its scheduler has not looked at yet is "None" (it was printed so)
    assert grid.pending_line(runs, {"7_0": "None", "7_2": "Priority"}).endswith(
        "2 job(s) waiting (Priority: 1, not scheduled yet: 1)")


def test_a_failed_jobs_line_says_why():
    """decode's own ERROR line; a job that ended without a result: its Slurm state (submitit's
    "Error stream produced:" header was taken as the reason); else the last error line."""
    lost = ("Job 14 (task: 0) with path /x/14_0_result.pkl\nhas not produced any output "
            "(state: CANCELLED by 0)\nError stream produced:\n----\nsubmitit WARNING bypassing")
    assert grid.failure_line(lost) == ("the job ended without a result (Slurm state: "
                                       "CANCELLED by 0)")
    # a local worker killed (kill -9): submitit says FINISHED, which is no Slurm state
    assert grid.failure_line(lost.replace("CANCELLED by 0", "FINISHED"), local=True) == \
        "the local worker process ended without a result (killed?)"
    own = lost + "\nRuntimeError: ERROR: /x/stream.csv: missing (--stream_csv)"
    assert grid.failure_line(own) == "ERROR: /x/stream.csv: missing (--stream_csv)"
    assert grid.failure_line("Traceback\n  ...\nValueError: bad\n") == "ValueError: bad"
    # the last of decode's lines (the one that ended it); submitit's header is no error line
    assert grid.failure_line("ERROR: first\nRuntimeError: ERROR: last\n") == "ERROR: last"
    assert grid.failure_line("ValueError: bad\nError stream produced:\n") == "ValueError: bad"
    assert grid.failure_line("", "UncompletedJobError") == "UncompletedJobError"
    # what a job raises: decode's one-line error as a failure; submitit's sys.exit(-1) after it
    # requeued the job (Slurm's USR2) as it is, or the grid read the requeued job as failed
    said = grid._failed(SystemExit("ERROR: /x/stream.csv: missing"))
    assert isinstance(said, RuntimeError) and str(said) == "ERROR: /x/stream.csv: missing"
    requeued = SystemExit(-1)
    assert grid._failed(requeued) is requeued


def test_the_grid_follows_its_jobs_to_each_runs_own_end(tmp_path, monkeypatch, capsys):
    """The loop that follows the jobs (local workers: a stand-in for submitit's executor): a
    batch's job ends with one error or None per run, each run failed or done by its own; a
    finished job frees its slot once (--nj 1: one job at a time); while long runs go on with
    the same counts the line is printed again (at least every PROGRESS_EVERY s: here every
    poll), or their ETA was the first one said for hours."""
    from types import SimpleNamespace
    runs = [grid_plan.Run(f"s/suta_lr{i}/seed0", tmp_path / str(i), [str(i)], total=2000)
            for i in range(4)]
    going, most = [], [0]

    class Workers:
        def update_parameters(self, visible_gpus, gpus_per_node):
            pass

        def submit(self, unit):
            going.append(unit)
            most[0] = max(most[0], len(going))
            looks = []

            def done():           # running at its first two looks, finished from its third on
                looks.append(1)
                if len(looks) == 3:
                    going.remove(unit)
                return len(looks) >= 3
            errors = ["ERROR: --lr0: refused", None] if len(unit) > 1 else None
            return SimpleNamespace(done=done, result=lambda: errors, paths=SimpleNamespace(
                stdout=tmp_path / "o", stderr=tmp_path / "e"))
    monkeypatch.setattr(grid, "PROGRESS_EVERY", 0.0)
    args = argparse.Namespace(engine="local", gpus="", per_gpu=2, nj=1, poll=0.001)
    grid._follow(runs, [runs[:2], runs[2:3], runs[3:]], args, Workers(), {},
                 lambda unit, threads=0: unit)
    assert [(r.status, r.message) for r in runs] == [("failed", "ERROR: --lr0: refused")] + \
        [("done", "")] * 3
    assert most == [1] and not going
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("grid: 0 done, 2 running, 0 failed, 2 queued (4 runs, 0 already finished) | "
                      "s/suta_lr0/seed0 0/2000 ? left, s/suta_lr1/seed0 0/2000 ? left | grid ETA ?")
    assert out[1] == out[0]                 # the same counts: said again
    assert out[-1] == "grid: 3 done, 0 running, 1 failed, 0 queued (4 runs, 0 already finished)"


@pytest.mark.slow
def test_a_job_slurm_cannot_start_is_said_pending_with_its_reason(data, tmp_path, slurm_cluster):
    """More CPUs than the node has: sbatch takes the job, which stays pending for ever
    (PartitionConfig) while the progress said "1 running"; now a line names the run, its job
    and Slurm's reason, and says it will not start."""
    conf = tmp_path / "slurm.yaml"
    conf.write_text("slurm_partition: debug\ntimeout_min: 10\ncpus_per_task: 64\nmem_gb: 1\n")
    cmd = [sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, tmp_path / "exp", "source", "0", "--engine", "slurm", "--slurm_conf", str(conf))]
    env = {**ENV, "SLURM_CONF": slurm_cluster}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, job = [], None
    import threading
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        said = lambda: [ln for ln in list(lines)       # noqa: E731
                        if ln.startswith("grid: pending on Slurm: s/source/seed0 (job ")]
        wait_for(lambda: said() or proc.poll() is not None, "a pending line", 120)
        assert said(), "".join(lines)[-3000:]
        line = said()[0]
        job = line.split("(job ", 1)[1].split(":", 1)[0]
        assert "it will not start" in line and any(r in line for r in grid.NEVER_STARTS), line
        # and the progress counts it pending, not running (said after the pending line)
        wait_for(lambda: any("1 pending on Slurm" in ln for ln in list(lines)), "progress", 30)
        assert not any("grid: 0 done, 1 running" in ln for ln in lines[lines.index(said()[0]):])
        proc.terminate()                     # the grid stops; its job goes on, and it says so
        proc.wait(timeout=60)
        wait_for(lambda: any(ln.startswith("grid: stopped") for ln in list(lines)), "the end", 30)
        assert f"grid: stopped; its 1 Slurm job(s) go on: {job} (scancel" in "".join(lines)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        subprocess.run(["scancel", job] if job else ["scancel", "--name=submitit"], env=env)


@pytest.mark.slow
def test_a_preempted_slurm_job_is_followed_to_its_end_not_failed(data, tmp_path, slurm_cluster):
    """Slurm's USR2 (preemption, or the time limit near): submitit checkpoints the run, requeues
    the job and exits (``sys.exit(-1)``). The job turned that exit into a failure, so the grid
    said ``FAILED ...: RuntimeError: -1`` and ended while the requeued job went on to finish.
    Now the grid follows the requeued job, which resumes and ends as an uninterrupted run."""
    ref, exp = tmp_path / "ref", tmp_path / "exp"
    serial(data, ref, "dsuta+dynamic", seeds=("0",))
    _, env, proc = start_slurm_grid(data, tmp_path, exp, "dsuta+dynamic", "0", slurm_cluster)
    victim = exp / "s" / "dsuta+dynamic" / "seed0"
    pid = freeze_after_a_checkpoint(victim, proc)
    subprocess.run(["scancel", "--signal=USR2", slurm_job_of(pid)], check=True, env=env)
    os.kill(pid, signal.SIGCONT)                 # it takes the USR2 now, mid-run
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "FAILED" not in out, out[-3000:]
    assert "grid finished: 1 done, 0 running, 0 failed" in out, out[-3000:]
    assert "Resuming" in (victim / "log.txt").read_text()          # the requeued job's
    assert compare_runs.main([str(ref), str(exp)]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a Slurm node without CUDA")
def test_slurm_run_checks_its_device_on_its_node(data, tmp_path, slurm_cluster):
    """--device=cuda from a machine without CUDA: the grid submits the job (the submitting machine
    is not where it decodes) and the run stops on its node with the one-line reason."""
    conf = tmp_path / "slurm.yaml"
    conf.write_text("slurm_partition: debug\ntimeout_min: 5\ncpus_per_task: 1\nmem_gb: 1\n")
    exp = tmp_path / "exp"
    cmd = [sys.executable, "-m", "tta_brain.grid", *grid_argv(data, exp, "suta", "0", "--engine",
                                                              "slurm", "--slurm_conf", str(conf))]
    cmd[cmd.index(f"--decode_opts={' '.join(RUN)}")] += " --device=cuda"
    res = subprocess.run(cmd, cwd=REPO, env={**ENV, "SLURM_CONF": slurm_cluster},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 failed, 1 queued" in res.stdout                      # not refused before submission
    assert "FAILED s/suta/seed0: ERROR: --device=cuda: no CUDA device here" in res.stdout
    assert "seed0/log.txt" not in res.stdout and "_log.err" in res.stdout   # the files there are


def start_slurm_grid(data, tmp_path, exp, methods, seeds, slurm_conf_env):
    """``(command, environment, process)`` of a Slurm grid started with the recipes' conf (two
    array tasks at once, a 10-minute limit, requeues allowed)."""
    conf = tmp_path / "slurm.yaml"
    conf.write_text("slurm_partition: debug\ntimeout_min: 10\ncpus_per_task: 1\nmem_gb: 2\n"
                    "slurm_signal_delay_s: 60\nslurm_max_num_timeout: 5\n")  # as the recipes' conf
    cmd = [sys.executable, "-m", "tta_brain.grid", *grid_argv(
        data, exp, methods, seeds, "--engine", "slurm", "--nj", "2", "--slurm_conf", str(conf))]
    env = {**ENV, "SLURM_CONF": slurm_conf_env}
    return cmd, env, subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)


def freeze_after_a_checkpoint(folder, proc):
    wait_for(lambda: list((folder / "save").glob("CKPT+*/stream.ckpt")) or proc.poll() is not None,
             f"a checkpoint of {folder}", 300)
    return freeze_mid_run(folder)


def freeze_mid_run(folder):
    """SIGSTOP the process writing ``folder`` (it must not finish before the test kills it)."""
    pid = holder_pid(folder)
    assert pid, f"nobody writes {folder}"
    os.kill(pid, signal.SIGSTOP)
    assert not (Path(folder) / "summary.json").exists(), "the run had finished already"
    return pid


def slurm_job_of(pid):
    """The Slurm job (array task: ``<array job>_<task>``) a process runs in (its environment)."""
    env = dict(e.decode().split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes()
               .split(b"\0") if b"=" in e)
    if "SLURM_ARRAY_JOB_ID" in env:
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def holder_pid_alive(folder):
    pid = holder_pid(folder)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def test_the_grid_reads_each_stream_once_and_its_runs_share_its_rows(data, tmp_path, monkeypatch):
    """Looking at its runs' folders (check_done: every run's decode.plan), the grid read and
    digested a run's stream once per run and kept each run's own copy of its rows: for 500 runs
    of 10,000-row streams, 4 GiB in the grid's process and minutes before the first run."""
    from tta_brain import decode
    reads = []
    real = decode.load_stream

    def counted(*a, **k):
        reads.append(a[0])
        return real(*a, **k)
    monkeypatch.setattr(decode, "load_stream", counted)
    runs = grid.plan_runs(grid.parse_args(grid_argv(data, tmp_path / "exp", "source suta", "0 1")))
    grid.check_done(runs)
    assert len(runs) == 4 and all(r.status == "queued" for r in runs)
    assert len(reads) == 1
    assert all(r.plan.rows is runs[0].plan.rows for r in runs)
    alone = decode.plan(runs[1].argv)           # a plan of its own: the same rows, fingerprint
    assert alone.rows == runs[1].plan.rows and alone.fingerprint == runs[1].plan.fingerprint


def test_a_dry_run_reads_the_stream_of_its_finished_runs_once(data, tmp_path, monkeypatch):
    """A dry run looked at each finished run's folder with a plan of its own, each reading and
    digesting the run's stream again (500 finished runs of one 10,000-row stream: 500 reads)."""
    from tta_brain import decode
    exp = tmp_path / "exp"
    finished_grid(grid_argv(data, exp, "source", "0 1", "--nj", "1"))
    reads = []
    real = decode.load_stream
    monkeypatch.setattr(decode, "load_stream", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    assert grid.main(grid_argv(data, exp, "source", "0 1", "--dry_run")) == 0
    assert len(reads) == 1


def test_local_workers_take_the_users_thread_count(monkeypatch):
    """A local worker's threads were the machine's cores over the workers, the user's
    OMP_NUM_THREADS overridden (a run of the grid rounded otherwise than the same decode);
    the cores are this process's (its affinity), not the machine's."""
    import os
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert grid.local_threads(1) == cores and grid.local_threads(cores + 1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert grid.local_threads(1) == 3 and grid.local_threads(8) == 3
    for junk in ("junk", "0"):              # (0 threads: the job had set none, all cores each)
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert grid.local_threads(1) == cores
