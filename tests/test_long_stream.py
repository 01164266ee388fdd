"""Long streams (issue #21): the collapse figures, the memory record along a run, the grid's
progress line with per-run ETA, the long split's held-out speech and the long report (the
synthetic recipe's collapse-and-recovery regression runs in tests/test_synthetic_recipe.py, on
that test's data)."""
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from fake_corpora import write_stream
from tta_brain import decode, grid
from tta_brain.data.prep.synthetic_text import held_out_sentences, make_sentence_sets
from tta_brain.data.streams import md_long, recurrence
from tta_brain.report.long import (first_above, memory_slope, windowed_wer, worst_window,
                                   write_long_report)
from tta_brain.report.results import collect_runs
from tta_brain.run import brain, records

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------- pure collapse figures
def test_windowed_wer_uses_full_windows_only():
    err, words = [1, 0, 2, 3, 0], [2, 2, 2, 2, 0]
    curve = windowed_wer(err, words, window=2)
    assert math.isnan(curve[0])                       # no full window yet
    assert curve[1:4].tolist() == [25.0, 50.0, 125.0]
    assert curve[4] == 150.0                          # 3 errors / 2 words (the last has none)
    assert np.isnan(windowed_wer([0], [0], 1)).all()  # no reference words: undefined


def test_long_report_refuses_an_empty_window(tmp_path, capsys):
    from tta_brain.report import long
    num = "a finite number >= 0"
    for opt, value, why in (("--window", "0", ">= 1 (utterances)"), ("--flat_mib", "-1.0", num),
                            ("--flat_mib", "nan", num), ("--margin", "nan", num),
                            ("--margin", "-2.0", num),     # nan, -2 were taken
                            ("--margin", "inf", num), ("--flat_mib", "inf", num)):
        with pytest.raises(SystemExit):                 # a 0-utterance window reported nonsense
            long.main(["--exp_dir", str(tmp_path), opt, value])
        err = capsys.readouterr().err
        assert f"{opt} {value}: must be" in err and why in err


def test_worst_window_and_first_position_above_the_source():
    curve = np.array([np.nan, 40.0, 60.0, 90.0, 70.0])
    source = np.array([np.nan, 50.0, 50.0, 80.0, 60.0])
    assert worst_window(curve) == (90.0, 3)
    assert worst_window([np.nan, np.nan]) == (None, None)
    assert worst_window([np.nan, 50.0, 100.0, 100.0]) == (100.0, 2)   # a plateau: where reached
    assert first_above(curve, source, margin=5) == 2          # 60 > 50 + 5
    assert first_above(curve, source, margin=10) is None      # never more than 10 above
    assert first_above(curve, source[:2], margin=0) is None   # past the shorter curve: not compared
    assert first_above([np.nan, 99.0], [np.nan, np.nan], 0) is None


def test_a_run_is_compared_with_the_source_run_of_its_own_seed_and_stream_file():
    """The collapse figures compare a run with the source run of its stream: of its own seed
    where there is one (a seed's stream order, its skips), of its stream file where the
    fingerprints say (a folder of an older version records none: taken), never another file's
    (two SNRs' folders hold streams of one name)."""
    from types import SimpleNamespace
    from tta_brain.report.long import _source_for

    def run(method, seed, sha):
        fp = {"stream_sha1": sha} if sha else {}
        return SimpleNamespace(stream="md_long", method=method, seed=seed, source_model=None,
                               summary=SimpleNamespace(fingerprint=fp))
    src0, src1, old, other = (run("source", 0, "a"), run("source", 1, "a"), run("source", 2, None),
                              run("source", 3, "b"))
    runs = [src0, src1, old, other]
    assert _source_for(run("suta", 1, "a"), runs) is src1
    assert _source_for(run("suta", 2, "a"), runs) is old
    assert _source_for(run("suta", 3, "a"), runs) is src0           # no seed 3 of file a
    assert _source_for(run("suta", 3, "b"), runs) is other


def test_memory_slope_per_thousand_utterances_over_the_second_half():
    pos = np.arange(0, 3000, 50)
    flat = 500 + 0.3 * np.sin(pos)                            # noise, no trend
    growing = 500 + np.where(pos < 1500, 0.0, 0.01 * (pos - 1500))   # +10 MiB per 1k, late
    warmup = 400 + np.minimum(pos, 200) * 0.5                 # grows at first, then flat
    assert abs(memory_slope(pos, flat)) < 0.5
    assert memory_slope(pos, growing) == pytest.approx(10.0, rel=1e-6)
    assert abs(memory_slope(pos, warmup)) < 1e-9
    assert memory_slope(pos[:9], flat[:9]) is None                # too few samples to tell


# ------------------------------------------------------------------------- grid progress and ETA
def test_rate_counts_working_time_only_and_durations_read_well():
    seen, rate = grid.rate_since(None, 0, now=100.0)           # queued / loading: no rate
    assert rate is None and seen == (0, 100.0, 0)
    seen, rate = grid.rate_since(seen, 0, now=160.0)           # still nothing: baseline moves
    assert rate is None and seen == (0, 160.0, 0)
    seen, rate = grid.rate_since(seen, 50, now=170.0)
    assert seen == (0, 160.0, 50) and rate == 5.0
    seen, rate = grid.rate_since(seen, 40, now=180.0)          # resumed: records cut back
    assert rate is None and seen == (40, 180.0, 40)
    seen, rate = grid.rate_since(seen, 60, now=190.0)
    assert rate == 2.0
    assert [grid.fmt_duration(s) for s in (None, 42, 600, 3725)] == ["?", "42s", "10m", "1h02"]
    # the unit changes at the minute and the hour; a duration is rounded, not cut
    assert [grid.fmt_duration(s) for s in (59.6, 60, 3599.6, 3600)] == ["1m", "1m", "1h00", "1h00"]


def _rows(folder, n, rejects=0):
    folder.mkdir(parents=True, exist_ok=True)
    w = records.RecordWriter(folder)
    for i in range(n):
        w.transcript(records.Transcript(i, f"u{i}", "AC", 0, 1.0, "a b", "a", 2, 1, 0, 1, 0))
    for i in range(rejects):
        w.reject(records.Reject(n + i, f"r{i}", "x.wav", "too long"))
    w.close()


def test_progress_line_says_how_far_each_long_run_is(tmp_path):
    runs = [grid.Run(f"md_long/m{i}/seed0", tmp_path / f"m{i}", [], total=3000) for i in range(3)]
    runs[0].status, runs[1].status = "running", "running"
    _rows(runs[0].folder, 100)
    _rows(runs[1].folder, 10, rejects=2)
    grid._progress(runs, now=0.0)                              # first look: the baselines
    _rows(runs[0].folder, 400)
    _rows(runs[1].folder, 112)
    line = grid._progress(runs, now=100.0)
    head, per_run, total = line.split(" | ")
    assert head == "grid: 0 done, 2 running, 0 failed, 1 queued (3 runs, 0 already finished)"
    # m0: 300 rows in 100 s -> 2600 left at 3/s = 14m; m1: 100 rows -> 2888 left at 1/s = 48m
    assert per_run == "md_long/m0/seed0 400/3000 14m left, md_long/m1/seed0 112/3000 48m left"
    assert total == "grid ETA 35m"        # (2600 + 2888 + 3000) rows at 4 rows/s: 2122 s
    assert "\n" not in line
    short = [grid.Run("md_hard/suta/seed0", tmp_path / "s", [], status="running", total=400)]
    assert grid._progress(short, now=5.0) == grid._progress(short)   # short runs: as before
    # a Slurm job not started yet is counted pending, not running, and its rows are all left
    pending = grid._progress(runs, now=200.0, pending={"md_long/m1/seed0"})
    head, per_run, total = pending.split(" | ")
    assert head == ("grid: 0 done, 1 running, 1 pending on Slurm, 0 failed, 1 queued (3 runs, 0 "
                    "already finished)")
    assert per_run.startswith("md_long/m0/seed0 400/3000") and "m1" not in per_run
    # ... but its rows are left: (2600 + 3000 + 3000) rows at m0's 300 rows in 200 s: 5733 s
    assert total == "grid ETA 1h35"
    # a run that ended since squeue was asked (its name still pending) is counted as it is
    runs[2].status = "done"
    head = grid._progress(runs, now=200.0, pending={"md_long/m1/seed0", "md_long/m2/seed0"})
    assert head.split(" | ")[0] == ("grid: 1 done, 1 running, 1 pending on Slurm, 0 failed, 0 "
                                    "queued (3 runs, 0 already finished)")
    # a run of LONG_RUN rows is long (the README: "1,000 rows or more")
    edge = [grid.Run("md_long/e/seed0", tmp_path / "e", [], status="running", total=grid.LONG_RUN)]
    assert grid._progress(edge, now=5.0).endswith(
        f" | md_long/e/seed0 0/{grid.LONG_RUN} ? left | grid ETA ?")


# ------------------------------------------------------------------------- the memory record
def test_memory_records_resume_and_old_checkpoints_start_them_anew(tmp_path):
    w = records.RecordWriter(tmp_path)
    w.memory(records.Memory.sample(49))
    offsets = w.sync()
    w.memory(records.Memory.sample(99))                        # after the checkpoint
    w.close()
    assert [m.position for m in records.read_memory(tmp_path)] == [49, 99]
    records.RecordWriter(tmp_path, offsets, cursor=50).close()   # a resume cuts it back
    kept = records.read_memory(tmp_path)
    assert [m.position for m in kept] == [49] and kept[0].rss_mb > 10 and kept[0].cuda_mb == 0
    del offsets["memory"]                                      # a checkpoint from before memory.csv
    w = records.RecordWriter(tmp_path, offsets, cursor=50)
    w.memory(records.Memory.sample(149))
    w.close()
    assert [m.position for m in records.read_memory(tmp_path)] == [149]
    (tmp_path / "memory.csv").unlink()          # a run from before memory.csv: no file at all
    records.RecordWriter(tmp_path, offsets, cursor=50).close()
    assert (tmp_path / "memory.csv").is_file() and records.read_memory(tmp_path) == []
    assert records.read_memory(tmp_path / "nothing") == []


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux /proc only")
def test_a_memory_sample_is_the_processs_resident_set_in_mib():
    """rss_mb is the kernel's VmRSS (kB) in MiB, as the report and the README read it."""
    def vmrss_kb():
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    before = vmrss_kb()
    rss = records.Memory.sample(0).rss_mb
    after = vmrss_kb()
    assert min(before, after) / 1024 - 0.5 <= rss <= max(before, after) / 1024 + 0.5


@pytest.fixture(scope="module")
def decoded(tmp_path_factory, tiny_model_dir):
    """source and dsuta on a 20-utterance stream, memory sampled every 5 utterances."""
    root = write_stream(tmp_path_factory.mktemp("stream"))
    exp = tmp_path_factory.mktemp("exp")
    old, brain.MEMORY_EVERY = brain.MEMORY_EVERY, 5
    try:
        for method, extra in (("source", []), ("dsuta", ["--steps=2", "--lr=0.05",
                                                          "--buffer_size=2"])):
            decode.main([method, f"--source={tiny_model_dir}",
                         f"--stream_csv={root / 'stream.csv'}",
                         f"--output_folder={exp / 'md_long' / method / 'seed0'}",
                         f"--data_root={root}", "--noprogressbar", "--stream_name=md_long",
                         "--ckpt_every=7", *extra])
    finally:
        brain.MEMORY_EVERY = old
    return exp


def test_a_run_samples_its_memory_along_the_stream(decoded):
    mem = records.read_memory(decoded / "md_long" / "dsuta" / "seed0")
    assert [m.position for m in mem] == [4, 9, 14, 19]
    assert all(m.rss_mb > 10 for m in mem)
    assert records.rows_done(decoded / "md_long" / "dsuta" / "seed0") == 20


def test_long_report_table_plot_and_memory_verdict(decoded, capsys):
    runs = collect_runs(decoded)
    assert {r.method for r in runs} == {"source", "dsuta"} and all(r.memory for r in runs)
    out = write_long_report(runs, decoded, "md_long", window=5, margin=0.0)
    text = out.read_text()
    assert ("|method|seed|utts|WER %|worst 5-utt window (ends at)|first position > source + 0|"
            in text)
    assert "Windowed WER: errors / words over the last 5 utterances (full windows only)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("|dsuta|"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "20" and "@" in cells[4]
    assert cells[5] == "never" or 4 <= int(cells[5]) < 20
    from tta_brain.report.long import _resets, gap_to, run_curve
    dsuta, source = (next(r for r in runs if r.method == m) for m in ("dsuta", "source"))
    diff = run_curve(dsuta, 5)[4:] - run_curve(source, 5)[4:]       # the 16 full windows
    assert len(diff) == 16 and np.isfinite(diff).all()
    assert cells[6] == f"{round(float(diff.max()), 1) + 0.0:+.1f}"
    assert cells[7] == f"{100.0 * (diff < 0).sum() / 16:.1f} %"
    assert cells[8] == _resets(dsuta.resets)
    assert [c.strip() for c in next(ln for ln in text.splitlines() if ln.startswith(
        "|source|")).strip("|").split("|")][5:9] == ["-", "-", "-", "0"]
    assert gap_to([np.nan, 1.0, 5.0, 2.0], [np.nan, 2.0, 3.0, 2.0, 9.0]) == (2.0, pytest.approx(100 / 3))
    assert gap_to([np.nan], [1.0]) == (None, None)
    assert _resets([]) == "0" and _resets([3, 7]) == "2 (3, 7)"
    assert _resets(list(range(8))) == "8 (0, 1, 2, 3, 4, 5, 6, 7)"      # all shown: no "..."
    assert _resets(list(range(10, 110, 10))) == "10 (10, 20, 30, 40, 50, 60, 70, 80, ...)"
    assert "Memory not judged (fewer than 10 samples" in text
    short = write_long_report(runs, decoded, "md_long", out=decoded / "SHORT.md", window=50,
                              plots=False)
    row = next(ln for ln in short.read_text().splitlines() if ln.startswith("|dsuta|"))
    cells = [c.strip() for c in row.strip("|").split("|")]      # 20 utterances, no window of 50:
    assert cells[4:6] == ["-", "no full 50-utt window"]          # was "never" (nothing compared)
    assert (decoded / "plots" / "long_md_long.png").stat().st_size > 10000
    with pytest.raises(ValueError, match=r"no finished run of stream 'md_hard' under .* "
                       r"\(streams there: md_long; --stream\)"):
        write_long_report(runs, decoded, "md_hard")
    from tta_brain.report import long
    folder = decoded / "plots"                    # --out naming a folder was a traceback
    assert long.main(["--exp_dir", str(decoded), "--out", str(folder), "--no_plots"]) == 1
    assert f"ERROR: cannot write {folder}: is a folder (--out names the LONG.md file) (--out)" \
        in capsys.readouterr().err
    # some methods (the source, the reference, always): the committed figure's command
    some = decoded / "some"
    assert long.main(["--exp_dir", str(decoded), "--methods", "source", "--out",
                      str(some / "LONG.md"), "--plots_dir", str(some / "plots")]) == 0
    rows = [ln.split("|")[1] for ln in (some / "LONG.md").read_text().splitlines()
            if ln.startswith("|") and not ln.startswith(("|method", "|-", "|:"))]
    assert rows == ["source"] and (some / "plots" / "long_md_long.png").is_file()
    assert long.main(["--exp_dir", str(decoded), "--methods", "dsuta suta", "--no_plots"]) == 1
    assert "ERROR: --methods: no run of suta on stream 'md_long' (its methods: dsuta, source)" \
        in capsys.readouterr().err


def test_long_report_tells_runs_apart_and_keeps_its_warnings(decoded, tiny_model_dir, tmp_path):
    """A method run with two step counts gets RESULTS.md's labels (``dsuta (N=1)``) in the table
    and as two curves, each row names its folder, and runs pooled though they are not seeds of
    one experiment (here a copy of the source run) are warned about in LONG.md itself, not only
    on stderr (the rows read as two identical "dsuta, seed 0" and the plot averaged N=1 with
    N=2), and so are each run's own warnings (here the N=1 run diverged: steps skipped, empty
    hypotheses; LONG.md showed its row like any other)."""
    import shutil
    from tta_brain.report.long import _mean_curves
    exp = tmp_path / "exp"
    shutil.copytree(decoded, exp)
    shutil.copytree(exp / "md_long" / "source", exp / "copy" / "source")
    data = write_stream(tmp_path / "stream")       # the fixture's stream, written again
    decode.main(["dsuta", f"--source={tiny_model_dir}", f"--stream_csv={data / 'stream.csv'}",
                 f"--output_folder={exp / 'md_long' / 'dsuta_n1' / 'seed0'}",
                 f"--data_root={data}", "--noprogressbar", "--stream_name=md_long",
                 "--steps=1", "--lr=1e30", "--buffer_size=2"])
    runs = collect_runs(exp)
    text = write_long_report(runs, exp, "md_long", window=5).read_text()
    assert (exp / "plots" / "long_md_long.png").stat().st_size > 10000
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines()
            if ln.startswith("|dsuta")]
    assert sorted((r[0], r[-1]) for r in rows) == [
        ("dsuta (N=1)", "md_long/dsuta_n1/seed0"), ("dsuta (N=2)", "md_long/dsuta/seed0")]
    assert sorted(_mean_curves([r for r in runs if r.method == "dsuta"], 5)) == \
        ["dsuta (N=1)", "dsuta (N=2)"]
    warned = text.split("## Warnings", 1)[1]
    assert "source on md_long: seed 0 more than once" in warned
    assert "- md_long/dsuta_n1/seed0: 20 of 20 hypotheses are empty" in warned
    assert "adaptation step(s) skipped for a non-finite loss" in warned
    assert "- md_long/dsuta/seed0:" not in warned
    # two SNRs' folders hold streams of one name: the collapse compares with the same file's
    from tta_brain.report.long import _source_for
    other, own = (next(r for r in runs if r.name == f"{d}/source/seed0")
                  for d in ("copy", "md_long"))
    other.summary.fingerprint["stream_sha1"] = "another stream file"
    dsuta = next(r for r in runs if r.name == "md_long/dsuta/seed0")
    assert _source_for(dsuta, runs) is own
    # and of the same source model: a source run of another model in the folder is not its own
    other.summary.fingerprint["stream_sha1"] = own.summary.fingerprint["stream_sha1"]
    assert _source_for(dsuta, [other, own]) is other           # (the first of the same model)
    other.summary.fingerprint["hparams"]["source"] = "sha1:another model"
    assert _source_for(dsuta, [other, own]) is own
    assert _source_for(dsuta, [other]) is None


def test_memory_verdict_covers_cuda_memory_on_a_gpu(decoded):
    from tta_brain.report.long import table_long
    runs = collect_runs(decoded)
    pos = range(49, 3000, 50)
    runs[0].memory = [records.Memory(p, 800.0, 0.0) for p in pos]            # CPU, flat
    runs[1].memory = [records.Memory(p, 800.0, 100 + 0.02 * p) for p in pos]  # CUDA grows
    table, not_flat, unknown = table_long(runs, "md_long", window=5)
    assert not_flat == [runs[1].name] and unknown == []
    assert "+0.0 (CUDA +20.0)" in table



def test_long_report_defaults_are_the_documented_ones(decoded, tmp_path):
    """The docs' defaults: windows of 100 utterances, a margin of 5 points, memory flat up to
    5 MiB per 1,000 utterances (mutation audit)."""
    from tta_brain.report.long import table_long
    runs = collect_runs(decoded)
    text = write_long_report(runs, decoded, "md_long", out=tmp_path / "L.md",
                             plots=False).read_text()
    assert "|worst 100-utt window (ends at)|first position > source + 5|" in text
    assert "over the last 100 utterances" in text and "by more than 5 points" in text
    pos = range(49, 3000, 50)
    runs[0].memory = [records.Memory(p, 800.0 + 0.004 * p, 0.0) for p in pos]    # +4 MiB per 1k
    runs[1].memory = [records.Memory(p, 800.0 + 0.006 * p, 0.0) for p in pos]    # +6 MiB per 1k
    table, not_flat, unknown = table_long(runs, "md_long")
    assert (not_flat, unknown) == ([runs[1].name], []) and "|800 -> 818|+6.0|" in table


def test_collapse_figures_compare_over_the_utterances_both_scored(decoded):
    """A run that scored every utterance as the source did but skipped one: compared with the
    source over the utterances both scored, it is never above or below it (its windows lack the
    skipped utterance's errors; the source's, counted, held them) (mutation audit)."""
    import dataclasses
    from tta_brain.report.long import collapse_figures
    runs = collect_runs(decoded)
    source, dsuta = (next(r for r in runs if r.method == m) for m in ("source", "dsuta"))
    hard = max(source.transcripts[5:15], key=lambda t: t.n_err / t.n_words)
    assert hard.n_err / hard.n_words > source.summary.n_err / source.summary.n_words
    alike = dataclasses.replace(dsuta, transcripts=[t for t in source.transcripts
                                                    if t.position != hard.position])
    f = collapse_figures(alike, source, window=5, margin=0.0)
    assert f["compared"] and (f["gap"], f["below"], f["first_above"]) == (0.0, 0.0, None)


def test_first_position_above_the_source_follows_the_margin(decoded):
    """Just under the largest gap to the source, a run is above source + margin somewhere; just
    over it, never (mutation audit: the margin given was not the one compared)."""
    from tta_brain.report.long import _signed, table_long
    runs = collect_runs(decoded)

    def cells(margin):
        table = table_long(runs, "md_long", window=5, margin=margin)[0]
        return next(ln.strip("|").split("|") for ln in table.splitlines()
                    if ln.startswith("|dsuta|"))
    gap = float(cells(0.0)[6])
    assert cells(gap - 0.2)[5].isdigit() and cells(gap + 0.2)[5] == "never"
    assert _signed(-0.04) == "+0.0" and _signed(-0.06) == "-0.1"


def test_memory_is_judged_from_ten_samples_on():
    """The docs: judged from 10 samples (500 utterances) on; 10 samples were taken as too few
    only if the check were ``<=`` (mutation audit)."""
    pos = np.arange(49, 500, 50)                                      # 10 samples
    assert len(pos) == 10
    assert memory_slope(pos, 300 + 0.02 * pos) == pytest.approx(20.0)  # +20 MiB per 1k
    assert memory_slope(pos[:-1], 300 + 0.02 * pos[:-1]) is None


def test_memory_verdict_with_some_runs_unjudged_says_no_flat_for_all(decoded, tmp_path):
    """One run flat over 60 samples, the other with 4 samples (fewer than 10): LONG.md says
    which is unjudged and does not call memory flat in every run; both judged flat: it does."""
    runs = collect_runs(decoded)
    source, dsuta = (next(r for r in runs if r.method == m) for m in ("source", "dsuta"))
    assert len(dsuta.memory) == 4
    source.memory = [records.Memory(p, 800.0, 0.0) for p in range(49, 3000, 50)]
    text = write_long_report(runs, decoded, "md_long", out=tmp_path / "L.md", window=5,
                             plots=False).read_text()
    assert "Memory: flat in every run" not in text and "**Memory grows**" not in text
    assert ("Memory not judged (fewer than 10 samples in memory.csv): md_long/dsuta/seed0 "
            "(4 samples).") in text
    dsuta.memory = list(source.memory)
    text = write_long_report(runs, decoded, "md_long", out=tmp_path / "L.md", window=5,
                             plots=False).read_text()
    assert "Memory: flat in every run (" in text and "not judged" not in text


def test_methods_keeps_the_source_run_for_the_comparison(decoded, tmp_path):
    """``--methods dsuta``: the source run, the reference, stays (its row and the dsuta row's
    comparison with it); it was dropped only by a mutant (mutation audit)."""
    from tta_brain.report import long
    out = tmp_path / "LONG.md"
    assert long.main(["--exp_dir", str(decoded), "--methods", "dsuta", "--window", "5",
                      "--out", str(out), "--no_plots"]) == 0
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.read_text().splitlines()
            if ln.startswith("|") and not ln.startswith(("|method", "|-", "|:"))]
    assert [r[0] for r in rows] == ["source", "dsuta"]
    assert rows[1][5] not in ("no source run", "-") and rows[1][6] != "-"


def test_header_and_mean_curves_of_runs_of_other_lengths(decoded, tmp_path):
    """A seed that skipped the stream's last utterance (and made one more error on each of the
    others): the header counts the longest run's utterances and the stream's runs only (not
    another stream's in the same list); the mean curve of a method is the mean of its seeds'
    windowed WERs, cut to the shortest (not the first seed's curve: mutation audit)."""
    import dataclasses
    from tta_brain.report.long import _mean_curves
    runs = collect_runs(decoded)
    dsuta = next(r for r in runs if r.method == "dsuta")
    short = dataclasses.replace(dsuta, transcripts=[dataclasses.replace(t, n_err=t.n_err + 1)
                                                    for t in dsuta.transcripts[:-1]],
                                name="md_long/dsuta/seed1")
    short.summary = dataclasses.replace(dsuta.summary, seed=1)
    other = dataclasses.replace(dsuta, transcripts=dsuta.transcripts[:5])
    other.summary = dataclasses.replace(dsuta.summary, stream="md_other")
    every = runs + [short, other]
    text = write_long_report(every, decoded, "md_long", out=tmp_path / "L.md", window=5,
                             plots=False).read_text()
    assert text.splitlines()[0] == "# md_long: 20 utterances, 3 runs"
    curves = _mean_curves([dsuta, short], 5)
    curve, group = curves["dsuta"]
    assert list(curves) == ["dsuta"] and len(group) == 2 and len(curve) == 19

    def windowed(ts, w=5):          # by hand: errors / words of the w utterances ending at t
        out = []
        for t in range(len(ts)):
            if t < w - 1:
                out.append(np.nan)
                continue
            win = ts[t - w + 1:t + 1]
            out.append(100.0 * sum(x.n_err for x in win) / sum(x.n_words for x in win))
        return np.array(out)
    want = (windowed(dsuta.transcripts)[:19] + windowed(short.transcripts)) / 2
    np.testing.assert_allclose(curve, want, equal_nan=True)


# ------------------------------------------------------------------------- the long split
def test_held_out_sentences_are_new_and_the_quick_start_sets_unchanged():
    train, test = make_sentence_sets(300, 30, seed=1)
    extra = held_out_sentences(60, seed=1, n_train=300, n_test=30)
    assert len(set(extra)) == 60 and not set(extra) & (set(train) | set(test))
    assert held_out_sentences(20, 1, 300, 30) == extra[:20]   # more utterances: a superset
    again_train, again_test = make_sentence_sets(300, 30, seed=1)
    assert (again_train, again_test) == (train, test)
    # the recipe's sizes (3 candidates per utterance), where the grammar repeats itself
    train, test = make_sentence_sets(30000, 1200, seed=1)
    extra = held_out_sentences(3000, seed=1, n_train=30000, n_test=1200)
    assert len(set(extra)) == 3000 and not set(extra) & (set(train) | set(test))


def test_md_long_recurrence_shrinks_with_more_distinct_speech():
    def pools(n):
        return {d: [{"ID": f"{i}_{d}", "source_id": str(i)} for i in range(n)] for d in "ABCD"}
    few = md_long(pools(100), total=3000, min_len=20, max_len=500, seed=0)
    many = md_long(pools(1000), total=3000, min_len=20, max_len=500, seed=0)
    assert recurrence(few)[0] == 100 and recurrence(few)[1] == 30.0
    distinct, mean, most = recurrence(many)
    assert distinct <= 1000 and mean == 3000 / distinct and most <= 4


def test_long_split_renders_held_out_speech(tmp_path):
    from tta_brain.data.prep.synthetic import make_long_test
    stamp = make_long_test(str(tmp_path), n_test=4, seed=1, n_speakers=2, n_train_ref=50,
                           n_test_ref=10, num_workers=1)
    split = tmp_path / "LibriSpeech" / "test-synth-long"
    assert stamp["stats"]["test-synth-long"]["n_utts"] == 4
    assert len(list(split.rglob("*.flac"))) == 4
    texts = [ln.split(" ", 1)[1].lower() for f in split.rglob("*.trans.txt")
             for ln in f.read_text().splitlines()]
    train, test = make_sentence_sets(150, 30, seed=1)
    assert len(texts) == 4 and not set(texts) & (set(train) | set(test))
    assert {p.parent.parent.name for p in split.rglob("*.flac")} <= {"9500", "9501"}
    from tta_brain.data.prep.synthetic import TEST_VARIANTS        # held-out voices only
    assert {p["voice"].split("+")[1] for p in stamp["stats"]["test-synth-long"][
        "speakers"].values()} <= set(TEST_VARIANTS)
    mtime = next(split.rglob("*.flac")).stat().st_mtime_ns
    make_long_test(str(tmp_path), n_test=4, seed=1, n_speakers=2, n_train_ref=50, n_test_ref=10,
                   num_workers=1)                                  # same options: nothing redone
    assert next(split.rglob("*.flac")).stat().st_mtime_ns == mtime
    again = make_long_test(str(tmp_path), n_test=3, seed=1, n_speakers=2, n_train_ref=50,
                           n_test_ref=10, num_workers=1)           # another size: rendered anew
    assert again["stats"]["test-synth-long"]["n_utts"] == 3 == len(list(split.rglob("*.flac")))


# ------------------------------------------------------------------------- the recipe switch
def test_long_switch_plans_its_own_trees_and_registered_methods(tmp_path):
    res = subprocess.run(["bash", str(REPO / "recipes/synthetic/run.sh"), "--long", "true",
                          "--dry_run", "true", "--data_dir", str(tmp_path / "data"),
                          "--exp_dir", str(tmp_path / "exp")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    data = tmp_path / "data" / "long3000"
    assert f"long_test --root {data}/corpus --n_test 1000" in out
    assert "--split test-synth-long" in out
    assert "--names md_long" in out and "--total 3000" in out and "--max_len 500" in out
    assert "--per_domain" not in out.partition("prepare streams")[2].splitlines()[0]  # no block size
    for token in ("source", "suta", "dsuta+dynamic", "dsuta+oracle", "csuta+dynamic", "awmc"):
        assert f"{tmp_path}/exp/long3000/snr20/md_long/{token}/seed0" in out
    assert "tta_brain.report.long" in out
    quick = subprocess.run(["bash", str(REPO / "recipes/synthetic/run.sh"), "--dry_run", "true",
                            "--data_dir", str(tmp_path / "data")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    plan = quick.stdout + quick.stderr                       # the quick start as it was
    assert quick.returncode == 0 and "long_test" not in plan and "long3000" not in plan
    assert f"corpus --root {tmp_path}/data/corpus --n_train 0 --n_test 400" in plan
    assert "--split test-synth --out" in plan and "--names md_easy md_hard" in plan
    streams = plan.partition("prepare streams")[2].splitlines()[0]
    assert "--per_domain 80" in streams and "--total" not in streams     # the sizes md_easy takes
    assert "report.long" not in plan
    given = subprocess.run(["bash", str(REPO / "recipes/synthetic/run.sh"), "--long", "true",
                            "--streams", "md_easy md_hard", "--dry_run", "true", "--data_dir",
                            str(tmp_path / "data"), "--stop_stage", "3"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert given.returncode == 0, given.stderr[-2000:]        # --streams given: it, not md_long
    assert "--names md_easy md_hard" in given.stdout + given.stderr
