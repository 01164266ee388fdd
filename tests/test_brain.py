"""TTABrain / tta_brain.decode: resume after kill -9 or a crash, determinism, non-finite steps.

A ~20-utterance stream of short generated audio (two alternating domains) is decoded with
dsuta + dynamic reset, K=6, M=2, N=2 and a z threshold that always detects, so that LII values
are written and resets happen (positions 8 and 16) across checkpoints.
"""
import csv
import json
import os
import shutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import crash_at, kill_9_mid_run
from fake_corpora import write_stream
from tta_brain import decode

REPO = Path(__file__).resolve().parents[1]
RECORDS = ("transcripts.csv", "resets.csv", "lii.csv", "rejects.csv", "wer.txt")
DSUTA = ["--reset=dynamic", "--reset_K=6", "--buffer_size=2", "--steps=2", "--lr=0.05",
         "--reset_patience=1", "--reset_threshold=-100"]



@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model_dir):
    root = write_stream(tmp_path_factory.mktemp("stream"))
    return {"root": root, "csv": root / "stream.csv", "model": tiny_model_dir}


def args(data, out, *extra, method="dsuta", csv_path=None):
    return [method, f"--source={data['model']}",
            f"--stream_csv={csv_path or data['csv']}", f"--output_folder={out}",
            f"--data_root={data['root']}", "--noprogressbar", *extra]


def records(out):
    return {name: (Path(out) / name).read_text() for name in RECORDS}


def summary(out):
    s = json.loads((Path(out) / "summary.json").read_text())
    return {k: s[k] for k in ("wer", "n_err", "n_words", "n_utts", "n_skipped", "resets",
                              "counts", "wer_per_domain")}


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run (in this process, one thread, like the subprocesses)."""
    out = tmp_path_factory.mktemp("ref") / "exp"
    decode.main(args(data, out, *DSUTA, "--ckpt_every=3"))
    return out


def test_reference_run_has_resets_and_lii(reference):
    s = summary(reference)
    assert s["n_utts"] == 20 and s["n_skipped"] == 0
    assert s["resets"] == [8, 16]
    rows = list(csv.DictReader(open(reference / "transcripts.csv")))
    assert [int(r["position"]) for r in rows] == list(range(20))
    assert [int(r["position"]) for r in rows if r["reset"] == "1"] == [8, 16]
    assert len(list(csv.DictReader(open(reference / "lii.csv")))) >= 6
    assert not list((reference / "save").rglob("*.tmp"))      # (in its CKPT+ folder too)


def test_reference_run_wer_is_the_transcripts_scored_independently(data, reference):
    """The run's WER, per utterance, per domain and over the run, is its written references and
    hypotheses scored by jiwer (an independent implementation), the references the manifest's
    ``wrd`` normalised; the counts are not all zero (a vacuous check otherwise)."""
    import jiwer
    from tta_brain.asr.metrics import normalize_text
    s = json.loads((reference / "summary.json").read_text())
    rows = list(csv.DictReader(open(reference / "transcripts.csv")))
    manifest = {r["ID"]: r for r in csv.DictReader(open(data["csv"]))}
    assert [r["ref"] for r in rows] == [normalize_text(manifest[r["ID"]]["wrd"]) for r in rows]
    for r in rows:
        m = jiwer.process_words(r["ref"], r["hyp"])
        want = (len(r["ref"].split()), m.substitutions, m.deletions, m.insertions)
        assert tuple(int(r[k]) for k in ("n_words", "n_sub", "n_del", "n_ins")) == want, r
        assert int(r["n_err"]) == sum(want[1:]), r
    refs, hyps = [r["ref"] for r in rows], [r["hyp"] for r in rows]
    assert s["n_words"] == sum(len(x.split()) for x in refs)
    assert s["wer"] == pytest.approx(100 * jiwer.wer(refs, hyps))
    assert 0 < s["n_err"] and any(r["hyp"] for r in rows)
    domains = sorted({r["domain"] for r in rows})
    assert sorted(s["wer_per_domain"]) == domains == ["d0", "d1"]
    for d in domains:
        mine = [r for r in rows if r["domain"] == d]
        assert s["wer_per_domain"][d] == pytest.approx(
            100 * jiwer.wer([r["ref"] for r in mine], [r["hyp"] for r in mine])), d


def test_a_reset_after_the_last_utterance_is_not_recorded(data, tmp_path):
    """A fixed reset due after the stream's last utterance was written to resets.csv (its ID
    empty, its position past the stream), counted in the summary and by the report's boundary
    detection, though no utterance was decoded from it and the run's warning said the policy
    never fires on such a stream. Now it is logged, not recorded."""
    out = tmp_path / "exp"
    s = decode.main(args(data, out, "--reset=fixed", "--reset_every=10", "--steps=1",
                         "--ckpt_every=0", method="csuta"))
    assert s.n_utts == 20 and s.resets == [10] and summary(out)["resets"] == [10]
    assert [(r["position"], r["trigger"]) for r in csv.DictReader(open(out / "resets.csv"))] \
        == [("10", "9")]                        # (announced by utterance 9's processing)
    log = (out / "log.txt").read_text()
    assert "csuta+fixed reset after the last utterance (fixed (every 10)): not recorded" in log
    assert re.search(r"csuta\+fixed reset: position 10 \(\S+\) starts from the source model "
                     r"\(fixed \(every 10\)\)", log)
    # the last rows skipped (longer than max_duration): the last decoded utterance is the last
    rows = list(csv.DictReader(open(data["csv"])))
    for row in rows[15:]:
        row["duration"] = "99"
    cut = tmp_path / "cut.csv"
    with open(cut, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    s = decode.main(args(data, tmp_path / "cut", "--reset=fixed", "--reset_every=5", "--steps=1",
                         "--ckpt_every=0", method="csuta", csv_path=cut))
    assert s.n_utts == 15 and s.n_skipped == 5 and s.resets == [5, 10]


def test_a_reset_due_at_a_skipped_row_marks_the_next_decoded_utterance(data, tmp_path,
                                                                        monkeypatch):
    """A fixed reset due at a row that is skipped (longer than max_duration) kept its position in
    resets.csv, but no transcript said reset: resets.csv counted 1, the reset column 0. The
    next decoded utterance is the first from the reset model; it is marked, across a resume
    too (the checkpoint after the skipped row, before that utterance)."""
    rows = list(csv.DictReader(open(data["csv"])))
    rows[5]["duration"] = "99"
    cut = tmp_path / "cut.csv"
    with open(cut, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    run = ["--reset=fixed", "--reset_every=5", "--steps=1", "--ckpt_every=1"]
    s = decode.main(args(data, tmp_path / "a", *run, method="csuta", csv_path=cut))
    assert s.n_skipped == 1 and s.resets == [5, 11, 16]     # 5 decoded utterances a reset
    flagged = [int(r["position"]) for r in csv.DictReader(open(tmp_path / "a" / "transcripts.csv"))
               if r["reset"] == "1"]
    assert flagged == [6, 11, 16]
    crash_at(monkeypatch, args(data, tmp_path / "b", *run, method="csuta",
                          csv_path=cut), 6)
    decode.main(args(data, tmp_path / "b", *run, method="csuta", csv_path=cut))
    assert records(tmp_path / "b") == records(tmp_path / "a")


def test_every_row_is_on_disk_before_the_next_is_decoded(data, tmp_path, monkeypatch):
    """The records are flushed after every row, not only at a checkpoint: the grid's progress
    line counts a running run's rows from its files (``records.rows_done``), and a kill -9
    loses none of the rows decoded so far. A skipped row (longer than max_duration) counts too
    (mutation audit: without the flush, ckpt_every = 0 showed 0 rows until the end); the run's
    max_duration decides which rows are skipped; a reference is scored normalised."""
    from tta_brain.run.brain import TTABrain
    from tta_brain.run.records import rows_done
    rows = list(csv.DictReader(open(data["csv"])))
    rows[5]["duration"] = "99"
    wrd, rows[3]["wrd"] = rows[3]["wrd"], rows[3]["wrd"].lower() + "."   # scored normalised
    cut = tmp_path / "cut.csv"
    with open(cut, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out, seen, orig = tmp_path / "exp", [], TTABrain.evaluate_batch

    def spy(self, batch, stage=None):
        seen.append((batch[1].position, rows_done(out)))
        return orig(self, batch)
    monkeypatch.setattr(TTABrain, "evaluate_batch", spy)
    s = decode.main(args(data, out, "--steps=1", "--ckpt_every=0", method="suta", csv_path=cut))
    assert s.n_skipped == 1
    assert seen == [(p, p) for p in range(20) if p != 5]
    assert [t["ref"] for t in csv.DictReader(open(out / "transcripts.csv"))][3] == \
        " ".join(wrd.upper().split())
    longer = sum(float(r["duration"]) > 0.4 for r in csv.DictReader(open(data["csv"])))
    assert 0 < longer < 20
    s = decode.main(args(data, tmp_path / "short", "--steps=1", "--ckpt_every=0",
                         "--max_duration=0.4", method="suta"))
    assert s.n_skipped == longer and s.n_utts == 20 - longer


@pytest.mark.slow
def test_kill_9_and_rerun_reproduces_the_uninterrupted_run(data, reference, tmp_path):
    out = tmp_path / "exp"
    cmd = [sys.executable, "-m", "tta_brain.decode", *args(data, out, *DSUTA, "--ckpt_every=3")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    kill_9_mid_run(cmd, out, env)
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "Resuming" in log
    assert records(out) == records(reference)
    assert summary(out) == summary(reference)
    env_log = (out / "env.log").read_text()     # both starts' environments (one was written over)
    assert env_log.startswith("SpeechBrain system description")
    assert env_log.count("tta-brain run") == 2 and env_log.count("resumed: the environment") == 1


@pytest.mark.slow
def test_crashes_at_several_points_resume_exactly(data, reference, tmp_path, monkeypatch):
    """Crash (exception) after checkpoints at 8 and 16, where a reset triggered by the previous
    utterance takes effect on the first resumed one; also a torn last line and a checkpoint
    directory left incomplete by a kill during the save."""
    out = tmp_path / "exp"
    run = args(data, out, *DSUTA, "--ckpt_every=4")
    for position in (10, 17):
        crash_at(monkeypatch, run, position)
        assert not (out / "summary.json").exists()
        with open(out / "transcripts.csv", "a") as f:     # half a record, as a kill may leave
            f.write("1")
        ckpt = next((out / "save").glob("CKPT+*"))
        torn = ckpt.with_name("CKPT+9999-01-01+00-00-00+00")   # newest, meta but no state
        torn.mkdir()
        (torn / "CKPT.yaml").write_text(
            (ckpt / "CKPT.yaml").read_text().replace("unixtime:", "unixtime: 9") + "\n")
    decode.main(run)
    assert records(out) == records(reference)
    assert summary(out) == summary(reference)
    assert len(list((out / "save").glob("CKPT+*"))) == 1      # torn ones were removed


def test_resume_refuses_another_stream_and_truncated_records(data, reference, tmp_path):
    other = tmp_path / "other.csv"
    rows = (data["csv"]).read_text().splitlines()
    other.write_text("\n".join(rows[:11]) + "\n")
    out = tmp_path / "exp"
    decode.main(args(data, out, *DSUTA, "--ckpt_every=5", csv_path=other))
    with pytest.raises(SystemExit, match="holds a run with other settings .*stream_sha1"):
        decode.main(args(data, out, *DSUTA, "--ckpt_every=5"))
    (out / "summary.json").unlink()              # as if interrupted after its last checkpoint
    kept = {f: (out / f).read_bytes() for f in ("transcripts.csv", "fingerprint.json")}
    with pytest.raises(SystemExit, match="holds a run with other settings .*stream_sha1"):
        decode.main(args(data, out, *DSUTA, "--ckpt_every=5"))      # not resumed: refused
    assert {f: (out / f).read_bytes() for f in kept} == kept
    (out / "lii.csv").write_text("position,lii,stage\n")
    with pytest.raises(SystemExit, match=r"lii.csv: .* bytes, but the checkpoint at row 10 "
                                         r"recorded \d+ bytes"):
        decode.main(args(data, out, *DSUTA, "--ckpt_every=5", csv_path=other))


def test_a_finished_run_with_damaged_records_is_not_skipped(data, tmp_path):
    """A finished folder whose transcripts.csv was cut short (a copy from a cluster that
    stopped) or whose summary.json is unreadable was skipped as finished by decode and the grid
    (and the summary's traceback); now it is one line, and ``--overwrite`` decodes it again."""
    from tta_brain import grid
    short = tmp_path / "short.csv"
    short.write_text("\n".join(data["csv"].read_text().splitlines()[:7]) + "\n")
    out, run = tmp_path / "exp", args(data, tmp_path / "exp", *DSUTA, csv_path=short)
    decode.main(run)
    good = records(out)
    raw = {name: (out / name).read_bytes() for name in RECORDS}    # (csv's \r\n line ends)
    lines = good["transcripts.csv"].splitlines(keepends=True)
    (out / "transcripts.csv").write_text("".join(lines[:-1]))
    with pytest.raises(SystemExit, match=r"transcripts\.csv: 5 utterances, .* but summary\.json "
                                         r"says 6, .*\(cut short .*; to decode this run "
                                         r"again there, add --overwrite \(it deletes"):
        decode.main(run)
    plan = grid.Run("exp", out, run[:])
    grid.check_done([plan])
    assert plan.status == "failed" and plan.message.endswith(
        "; to decode this run again there, add --decode_opts=--overwrite")
    again = grid.Run("exp", out, run + ["--overwrite"])        # what that says to add: queued
    grid.check_done([again])
    assert again.status == "queued"
    decode.main(run + ["--overwrite"])            # its records removed: decoded again, whole
    assert records(out) == good and "Resuming" not in (out / "log.txt").read_text()
    (out / "transcripts.csv").write_bytes(raw["transcripts.csv"])
    for name, cut, said in (("resets.csv", lambda t: "", r"resets\.csv: empty, without even "
                             r"its header line"),                  # was: finished, 0 resets
                            ("resets.csv", lambda t: t + "3,u003,lii,2\n",   # (it has none)
                             r"resets\.csv: 1 resets at 3, but summary\.json says 0 \("),
                            ("lii.csv", lambda t: t.rsplit("\n", 2)[0] + "\n",
                             r"lii\.csv: \d+ LII values, but summary\.json says \d+")):
        (out / name).write_text(cut(good[name]))
        with pytest.raises(SystemExit, match=said + ".*; to decode this run again there, add "
                                                    "--overwrite"):
            decode.main(run)
        (out / name).write_bytes(raw[name])
    assert summary(out)["resets"] == [] and good["lii.csv"].count("\n") > 2
    before = (out / "summary.json").read_text()
    (out / "summary.json").write_text("{")      # the end of the stream was saved: written again
    decode.main(run)
    assert records(out) == good
    assert {k: v for k, v in json.loads((out / "summary.json").read_text()).items()
            if k not in ("wall_time_s", "time_per_audio_s")} == \
        {k: v for k, v in json.loads(before).items() if k not in ("wall_time_s", "time_per_audio_s")}
    (out / "summary.json").write_text("{")
    shutil.rmtree(out / "save")                 # and without a checkpoint: decoded again
    with pytest.raises(SystemExit, match=r"summary\.json: cannot read .*; to decode this run "
                                         r"again there, add --overwrite"):
        decode.main(run)
    decode.main(run + ["--overwrite"])
    assert records(out) == good
    assert decode.plan(run).status == "done"


def test_an_unreadable_fingerprint_resumes_from_the_checkpoint(data, reference, tmp_path):
    """An interrupted run whose fingerprint.json was cut short was "a run with other settings (no
    fingerprint recorded)", and the only way offered, --overwrite, deleted its checkpoint and
    records. The checkpoint holds the fingerprint too: the run resumes when it matches."""
    out = tmp_path / "exp"
    decode.main(args(data, out, *DSUTA, "--ckpt_every=5"))
    (out / "summary.json").unlink()          # as if stopped after its checkpoint at 20
    fp = out / "fingerprint.json"
    fp.write_text(fp.read_text()[:300])
    assert decode.plan(args(data, out, *DSUTA, "--ckpt_every=5")).status == "resume"
    decode.main(args(data, out, *DSUTA, "--ckpt_every=5"))
    assert records(out) == records(reference) and summary(out) == summary(reference)
    log = (out / "log.txt").read_text()
    assert "Resuming" in log
    assert (f"{fp}: cannot be read (cut short or damaged); its checkpoint's copy of the "
            f"fingerprint is this run's: it resumes there") in log     # was the console's alone
    env_log = (out / "env.log").read_text()     # both starts' environments (one was written over)
    assert env_log.count("tta-brain run") == 2 and env_log.count("resumed: the environment") == 1
    (out / "summary.json").unlink()
    fp.write_text("")          # another run's settings: refused before anything is written
    with pytest.raises(SystemExit, match=r"holds a run with other settings \(hparams\.steps: "
                                         r"2 != 3\)"):
        decode.main(args(data, out, *DSUTA, "--ckpt_every=5", "--steps=3"))
    assert fp.read_text() == ""
    decode.main(args(data, out, *DSUTA, "--ckpt_every=5"))       # its own: resumed
    assert records(out) == records(reference)
    shutil.rmtree(out / "save")
    (out / "summary.json").unlink()
    fp.write_text("")
    with pytest.raises(SystemExit, match=r"fingerprint\.json: cannot be read \(cut short or "
                                         r"damaged\), and no checkpoint tells which run the "
                                         r"folder holds; to decode this run again there, add "
                                         r"--overwrite"):
        decode.main(args(data, out, *DSUTA, "--ckpt_every=5"))


def test_a_checkpoint_cut_short_is_one_line_and_the_records_are_kept(data, reference, tmp_path,
                                                                    monkeypatch):
    """A checkpoint file cut short by hand, a copy or a full disk (a kill cannot: each file is
    written whole, then renamed) stopped the rerun with a traceback (stream.ckpt: torch's zip
    reader, or ``EOFError``; CKPT.yaml and brain.ckpt: SpeechBrain's ``TypeError``). Now each is
    one line naming the file, the records are left as they were, and once the checkpoint is
    whole again the run resumes exactly. A finished run's records line cut in the middle is
    said cut short (it was said to be a record of another tta_brain version)."""
    import shutil
    out = tmp_path / "exp"
    run = args(data, out, *DSUTA, "--ckpt_every=3")
    crash_at(monkeypatch, run, 10)
    ckpt = next((out / "save").glob("CKPT+*"))
    whole = tmp_path / "whole"
    shutil.copytree(ckpt, whole)
    part = lambda: {f: (out / f).read_bytes() for f in RECORDS[:-1]}   # noqa: E731 (no wer.txt)
    kept = part()
    for name, size, said in (("stream.ckpt", 100, "the checkpoint cannot be read (RuntimeError"),
                             ("stream.ckpt", 0, "the checkpoint cannot be read (EOFError"),
                             ("CKPT.yaml", 10, "the checkpoint cannot be read (no key: value"),
                             ("brain.ckpt", 5, "the checkpoint cannot be read (no key: value")):
        os.truncate(ckpt / name, size)
        with pytest.raises(SystemExit) as e:
            decode.main(run)
        line = str(e.value)
        assert line.startswith(f"ERROR: {ckpt / name}: {said}"), line
        assert "\n" not in line and "to start over" in line
        assert part() == kept
        shutil.copy(whole / name, ckpt / name)
    decode.main(run)
    assert records(out) == records(reference)
    text = (out / "transcripts.csv").read_text()
    (out / "transcripts.csv").write_text(text[:-20])           # the last line cut in the middle
    with pytest.raises(SystemExit, match=r"transcripts\.csv:21: \d+ of the header's \d+ "
                                         r"fields, no '\w+' \(the line is cut short\)"):
        decode.main(run)


def test_a_full_disk_during_a_checkpoint_save_resumes_from_the_one_before(data, reference,
                                                                          tmp_path, monkeypatch):
    """A save that fails part way (the disk full from the second save on: here a file size
    limit, EFBIG, under the tiny model's ~230 kB state) stops the run; the checkpoint it was
    writing stays incomplete (its state file is written beside it and renamed), so once there is
    room again the rerun resumes from the complete one before it and gives the uninterrupted
    run's records. The stop is one line naming the run and the file (torch.save said only
    "unexpected pos"; a traceback)."""
    import resource
    from tta_brain.run import checkpoint
    out = tmp_path / "exp"
    run = args(data, out, *DSUTA, "--ckpt_every=3")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    real, calls = checkpoint.save, []

    def save(*a):
        calls.append(1)
        if len(calls) == 2:          # (Python ignores SIGXFSZ: a write past it is an OSError)
            resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, limit[1]))
        real(*a)
    monkeypatch.setattr(checkpoint, "save", save)
    try:
        with pytest.raises(SystemExit) as e:
            decode.main(run)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    saves = sorted((out / "save").glob("CKPT+*"), key=lambda d: d.stat().st_mtime)
    assert str(e.value) == (f"ERROR: {out}: File too large ({saves[-1] / 'stream.ckpt.tmp'}): "
                            f"the run stopped; once there is room, the same command resumes it "
                            f"from its last complete checkpoint")
    monkeypatch.setattr(checkpoint, "save", real)
    assert len(saves) == 2 and not (saves[-1] / "stream.ckpt").exists()   # the one being written
    assert not (out / "summary.json").exists()
    decode.main(run)
    assert "Resuming" in (out / "log.txt").read_text()
    assert records(out) == records(reference) and summary(out) == summary(reference)


def test_same_seed_same_transcripts_awmc_with_dropout(data, tmp_path):
    """AWMC adapts in train mode (dropout on): the seed decides the dropout masks."""
    common = ["--steps=2", "--lr=0.05", "--ckpt_every=0", "--train_mode=true"]
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        decode.main(args(data, tmp_path / name, *common, f"--seed={seed}", method="awmc"))
        runs[name] = records(tmp_path / name)["transcripts.csv"]
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"], "dropout had no effect: the test would prove nothing"
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["seed"] == 3 and s["method"] == "awmc"
    assert {"torch", "transformers", "speechbrain", "python", "tta_brain", "cma"} <= set(s["versions"])
    log = (tmp_path / "a" / "log.txt").read_text()
    env = (tmp_path / "a" / "env.log").read_text()
    assert "Seed: 3" in log and f'"torch": "{torch.__version__}"' in log
    assert "Seed: 3" in env and f"torch: {torch.__version__}" in env
    # SpeechBrain's environment description heads every env.log, asked once per process
    assert env.startswith("SpeechBrain system description") and "speechbrain==" in env
    assert (tmp_path / "b" / "env.log").read_text().split("tta-brain run")[0] == \
        env.split("tta-brain run")[0]


def test_env_log_gives_the_git_revision_of_now(tmp_path, monkeypatch):
    """The freeze is asked once a process, the working directory's git revision each time: a
    notebook that committed or changed directory between runs wrote the first revision into
    every later env.log."""
    from tta_brain.run import envinfo
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(git[:5] + ["init", "-q", str(repo)], check=True)
    commits = []
    for i in range(2):
        (repo / "f").write_text(str(i))
        subprocess.run(git + ["add", "f"], check=True)
        subprocess.run(git + ["commit", "-qm", str(i)], check=True)
        commits.append(subprocess.run(git + ["rev-parse", "--short", "HEAD"], check=True,
                                      capture_output=True, text=True).stdout.strip())
        monkeypatch.chdir(repo)
        assert f"Git revision:\n{commits[-1]}\n" in envinfo.installed_packages()
    monkeypatch.chdir(tmp_path)                         # no repository here
    text = envinfo.installed_packages()
    assert "Could not get git revision" in text and "Git revision:" not in text
    assert "Installed Python packages:" in text and text.endswith(
        envinfo._environment_description().split("==============================\n")[-1])
    monkeypatch.setattr(envinfo, "_INSTALLED", text)   # SpeechBrain first asked outside a repository
    monkeypatch.chdir(repo)
    assert f"Git revision:\n{commits[-1]}\n" in envinfo.installed_packages()


def test_non_finite_loss_skips_the_step_and_is_logged(data, tmp_path, monkeypatch):
    """A NaN loss on one utterance: its steps are skipped (logged with the utterance ID and
    counted), the parameters stay finite and the rest of the stream is decoded."""
    from tta_brain.methods.dsuta import DSUTA as cls
    orig = cls.loss
    seen = {}

    def loss(self, logits):
        seen["method"] = self
        value = orig(self, logits)
        return value * float("nan") if self.t == 3 else value
    monkeypatch.setattr(cls, "loss", loss)
    out = tmp_path / "exp"
    s = decode.main(args(data, out, *DSUTA, "--ckpt_every=0"))
    assert s.n_utts == 20 and s.counts["skipped_steps"] == 2
    log = (out / "log.txt").read_text()
    assert "u003 (position 3): 2 adaptation step(s) skipped (non-finite loss nan)" in log
    m = seen["method"]
    assert all(torch.isfinite(p).all() for p in m.params + m.meta)


@pytest.mark.slow
def test_kernel_caches_are_bounded_unless_the_user_sets_them(data, tmp_path):
    """A run bounds oneDNN's and ideep's shape-keyed caches (a long stream of new lengths would
    fill them: tools/bench_memory.py), says so in env.log, keeps a value the user set, and the
    bound changes no transcript."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    base |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name, extra in (("bounded", {}), ("user", {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024",
                                                  "LRU_CACHE_CAPACITY": "1024"})):
        res = subprocess.run([sys.executable, "-m", "tta_brain.decode",
                              *args(data, tmp_path / name, "--steps=1", "--ckpt_every=0",
                                    method="suta")],
                             env=base | extra, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
    env = {n: (tmp_path / n / "env.log").read_text() for n in ("bounded", "user")}
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY: 64\n" in env["bounded"]
    assert "LRU_CACHE_CAPACITY: 64\n" in env["bounded"]
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY: 1024\n" in env["user"]
    assert "LRU_CACHE_CAPACITY: 1024\n" in env["user"]
    assert records(tmp_path / "bounded") == records(tmp_path / "user")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_freed_memory_returns_freed_heap_pages():
    """The pages of freed heap blocks that glibc keeps (a block still in use above them: the heap
    cannot shrink from its top) go back to the OS: the process's RSS falls by about their size
    (TRIM_EVERY utterances in a long stream; tools/bench_memory.py)."""
    import ctypes
    from tta_brain.lobes.runtime import release_freed_memory
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    blocks = [libc.malloc(4096) for _ in range(10000)]       # 40 MB below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    top = libc.malloc(64)
    for b in blocks:
        libc.free(b)
    try:
        before = rss()
        release_freed_memory()
        assert before - rss() > 20e6
    finally:
        libc.free(top)


def test_a_finished_run_leaves_nothing_alive_in_the_process(data, tmp_path):
    """A grid job's runs one after another, a sweep's fallback: after ``decode.main`` returns,
    the run's model is gone without waiting for Python's cyclic collector (the method and its
    step refer to each other, so a finished run's model stayed until a collection happened to
    run; on an H200 the GPU check's memory section began at 9.2 GB allocated after 16 decodes in
    its process, against 0.6 GB in a fresh one)."""
    import gc
    from tta_brain.lobes.hf_ctc import HFCTCLobe

    def lobes():
        return sum(isinstance(o, HFCTCLobe) for o in gc.get_objects())
    gc.collect()
    before = lobes()
    was = gc.isenabled()
    gc.disable()                          # only what decode itself frees counts
    try:
        decode.main(args(data, tmp_path / "a", *DSUTA))
        left = lobes()
    finally:
        if was:
            gc.enable()
    assert left == before


def test_every_save_of_every_run_in_a_process_weighs_recency_alone(data, tmp_path,
                                                                     monkeypatch):
    """Every checkpoint save deletes the older one by recency alone, in every run of a process
    (SpeechBrain 1.1.2's save_and_keep_only appends its recency key to a default list shared by
    all calls: each save then listed the folder twice per earlier save of the process, so a
    sweep's 20th tiny run took 4.6 s against 2.1 s for its 2nd, and a stream saved every
    utterance grew quadratically)."""
    from speechbrain.utils.checkpoints import Checkpointer
    keys, delete = [], Checkpointer.delete_checkpoints

    def counted(self, **kwargs):
        keys.append(len(kwargs["importance_keys"]))
        return delete(self, **kwargs)
    monkeypatch.setattr(Checkpointer, "delete_checkpoints", counted)
    for run in ("a", "b"):
        decode.main(args(data, tmp_path / run, "--steps=1", "--ckpt_every=3", method="suta"))
    assert len(keys) >= 14 and set(keys) == {1}, keys
    assert len(list((tmp_path / "b" / "save").glob("CKPT+*"))) == 1


def test_what_is_logged_after_a_run_stays_out_of_its_log(data, tmp_path):
    """A notebook runs decode.main, then logs its own lines or runs a command that fails before
    it has a folder: those went into the finished run's log.txt (SpeechBrain's file handler
    stayed on the root logger)."""
    import logging
    out = tmp_path / "a"
    decode.main(args(data, out, "--steps=1", "--ckpt_every=0", method="suta"))
    logging.getLogger("my_notebook").warning("a line of the caller's own")
    with pytest.raises(SystemExit, match="source model directory not found"):
        decode.main(args(data, tmp_path / "b", method="suta") + [f"--source={tmp_path / 'none'}"])
    log = (out / "log.txt").read_text()
    assert "a line of the caller's own" not in log
    assert log.count("Setting seed to") == 1, log
    assert not [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def test_a_crash_is_in_the_runs_log_once(data, tmp_path):
    """The run's log.txt handler leaves the root logger when decode.main ends; a crash's
    traceback, which SpeechBrain's excepthook logged there after main had returned, is written
    there by main itself (once: the excepthook's copy goes to the console only)."""
    out = tmp_path / "a"
    code = ("import sys\n"
            "from tta_brain import decode\n"
            "from tta_brain.run.brain import TTABrain\n"
            "def boom(self, batch, stage=None):\n"
            "    raise RuntimeError('simulated crash')\n"
            "TTABrain.evaluate_batch = boom\n"
            "decode.main(sys.argv[1:])\n")
    res = subprocess.run([sys.executable, "-c", code, *args(data, out, "--steps=1", method="suta")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "RuntimeError: simulated crash" in res.stdout + res.stderr
    log = (out / "log.txt").read_text()
    assert log.count("RuntimeError: simulated crash") == 1, log
    assert "Traceback" in log and "in boom" in log


def test_a_run_resumed_with_another_thread_count_says_so(data, reference, tmp_path, monkeypatch):
    """The thread count (and the libraries' versions) is no part of the fingerprint, yet a CPU
    reduction over other threads rounds differently (measured: LII values differ in the 7th
    digit between 1 and 2 threads): a run resumed under another one said nothing, its records a
    mix that no uninterrupted run gives. The count is logged, and such a resume is a warning."""
    out = tmp_path / "exp"
    run = args(data, out, *DSUTA, "--ckpt_every=4")
    threads = torch.get_num_threads()
    crash_at(monkeypatch, run, 10)
    assert f"CPU threads: {threads}" in (out / "log.txt").read_text()
    torch.set_num_threads(threads + 1)
    try:
        decode.main(run)
    finally:
        torch.set_num_threads(threads)
    warnings = json.loads((out / "summary.json").read_text())["warnings"]
    assert any(f"threads: {threads} -> {threads + 1}" in w for w in warnings), warnings
    assert f"CPU threads: {threads + 1}" in (out / "env.log").read_text()
    # the same thread count on resume: nothing said
    again = tmp_path / "again"
    run = args(data, again, *DSUTA, "--ckpt_every=4")
    crash_at(monkeypatch, run, 10)
    decode.main(run)
    assert json.loads((again / "summary.json").read_text())["warnings"] == \
        json.loads((reference / "summary.json").read_text())["warnings"]
    assert records(again) == records(reference)


def test_a_sweeps_run_resumed_by_decode_is_said_so():
    """A batched sweep's passes round otherwise than one run's (LII values 1e-7 apart), and a
    sweep and a decode resume each other's folders: the run's numerics say which made its rows,
    so a mix is a resume warning like another thread count."""
    from types import SimpleNamespace
    from tta_brain.run.checkpoint import StreamState
    from tta_brain.run.envinfo import numerics_changes
    batched = StreamState(SimpleNamespace(batch=object())).numerics[-1]
    alone = StreamState(SimpleNamespace()).numerics[-1]
    assert batched["batched"] is True and "batched" not in alone
    assert numerics_changes(batched, alone) == ["batched: True -> None"]
