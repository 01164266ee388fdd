"""Tests of tta_brain.report.results / tta_brain.report.plots on realistic experiment directories."""
import dataclasses
import json
import logging
import os
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tta_brain.asr import metrics
from tta_brain.report import long, plots, results as report, tables, tags
from tta_brain.run import records, summary

WORDS = 10  # reference words per utterance
MD_DOMAINS = ["AA", "GS", "NB"]  # md_easy: 3 segments of 200 utterances
SEG_LEN = 200
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Fixture builders: folders written through tta_brain.run.records, the module the Brain writes with
# ---------------------------------------------------------------------------------------------
def stream_layout(stream):
    """[(domain, segment)] per position."""
    if stream == "md_easy":
        return [(d, i) for i, d in enumerate(MD_DOMAINS) for _ in range(SEG_LEN)]
    if stream.startswith("own"):                    # one's own manifest: no domain column
        return [("", 0)] * 100
    return [(stream.split("_")[-1], 0)] * 100


def make_run(root, method, stream, seed, errs, resets=(), lii=None, counts=None, time_per_audio=None,
             hparams=None, sub_frac=0.5):
    """errs: errors per utterance (int, or callable(position, domain) -> int)."""
    d = Path(root) / stream / method / str(seed)
    d.mkdir(parents=True)
    layout = stream_layout(stream)
    err_of = errs if callable(errs) else (lambda pos, dom: errs)
    writer = records.RecordWriter(d)
    for p in resets:
        writer.reset(records.Reset(p, f"utt{p:05d}", "lii", p - 1))
    for p, value, stage in lii or []:
        writer.lii(p, value, stage)
    n_err_total = 0
    for pos, (dom, seg) in enumerate(layout):
        e = err_of(pos, dom)
        sub = int(e * sub_frac)
        dele = (e - sub) // 2
        n_err_total += e
        writer.transcript(records.Transcript(pos, f"utt{pos:05d}", dom, seg, 2.0, "a b c", "a b",
                                             WORDS, e, sub, dele, e - sub - dele))
    writer.close()
    n = len(layout)
    boundaries = [p for p in range(1, n) if layout[p][1] != layout[p - 1][1]]
    summary.write_summary(d, summary.Summary(
        method=method, stream=stream, seed=seed, wer=100.0 * n_err_total / (n * WORDS),
        wer_per_domain={}, n_utts=n, n_words=n * WORDS, n_err=n_err_total, n_skipped=0, skipped=[],
        resets=list(resets), boundaries=boundaries,
        counts=counts or {"adapt_forward": 0, "adapt_backward": 0, "infer_forward": n,
                          "aux_forward": 0},
        wall_time_s=(time_per_audio or 0.01) * 2.0 * n, audio_s=2.0 * n,
        time_per_audio_s=time_per_audio or 0.01, num_adapted_params=0, hparams=hparams or {},
        device="cpu", versions={"torch": "2.11.0", "speechbrain": "1.1.2"}))
    return d


def dynamic_lii(resets):
    """Construction rows 50..99 after each (re)start, detection rows afterwards up to the next reset."""
    rows, start = [], 0
    for stop in list(resets) + [len(MD_DOMAINS) * SEG_LEN - 1]:
        for p in range(start + 50, min(start + 100, stop + 1)):
            rows.append([p, 0.1, "construction"])
        for p in range(start + 100, stop + 1):
            rows.append([p, 0.1 if p // SEG_LEN == start // SEG_LEN else 2.0, "detection"])
        start = stop + 1
    return rows


DYN_RESETS = {1: [205, 450], 2: [120, 230, 520]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("exp")
    n = len(MD_DOMAINS) * SEG_LEN
    per_pass = lambda f, b, a=0: {"adapt_forward": f * n, "adapt_backward": b * n, "infer_forward": n,  # noqa
                                  "aux_forward": a * n}
    md_err = {"AA": 2, "GS": 5, "NB": 8}
    make_run(root, "source", "md_easy", 0, lambda p, d: md_err[d])
    for seed, e in zip((1, 2, 3), (2, 3, 4)):  # suta WER 20, 30, 40 -> 30.0 +- 10.0
        make_run(root, "suta", "md_easy", seed, lambda p, d, e=e: min(e + (d == "NB"), WORDS),
                 counts=per_pass(10, 10), time_per_audio=0.08)
    for seed, e in zip((1, 2), (1, 2)):
        make_run(root, "dsuta", "md_easy", seed, e, counts=per_pass(5, 5), time_per_audio=0.04)
    for seed, resets in DYN_RESETS.items():
        make_run(root, "dsuta+dynamic", "md_easy", seed, 1, resets=resets, lii=dynamic_lii(resets),
                 counts=per_pass(5, 5, 2), time_per_audio=0.05)
    make_run(root, "awmc", "md_easy", 1, 3, counts=per_pass(3, 1), time_per_audio=0.16)
    make_run(root, "zeta", "md_easy", 1, 3)          # unknown tags go last, alphabetically
    make_run(root, "alpha", "md_easy", 1, 3)
    for dom, base in (("AA", 4), ("GS", 6)):          # single-domain streams (paper Table 1)
        make_run(root, "source", f"lsc_{dom}", 0, base)
        for seed in (1, 2):
            make_run(root, "suta", f"lsc_{dom}", seed, base - seed)
    bad = root / "md_easy" / "broken" / "1"           # corrupt summary.json
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text("{not json")
    (root / "md_easy" / "unfinished").mkdir()         # transcripts without summary
    (root / "md_easy" / "unfinished" / "transcripts.csv").write_text("position\n")
    make_run(root / "cut", "suta", "md_easy", 9, 1)   # a copy cut short at a line boundary
    tr = root / "cut" / "md_easy" / "suta" / "9" / "transcripts.csv"
    tr.write_text("".join(tr.read_text().splitlines(keepends=True)[:11]))
    return root


@pytest.fixture(scope="module")
def written(results):
    out = report.write_results(results, smooth=50, repo_dir=REPO)
    return out, out.read_text()


def section(text, title):
    """Markdown between '## title' and the next '## '."""
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def table_rows(md):
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith("|") and not line.startswith("|:--") and not line.startswith("|--")]


def png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, path
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------
def test_a_cma_seed_that_follows_the_seed_is_no_other_experiment(tmp_path):
    """FOA / E-BATS seeds differ in cma_seed too (``<seed> + 2024``): that is each seed's own
    draws, not settings that make other experiments; a cma_seed set apart from the seed is."""
    def runs(pairs, root):
        for seed, cma in pairs:
            d = make_run(tmp_path / root, "ebats", "md_easy", seed, 1)
            summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint={
                "hparams": {"seed": seed, "cma_seed": cma}}))
        return report.collect_runs(tmp_path / root)
    assert report.pooling_warnings(runs(((0, 2024), (1, 2025), (2, 2026)), "a")) == []
    said = report.pooling_warnings(runs(((0, 2024), (1, 7)), "b"))
    assert len(said) == 1 and "settings other than the seed differ (hparams.cma_seed)" in said[0]


def test_runs_pooled_as_seeds_that_are_not_are_named(tmp_path, caplog):
    """Reporting a root with two SNRs' folders of one stream name pooled their runs as seeds of
    one experiment (n=3 below); the report now names such cells, in the log and in RESULTS.md."""
    for sub, seed, lr in (("snr5", 0, 1e-4), ("snr20", 0, 1e-4), ("snr20", 1, 2e-4)):
        d = make_run(tmp_path / sub, "suta", "md_easy", seed, 1)
        summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint={
            "stream_sha1": sub, "hparams": {"seed": seed, "lr": lr}}))
    with caplog.at_level(logging.WARNING, logger="tta_brain.report.results"):
        runs = report.collect_runs(tmp_path)
    expected = ("suta on md_easy: seed 0 more than once and settings other than the seed differ "
                "(hparams.lr, stream_sha1) across its 3 runs (snr20/md_easy/suta/0, "
                "snr5/md_easy/suta/0, snr20/md_easy/suta/1), pooled as seeds of one experiment")
    assert [m[:len(expected)] for m in caplog.messages][:1] == [expected]
    assert caplog.messages[1].startswith("stream md_easy: its runs decoded 2 different stream "
                                         "files (sha1 snr20: snr20/md_easy/suta/0, ")
    assert f"## Warnings\n\n- {expected}" in report.build_markdown(runs)
    one = report.collect_runs(tmp_path / "snr20")          # seeds of one stream: one lr apart
    assert report.pooling_warnings(one) == [
        "suta on md_easy: settings other than the seed differ (hparams.lr) across its 2 runs "
        "(md_easy/suta/0, md_easy/suta/1), pooled as seeds of one experiment: if they are other "
        "experiments, name them apart (--method_tag; the grid's --decode_opts and --sweep do) or "
        "report each experiment's folder (--exp_dir)"]
    assert report.pooling_warnings(report.collect_runs(tmp_path / "snr5")) == []
    assert "## Warnings" not in report.build_markdown(report.collect_runs(tmp_path / "snr5"))


def test_one_experiment_under_two_labels_is_named(tmp_path):
    """A plain decode's suta and a grid's suta_steps2 of the same settings, or two --method_tag
    values, make one fingerprint (method, settings, seed, stream file and model alike): the same
    run, shown as two methods' rows without a word. Now one warning names the labels and runs;
    another seed or setting is no twin, nor a fingerprint that records no method (no
    "structure")."""
    for tag, seed, lr in (("suta", 0, 0.1), ("suta", 1, 0.1), ("suta_steps2", 0, 0.1),
                          ("suta_steps2", 1, 0.1), ("suta_lr0.2", 0, 0.2)):
        d = make_run(tmp_path, tag, "md_easy", seed, 1)
        summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint={
            "stream_sha1": "ab", "structure": {"method": "5a"},
            "hparams": {"seed": seed, "lr": lr, "steps": 2}}))
    runs = report.collect_runs(tmp_path)
    said = ("suta and suta_steps2 on md_easy: one experiment under 2 labels (runs of one "
            "fingerprint: method, settings, seed, stream file and model: {}), shown as other "
            "methods' rows: report it once (move the other folders out of --exp_dir)")
    assert report.pooling_warnings(runs) == [said.format(
        "md_easy/suta/0, md_easy/suta_steps2/0, md_easy/suta/1, md_easy/suta_steps2/1")]
    assert report.pooling_warnings([r for r in runs if r.seed == 1 or r.method == "suta"]) == [
        said.format("md_easy/suta/1, md_easy/suta_steps2/1")]
    for r in runs:
        del r.summary.fingerprint["structure"]
    assert report.pooling_warnings(runs) == []


def test_runs_that_scored_different_utterances_are_named(tmp_path):
    """A run that skipped utterances the others decoded (too long for its max_duration) sat in
    the stream table beside them without a word (its WER over other utterances); now a warning
    names it. Runs with the same skips, or none, say nothing."""
    for method in ("source", "dsuta", "suta"):
        make_run(tmp_path, method, "md_easy", 0, 1)
    d = tmp_path / "md_easy" / "dsuta" / "0"
    skips = [{"position": 3, "ID": "utt00003", "reason": "longer than max_duration"},
             {"position": 9, "ID": "utt00009", "reason": "longer than max_duration"}]
    summary.write_summary(d, dataclasses.replace(summary.read_summary(d), n_skipped=2,
                                                 skipped=skips))
    runs = report.collect_runs(tmp_path)
    assert report.skip_warnings(runs) == [
        "md_easy: the runs scored different utterances (md_easy/dsuta/0 skipped 2; the others "
        "none or other ones): their md_easy WERs are over other sets of utterances (each run's "
        "rejects.csv lists its skips)"]
    assert report.skip_warnings(runs)[0] in section(report.build_markdown(runs), "Warnings")
    assert report.skip_warnings([r for r in runs if r.method != "dsuta"]) == []
    d = tmp_path / "md_easy" / "suta" / "0"                           # the same skips as dsuta's
    summary.write_summary(d, dataclasses.replace(summary.read_summary(d), n_skipped=2,
                                                 skipped=skips))
    runs = report.collect_runs(tmp_path)
    assert report.skip_warnings([r for r in runs if r.method != "source"]) == []


def test_methods_decoded_on_different_files_of_one_stream_are_named(tmp_path, caplog):
    """A stream written again (``--force_streams``) and only some of its runs decoded again:
    RESULTS.md put source on the new 40-row file beside suta on the old 30-row one, one column,
    no warning (each cell alone was consistent). Now the column is named with its files."""
    for method, sha, rows in (("source", "new", 40), ("suta", "old", 30), ("dsuta", "old", 30)):
        d = make_run(tmp_path, method, "md_easy", 0, 1)
        summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint={
            "stream_sha1": sha * 4, "n_rows": rows, "hparams": {"seed": 0}}))
    other = make_run(tmp_path, "source", "md_hard", 0, 1)       # another stream: its own column
    summary.write_summary(other, dataclasses.replace(summary.read_summary(other), fingerprint={
        "stream_sha1": "hard", "n_rows": 40, "hparams": {"seed": 0}}))
    with caplog.at_level(logging.WARNING, logger="tta_brain.report.results"):
        runs = report.collect_runs(tmp_path)
    said = ("stream md_easy: its runs decoded 2 different stream files (40 rows, sha1 newnewnewn: "
            "md_easy/source/0; 30 rows, sha1 oldoldoldo: md_easy/suta/0, md_easy/dsuta/0), "
            "compared side by side as one stream: decode the runs of the stale file again on "
            "the current one (--decode_opts=--overwrite) or report each file's runs apart "
            "(--exp_dir)")
    assert caplog.messages == [said]
    assert f"## Warnings\n\n- {said}" in report.build_markdown(runs)
    assert report.stream_warnings([r for r in runs if r.method != "source"]) == []


def test_runs_of_different_source_models_on_one_stream_are_named(tmp_path, caplog):
    """Runs of two source models decoded into one experiment folder (``--model`` changed between
    stage calls) sat in one stream column, each cell consistent, no warning: the table compared
    suta on one model with the source row of another. Now the column is named with its models;
    a hub model recorded without its commit is the same model as with one."""
    for method, model in (("source", "sha1:aaaa"), ("suta", "sha1:bbbb"), ("dsuta", "sha1:bbbb"),
                          ("sgem", "hub:org/w2v2@0123abcd"), ("csuta", "hub:org/w2v2")):
        d = make_run(tmp_path, method, "md_easy", 0, 1)
        summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint={
            "stream_sha1": "s", "hparams": {"seed": 0, "source": model}}))
    with caplog.at_level(logging.WARNING, logger="tta_brain.report.results"):
        runs = report.collect_runs(tmp_path)
    said = ("stream md_easy: its runs adapted 3 different source models (sha1:aaaa: "
            "md_easy/source/0; sha1:bbbb: md_easy/suta/0, md_easy/dsuta/0; hub:org/w2v2@0123abcd: "
            "md_easy/sgem/0, md_easy/csuta/0), compared side by side as one experiment: give "
            "each model its own experiment folder (--exp_dir) and report each apart")
    assert caplog.messages == [said]
    assert said in section(report.build_markdown(runs), "Warnings")
    assert report.stream_warnings([r for r in runs if r.method in ("suta", "dsuta")]) == []
    assert report.stream_warnings([r for r in runs if r.method in ("csuta", "sgem")]) == []
    assert report.stream_warnings([r for r in runs if r.method in ("source", "suta")]) == [
        "stream md_easy: its runs adapted 2 different source models (sha1:aaaa: md_easy/source/0; "
        "sha1:bbbb: md_easy/suta/0), compared side by side as one experiment: give each model "
        "its own experiment folder (--exp_dir) and report each apart"]    # two: the usual case
    other = next(r for r in runs if r.method == "suta")     # a second commit of the hub model:
    other.summary.fingerprint["hparams"]["source"] = "hub:org/w2v2@99999999"  # two models, the
    said = report.stream_warnings([r for r in runs if r.method in ("csuta", "sgem", "suta")])
    assert len(said) == 1 and "adapted 3 different source models" in said[0]    # commitless one


def test_run_folders_left_out_are_listed_in_results_md(results, written, tmp_path):
    """Unfinished, unreadable and never-started runs were only warned about on stderr: RESULTS.md
    just lacked them, as if never run. Now they are listed, with why, under "Not reported"."""
    _, text = written
    listed = section(text, "Not reported")
    for rel, why in (("md_easy/broken/1", "summary.json"),
                     ("md_easy/unfinished", "transcripts.csv but no summary.json"),
                     ("cut/md_easy/suta/9", "cut short")):
        line = next(ln for ln in listed.splitlines() if ln.startswith(f"- `{rel}`: "))
        assert why in line, line
    started = tmp_path / "exp" / "md_hard" / "sgem" / "0"      # failed at its start: no records
    started.mkdir(parents=True)
    (started / "fingerprint.json").write_text("{}")
    (started / "log.txt").write_text("ERROR: ...\n")
    make_run(tmp_path / "exp", "source", "md_hard", 0, 1)
    md = report.write_results(tmp_path / "exp", make_plots=False).read_text()
    assert ("- `md_hard/sgem/0`: no records yet: running, or stopped before its first utterance "
            "(its log.txt says why)") in section(md, "Not reported")
    fine = tmp_path / "fine"
    make_run(fine, "source", "md_hard", 0, 1)
    assert "## Not reported" not in report.write_results(fine, make_plots=False).read_text()


def test_collect_runs_skips_bad_dirs(results, caplog):
    with caplog.at_level(logging.WARNING, logger="tta_brain.report.results"):
        runs = report.collect_runs(results)
    assert len(runs) == 1 + 3 + 2 + 2 + 1 + 2 + 2 * 3
    assert {r.name for r in runs} >= {"md_easy/suta/1", "lsc_AA/source/0"}
    assert any("broken" in m and "summary.json" in m for m in caplog.messages)
    assert any("unfinished" in m for m in caplog.messages)
    cut = [m for m in caplog.messages if "cut/md_easy/suta/9" in m]    # not a 10-utterance run
    assert len(cut) == 1 and "transcripts.csv: 10 utterances, 100 words, 10 errors, but " \
        "summary.json says 600, 6000, 600 (cut short" in cut[0], cut
    dyn = next(r for r in runs if r.method == "dsuta+dynamic" and r.seed == 2)
    assert dyn.resets == [120, 230, 520] and dyn.boundaries == [200, 400]
    assert len(dyn.transcripts) == 600 and dyn.lii[0].stage == "construction"
    assert [t.reset for t in dyn.transcripts if t.reset] == [1, 1, 1]   # the writer marks them


def test_runs_are_in_numeric_seed_order(tmp_path):
    """Seeds 1, 2, 10 in that order (as text, "10" sorts before "2"): the Runs table, the
    per-experiment scores and LONG.md list a method's seeds in it (mutation audit)."""
    for seed in (10, 2, 1):
        make_run(tmp_path, "suta", "lsc_AA", seed, 1)
    assert [r.seed for r in report.collect_runs(tmp_path)] == [1, 2, 10]


def test_long_report_of_one_stream_reads_only_its_runs_records(tmp_path, capsys):
    """report.long --stream X loads X's runs alone: another stream's records are not read (a
    damaged one is not even noticed); a stream with no run names those there."""
    make_run(tmp_path, "source", "st_long", 0, 2)
    make_run(tmp_path, "suta", "st_long", 0, 1)
    other = make_run(tmp_path, "suta", "st_other", 0, 3)
    text = (other / "transcripts.csv").read_text()
    (other / "transcripts.csv").write_text(text[: text.rindex("\n", 0, len(text) - 1) + 1])
    skipped, others = [], set()
    runs = report.collect_runs(tmp_path, skipped, stream="st_long", other_streams=others)
    assert [(r.stream, r.method) for r in runs] == [("st_long", "source"), ("st_long", "suta")]
    assert skipped == [] and others == {"st_other"}
    assert long.main(["--exp_dir", str(tmp_path), "--stream", "st_long", "--window", "10",
                      "--no_plots"]) == 0
    assert "st_other" not in (tmp_path / "LONG.md").read_text()
    assert long.main(["--exp_dir", str(tmp_path), "--stream", "st_x", "--no_plots"]) == 1
    err = capsys.readouterr().err
    assert "no finished run of stream 'st_x' under" in err
    assert "(streams there: st_long, st_other; --stream)" in err
    every = report.collect_runs(tmp_path, skipped)             # all streams: the damage is seen
    assert len(every) == 2 and "utterances" in skipped[0][1]


def test_rows_done_counts_what_was_appended_and_notices_a_rewrite(tmp_path):
    """The grid's progress: each call reads only what the run appended since the last one (a
    file cut back and written again, as a resumed run rewrites its rows after the checkpoint,
    or replaced, is counted again from its start)."""
    d = tmp_path / "run"
    d.mkdir()
    writer = records.RecordWriter(d)

    def row(pos, hyp="a b"):
        return records.Transcript(pos, f"u{pos}", "", 0, 1.0, "a b", hyp, 2, 0, 0, 0, 0)

    for pos in range(3):
        writer.transcript(row(pos))
    writer.reject(records.Reject(3, "u3", "x.wav", "unreadable"))
    writer.flush()
    assert records.rows_done(d) == 4
    path = str(d / "transcripts.csv")
    counted = records._COUNTED[path][2]
    for pos in range(4, 9):
        writer.transcript(row(pos))
    writer.close()
    with open(path, "ab") as f:                 # a line being written is not counted yet
        f.write(b"9,u9,")
    assert records.rows_done(d) == 9
    assert records._COUNTED[path][2] > counted
    text = open(path, "rb").read()
    with open(path, "r+b") as f:                # cut back to its header and two rows, then one
        f.truncate(text.index(b"2,u2,"))        # long row written past where it was counted
        f.seek(0, 2)
        f.write(b"2,u2,," + b"x" * len(text) + b"\n")
    assert records.rows_done(d) == 4
    with open(path, "r+b") as f:                # cut back below what was counted
        f.truncate(text.index(b"1,u1,"))
    assert records.rows_done(d) == 2
    (d / "transcripts.csv").unlink()
    assert records.rows_done(d) == 1            # the reject alone
    assert path not in records._COUNTED


def test_aggregate_is_sample_std():
    mean, std, n = tables.aggregate([20.0, 30.0, 40.0])
    assert (mean, n) == (30.0, 3) and std == pytest.approx(10.0)  # population std would be 8.16
    assert tables.fmt_stat([20.0, 30.0, 40.0]) == "30.0 ± 10.0 (n=3)"
    assert tables.fmt_stat([12.345]) == "12.3 (n=1)"
    assert tables.fmt_stat([]) == "-"
    # runs whose WER is nan (no reference words) are left out of the mean, std and n
    mean, std, n = tables.aggregate([20.0, float("nan"), 40.0, None])
    assert (mean, n) == (30.0, 2) and std == pytest.approx(2 ** 0.5 * 10.0)
    assert tables.fmt_stat([float("nan"), 12.345]) == "12.3 (n=1)"


def test_main_table_values_and_order(written):
    _, text = written
    rows = table_rows(section(text, "WER (%) per method and stream"))
    assert rows[0] == ["Method", "lsc_AA", "lsc_GS", "md_easy"]
    assert [r[0] for r in rows[1:]] == ["source", "suta", "awmc", "dsuta", "dsuta+dynamic", "alpha", "zeta"]
    suta = dict(zip(rows[0], rows[2]))
    # md_easy suta seeds: errors e, e, e+1 over the 3 domains -> WER 10e + 10/3
    wers = [100.0 * (3 * e + 1) / 30 for e in (2, 3, 4)]
    assert suta["md_easy"] == f"{statistics.fmean(wers):.1f} ± {statistics.stdev(wers):.1f} (n=3)"
    assert suta["md_easy"] == "33.3 ± 10.0 (n=3)"
    assert suta["lsc_AA"] == "25.0 ± 7.1 (n=2)"                      # WER 30, 20
    assert dict(zip(rows[0], rows[1]))["md_easy"] == "50.0 (n=1)"     # (2+5+8)/30
    assert dict(zip(rows[0], rows[1]))["lsc_GS"] == "60.0 (n=1)"


def test_single_domain_and_breakdown_tables(written):
    _, text = written
    rows = table_rows(section(text, "WER (%) on single-domain streams"))
    assert rows[0] == ["Method", "AA", "GS", "Avg"]
    assert rows[1] == ["source", "40.0 (n=1)", "60.0 (n=1)", "50.0"]
    assert rows[2] == ["suta", "25.0 ± 7.1 (n=2)", "45.0 ± 7.1 (n=2)", "35.0"]
    rows = table_rows(section(text, "Per-domain WER (%) on md_easy"))
    assert rows[0] == ["Method", "AA", "GS", "NB", "all"]
    assert rows[1] == ["source", "20.0 (n=1)", "50.0 (n=1)", "80.0 (n=1)", "50.0 (n=1)"]
    assert rows[2][3] == "40.0 ± 10.0 (n=3)"  # NB: errors e+1


def test_a_stream_without_domains_is_titled_by_its_name(tmp_path):
    for stream, e in (("own_clinic", 1), ("lsc_AA", 2)):
        make_run(tmp_path, "suta", stream, 0, e)
    text = report.write_results(tmp_path, smooth=10, repo_dir=REPO).read_text()
    rows = table_rows(section(text, "WER (%) on single-domain streams"))
    assert rows[0] == ["Method", "AA", "own_clinic", "Avg"]             # was an empty title


def test_a_stream_without_domains_in_segments_has_no_per_domain_table(tmp_path):
    """One's own manifest with a segment column and no domain column: true boundaries, and every
    domain "" (none: summary.json's per-domain rates are none for it). Its "Per-domain" table was
    one column with an empty title beside "all", the same numbers; pinned: no such table, the
    stream in the main table only."""
    make_run(tmp_path, "suta", "own", 0, lambda p, dom: 2 if p < 50 else 6)
    runs = report.collect_runs(tmp_path)
    runs[0].transcripts = [dataclasses.replace(t, segment=t.position // 50)
                           for t in runs[0].transcripts]
    runs[0].summary = dataclasses.replace(runs[0].summary, boundaries=[50])
    text = report.build_markdown(runs)
    assert "Per-domain" not in text and "single-domain streams" not in text
    assert table_rows(section(text, "WER (%) per method and stream")) == [
        ["Method", "own"], ["suta", "40.0 (n=1)"]]


def test_columns_follow_the_domain_and_stream_names(tmp_path):
    """Table 1's columns are in the order of their domains' names, not their streams' (b_AA's
    AA before a_GS's GS), and the main table's in that of the stream names, whatever order the
    runs come in (mutation audit)."""
    for stream, e in (("a_GS", 1), ("b_AA", 2)):
        make_run(tmp_path, "suta", stream, 0, e)
    runs = report.collect_runs(tmp_path)
    assert table_rows(tables.table_domains(runs)) == [["Method", "AA", "GS", "Avg"],
                                                      ["suta", "20.0 (n=1)", "10.0 (n=1)", "15.0"]]
    assert table_rows(tables.table_main(runs[::-1])) == [["Method", "a_GS", "b_AA"],
                                                         ["suta", "10.0 (n=1)", "20.0 (n=1)"]]


def test_single_domain_avg_is_the_mean_of_three_columns(tmp_path):
    """The Avg column is the mean of the domain columns (10, 20 and 60 %: 30.0, the median 20)."""
    for stream, e in (("lsc_AA", 1), ("lsc_GS", 2), ("lsc_NB", 6)):
        make_run(tmp_path, "suta", stream, 0, e)
    runs = report.collect_runs(tmp_path)
    rows = table_rows(tables.table_domains(runs))
    assert rows == [["Method", "AA", "GS", "NB", "Avg"],
                    ["suta", "10.0 (n=1)", "20.0 (n=1)", "60.0 (n=1)", "30.0"]]


def test_single_domain_avg_is_of_the_column_means_of_methods_with_every_column(tmp_path):
    """Avg is the mean of the column means (suta: AA of two seeds, 10 and 30 %, and GS 50 %:
    35, not 30, the mean of its three runs); a method without a run of every column gets no Avg
    (over fewer columns it compares with no other); a method of multi-domain streams only gets
    no row; --digits reach the Avg (mutation audit)."""
    make_run(tmp_path, "suta", "lsc_AA", 1, 1)
    make_run(tmp_path, "suta", "lsc_AA", 2, 3)
    make_run(tmp_path, "suta", "lsc_GS", 1, 5)
    make_run(tmp_path, "source", "lsc_AA", 0, 4)          # no GS run
    make_run(tmp_path, "dsuta", "md_easy", 0, 2)
    rows = table_rows(tables.table_domains(report.collect_runs(tmp_path), digits=2))
    sd = statistics.stdev([10.0, 30.0])
    assert rows == [["Method", "AA", "GS", "Avg"],
                    ["source", "40.00 (n=1)", "-", "-"],
                    ["suta", f"20.00 ± {sd:.2f} (n=2)", "50.00 (n=1)", "35.00"]]


def test_detect_boundaries():
    det = tables.detect_boundaries([120, 230, 520], [200, 400], window=100)
    assert det == {"detected": {200: 30}, "missed": [400], "false": [120, 520]}
    # position = first utterance decoded from the reset model: an oracle reset sits on the boundary
    det = tables.detect_boundaries([200, 450], [200, 400], window=100)
    assert det["detected"] == {200: 0, 400: 50} and det["false"] == []
    det = tables.detect_boundaries([300, 501], [200, 400], window=100)  # r - b == window: detected
    assert det == {"detected": {200: 100}, "missed": [400], "false": [501]}
    det = tables.detect_boundaries([199], [200], window=100)          # one utterance early: false
    assert det == {"detected": {}, "missed": [200], "false": [199]}
    # one reset detects one boundary; a second reset in the same segment is a false one
    det = tables.detect_boundaries([50, 60, 170], [40, 80, 120, 160], window=40)
    assert det == {"detected": {40: 10, 160: 10}, "missed": [80, 120], "false": [60]}


def test_reset_table(written):
    _, text = written
    sec = section(text, "Reset steps")
    assert "True boundaries (first position of a new segment): 200, 400; detection window 100 utterances" in sec
    rows = {(r[0], r[1]): r for r in table_rows(sec)}
    assert rows[("dsuta+dynamic", "1")][2:] == ["205, 450", "2", "2/2", "0", "27.5"]
    assert rows[("dsuta+dynamic", "2")][2:] == ["120, 230, 520", "3", "1/2", "2", "30.0"]
    assert ("suta", "1") not in rows


def test_reset_table_follows_the_window(results, tmp_path):
    """``--window 20``: the reset at 450 is 50 utterances after the boundary at 400, a false
    reset; the table and its note say so (mutation audit: the window was not passed on)."""
    out = tmp_path / "R.md"
    assert report.main(["--exp_dir", str(results), "--window", "20", "--out", str(out),
                        "--no_plots"]) == 0
    md = out.read_text()
    sec = section(md, "Reset steps")
    assert "r - b <= 20 (delay = r - b)" in sec and "detection window 20 utterances" in sec
    rows = {(r[0], r[1]): r for r in table_rows(sec)}
    assert rows[("dsuta+dynamic", "1")][2:] == ["205, 450", "2", "1/2", "1", "5.0"]


def test_reset_table_has_a_reset_run_that_never_reset_and_cuts_long_lists(tmp_path):
    """A run of a reset configuration (its tag says so) that never reset has its row (0 resets,
    no boundary detected), not none; of more than 20 reset positions the first 20 are listed
    and the count of the others (mutation audit)."""
    make_run(tmp_path, "suta+fixed", "md_easy", 0, 1)
    make_run(tmp_path, "dsuta+fixed", "md_easy", 0, 1, resets=range(10, 260, 10))     # 25
    make_run(tmp_path, "dsuta+oracle", "md_easy", 0, 1, resets=range(10, 210, 10))    # 20
    rows = {r[0]: r for r in table_rows(tables.table_resets(report.collect_runs(tmp_path),
                                                            "md_easy"))}
    assert rows["suta+fixed"][2:] == ["-", "0", "0/2", "0", "-"]
    first20 = ", ".join(map(str, range(10, 210, 10)))
    assert rows["dsuta+fixed"][2:4] == [first20 + ", ... (+5 more)", "25"]
    assert rows["dsuta+oracle"][2:4] == [first20, "20"]


def test_reset_rows_of_a_method_at_two_step_counts_say_which(tmp_path, monkeypatch):
    """dsuta+dynamic run at N=1 and N=10 with one seed: the reset table and the reset timeline
    named both rows "dsuta+dynamic" seed 1 (the tables above say "dsuta+dynamic (N=1)"), so
    whose resets were whose could not be read. Pinned: each row has its RESULTS.md label."""
    for steps, resets in ((1, [205]), (10, [230, 450])):
        make_run(tmp_path / f"n{steps}", "dsuta+dynamic", "md_easy", 1, 1, resets=resets,
                 hparams={"steps": steps})
    runs = report.collect_runs(tmp_path)
    rows = table_rows(tables.table_resets(runs, "md_easy"))
    assert [r[:3] for r in rows[1:]] == [["dsuta+dynamic (N=1)", "1", "205"],
                                        ["dsuta+dynamic (N=10)", "1", "230, 450"]]
    figs = _figures(monkeypatch)
    assert plots.plot_reset_timeline(runs, "md_easy", tmp_path / "r.png")
    ax = figs[-1].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "dsuta+dynamic (N=1) seed 1", "dsuta+dynamic (N=10) seed 1"]
    assert [list(ln.get_xdata()) for ln in ax.lines if ln.get_marker() == "|"] == [
        [205], [230, 450]]


def test_lii_histograms_of_a_method_at_two_step_counts_are_apart(tmp_path, monkeypatch):
    """dsuta+dynamic at N=1 and N=10: one LII histogram pooled both step counts' values under
    "LII of dsuta+dynamic (n=2 runs)", where every table keeps them apart. Pinned: one
    histogram per label, of its own run's values."""
    for steps, value in ((1, 0.5), (10, 3.0)):
        make_run(tmp_path / f"n{steps}", "dsuta+dynamic", "md_easy", 1, 1, resets=[300],
                 lii=[[p, value, "construction"] for p in range(50, 100)],
                 hparams={"steps": steps})
    figs = _figures(monkeypatch)
    written = plots.make_all_plots(report.collect_runs(tmp_path), tmp_path / "plots")
    assert sorted(Path(p).name for p in written if Path(p).name.startswith("lii_")) == [
        "lii_md_easy_dsuta_dynamic_N_1.png", "lii_md_easy_dsuta_dynamic_N_10.png"]
    hists = {f.axes[0].get_title(): f.axes[0] for f in figs if "LII of" in f.axes[0].get_title()}
    assert sorted(hists) == [
        f"md_easy: LII of dsuta+dynamic (N={n}) (n=1 runs), in- vs out-of-domain" for n in (1, 10)]
    for n, value in ((1, 0.5), (10, 3.0)):
        [bars] = hists[f"md_easy: LII of dsuta+dynamic (N={n}) (n=1 runs), in- vs "
                       f"out-of-domain"].containers
        [full] = [p for p in bars.patches if p.get_height() > 0]
        assert full.get_x() <= value <= full.get_x() + full.get_width()


def test_every_table_labels_a_method_at_two_step_counts_alike(tmp_path):
    """suta at N=1 on lsc_AA and at N=10 on md_easy: the main table's rows are "suta (N=1)" and
    "suta (N=10)", but the single-domain, per-domain and efficiency tables, grouped over their
    own streams' runs, labelled either "suta", as if no other step count had run. Pinned: the
    labels of the main table in every table of RESULTS.md."""
    make_run(tmp_path / "n1", "suta", "lsc_AA", 1, 3, hparams={"steps": 1})
    make_run(tmp_path / "n10", "suta", "md_easy", 1, 2, hparams={"steps": 10})
    runs = report.collect_runs(tmp_path)
    text = report.build_markdown(runs)
    assert [r[0] for r in table_rows(section(text, "WER (%) per method and stream"))] == [
        "Method", "suta (N=1)", "suta (N=10)"]
    assert table_rows(section(text, "WER (%) on single-domain streams"))[1] == [
        "suta (N=1)", "30.0 (n=1)", "30.0"]
    assert table_rows(section(text, "Per-domain WER (%) on md_easy"))[1][0] == "suta (N=10)"
    eff = section(text, "Efficiency")
    assert [r[0] for r in table_rows(eff) if r[0] != "Method"] == ["suta (N=1)", "suta (N=10)"]


def test_espnet_table(results, written):
    _, text = written
    sec = text[text.index("### md_easy/source/0"):]
    rows = table_rows(sec.split("###")[1])
    assert rows[0] == ["dataset", "Snt", "Wrd", "Corr", "Sub", "Del", "Ins", "Err", "S.Err"]
    # NB: 8 errors per 10 words = 4 sub + 2 del + 2 ins
    assert rows[-1] == ["md_easy/NB", "200", "2000", "40.0", "40.0", "20.0", "20.0", "80.0", "100.0"]
    # AA: 2 errors = 1 sub + 0 del + 1 ins, GS: 5 = 2 sub + 1 del + 2 ins (NB's 2 del and 2 ins
    # could not tell the Del and Ins columns apart)
    assert rows[2] == ["md_easy/AA", "200", "2000", "90.0", "10.0", "0.0", "10.0", "20.0", "100.0"]
    assert rows[3] == ["md_easy/GS", "200", "2000", "70.0", "20.0", "10.0", "20.0", "50.0", "100.0"]
    assert rows[1][:3] == ["md_easy", "600", "6000"] and rows[1][7] == "50.0"
    # a single-domain stream: its one row (no "lsc_AA/AA" row repeating it); 4 errors per 10
    # words = 2 sub + 1 del + 1 ins
    sec = text[text.index("### lsc_AA/source/0"):]
    assert table_rows(sec.split("###")[1])[1:] == [
        ["lsc_AA", "100", "1000", "70.0", "20.0", "10.0", "10.0", "40.0", "100.0"]]


def test_efficiency_ratios(written):
    _, text = written
    sec = section(text, "Efficiency")
    rows = {r[0]: dict(zip(table_rows(sec)[0], r)) for r in table_rows(sec)[1:]}
    assert rows["suta"]["Adapt fwd/utt"] == "10.00" and rows["suta"]["Infer fwd/utt"] == "1.00"
    assert rows["suta"]["Time x SUTA"] == "1.00"
    assert rows["dsuta"]["Time x SUTA"] == "0.50"                     # 0.04 / 0.08
    assert rows["dsuta+dynamic"]["Aux fwd/utt"] == "2.00"
    assert rows["dsuta+dynamic"]["Passes x SUTA"] == f"{13 / 21:.2f}"  # (5+5+1+2)/(10+10+1)
    assert rows["awmc"]["Time x SUTA"] == "2.00" and rows["awmc"]["s per audio s"] == "0.160"
    assert rows["awmc"]["Wall time (s)"] == f"{0.16 * 1200:.1f}"


def test_efficiency_ratios_to_a_grids_tagged_suta(tmp_path):
    """A grid tags its runs (``suta_steps1``): the ratios were '-' for every method; the one
    tagged SUTA is the reference, two are no reference."""
    make_run(tmp_path, "suta_steps1", "lsc_AA", 0, 2, time_per_audio=0.08)
    make_run(tmp_path, "dsuta_steps1", "lsc_AA", 0, 2, time_per_audio=0.04)
    rows = table_rows(tables.table_efficiency(report.collect_runs(tmp_path), "lsc_AA"))
    assert {r[0]: r[7] for r in rows[1:]} == {"suta_steps1": "1.00", "dsuta_steps1": "0.50"}
    make_run(tmp_path, "suta_steps2", "lsc_AA", 0, 2, time_per_audio=0.1)
    rows = table_rows(tables.table_efficiency(report.collect_runs(tmp_path), "lsc_AA"))
    assert [r[7] for r in rows[1:]] == ["-", "-", "-"]


def test_efficiency_ratios_to_the_default_steps_of_suta(tmp_path):
    """SUTA run with two step counts: every ratio was '-' (no single reference), though the
    paper's N=10 is in the table; the packaged default is the reference, and the header says
    which."""
    (tmp_path / "a").mkdir()
    make_run(tmp_path / "a", "suta", "lsc_AA", 0, 2, time_per_audio=0.08, hparams={"steps": 10})
    (tmp_path / "b").mkdir()
    make_run(tmp_path / "b", "suta", "lsc_AA", 0, 2, time_per_audio=0.02, hparams={"steps": 1})
    make_run(tmp_path, "dsuta", "lsc_AA", 0, 2, time_per_audio=0.04, hparams={"steps": 5})
    rows = table_rows(tables.table_efficiency(report.collect_runs(tmp_path), "lsc_AA"))
    assert rows[0][7] == "Time x SUTA (N=10)"
    assert {r[0]: r[7] for r in rows[1:]} == {"suta (N=10)": "1.00", "suta (N=1)": "0.25",
                                              "dsuta": "0.50"}


def test_environment_block(written):
    _, text = written
    env = section(text, "Environments")
    assert "Where this report was written (each run's own machine" in env
    for key in ("date", "python version", "torch version", "torchaudio version", "transformers version",
                "speechbrain version", "Git hash", "CPU", "GPU"):
        assert f"- {key}: `" in env
    assert "decoded with (" in env and "speechbrain 1.1.2" in env


def test_environment_block_names_the_checkouts_commit(tmp_path):
    """RESULTS.md's ``Git hash``: the whole commit of the checkout that wrote it; "unavailable"
    outside a repository (mutation audit)."""
    from tta_brain.run.envinfo import environment
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert len(head) == 40 and environment(REPO)["Git hash"] == head
    assert environment(tmp_path)["Git hash"] == "unavailable"


def test_environment_block_lists_every_gpu(tmp_path, monkeypatch):
    """A machine with two GPUs: both in the block, as nvidia-smi lists them (mutation audit)."""
    from tta_brain.run.envinfo import environment
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100, 81559 MiB'\necho 'NVIDIA A100, 40960 MiB'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert environment(tmp_path)["GPU"] == "NVIDIA H100, 81559 MiB; NVIDIA A100, 40960 MiB"


def test_split_lii(results):
    run = next(r for r in report.collect_runs(results) if r.method == "dsuta+dynamic" and r.seed == 1)
    inside, outside = plots.split_lii(run)
    # segment 0: construction 50..99 + detection 100..199 in, 200..205 out;
    # after reset at 205: construction 256..305 (segment 1) in, detection 306..399 in, 400..450 out;
    # after reset at 450: construction 501..550 (segment 2) in, detection 551..599 in.
    assert len(outside) == 6 + 51 and set(outside) == {2.0}
    assert len(inside) == 150 + 144 + 99 and set(inside) == {0.1}
    # detection rows before any construction row are dropped (no reference segment yet)
    early = dataclasses.replace(run, lii=[records.Lii(p, 5.0, "detection") for p in (10, 20)]
                                + run.lii)
    assert plots.split_lii(early) == (inside, outside)
    # a run without transcripts: segments from its boundaries, a boundary starting the next one
    bare = dataclasses.replace(run, transcripts=[])
    assert [plots._segment_lookup(bare)(p) for p in (0, 199, 200, 399, 400, 599)] == \
        [0, 0, 1, 1, 2, 2]


def test_smoothed_wer():
    s = plots.smoothed_wer([1, 3, 0, 2], [10, 10, 0, 10], window=2)
    assert s[0] == pytest.approx(10.0) and s[1] == pytest.approx(20.0)
    assert s[2] == pytest.approx(30.0) and s[3] == pytest.approx(20.0)
    assert plots.smoothed_wer([0], [0], 5)[0] != plots.smoothed_wer([0], [0], 5)[0]  # nan


def test_plots_written(results, written):
    out, text = written
    pdir = results / "plots"
    expected = ["wer_diff_md_easy.png", "wer_diff_lsc_AA.png", "resets_md_easy.png",
                "lii_md_easy_dsuta_dynamic.png"]
    for name in expected:
        w, h = png_size(pdir / name)
        assert w >= 600 and h >= 150 and (pdir / name).stat().st_size > 10_000, name
        assert f"(plots/{name})" in text
    assert not (pdir / "resets_lsc_AA.png").exists()  # no reset-capable run there
    assert [p.name for p in pdir.glob("lii_*")] == ["lii_md_easy_dsuta_dynamic.png"]  # its stream's


def test_steps_table_and_plot(tmp_path):
    make_run(tmp_path, "source", "lsc_AA", 0, 6)
    for steps, e in ((0, 6), (5, 4), (10, 3)):
        for seed in (1, 2):
            make_run(tmp_path / f"n{steps}", "suta", "lsc_AA", seed, e, hparams={"steps": steps})
    for steps, e in ((5, 2), (10, 2)):
        make_run(tmp_path / f"n{steps}", "dsuta", "lsc_AA", 1, e, hparams={"steps": steps})
    out = report.write_results(tmp_path, plots_dir=tmp_path / "figs", repo_dir=REPO)
    text = out.read_text()
    rows = table_rows(section(text, "WER (%) vs number of adaptation steps"))
    assert rows[0] == ["Method", "N=0", "N=5", "N=10"]
    assert rows[1] == ["suta", "60.0 ± 0.0 (n=2)", "40.0 ± 0.0 (n=2)", "30.0 ± 0.0 (n=2)"]
    assert rows[2] == ["dsuta", "-", "20.0 (n=1)", "20.0 (n=1)"]
    main = [r[0] for r in table_rows(section(text, "WER (%) per method and stream"))]
    assert main[1:] == ["source", "suta (N=0)", "suta (N=5)", "suta (N=10)", "dsuta (N=5)", "dsuta (N=10)"]
    png_size(tmp_path / "figs" / "wer_vs_steps_lsc_AA.png")


def test_a_report_leaves_the_callers_backend_and_figures_as_they_were(tmp_path, caplog):
    """In a notebook: a report (plots.py's import) set the process's matplotlib backend to Agg,
    so the notebook's inline figures were no longer shown, and a plot that failed closed every
    figure the notebook had open (``pyplot.close("all")``). Now the report draws figures of its
    own: the caller's backend and figures are as they were, and a failed plot is one warning."""
    import matplotlib
    import matplotlib.pyplot as plt
    make_run(tmp_path, "source", "lsc_AA", 0, 6)
    make_run(tmp_path, "suta", "lsc_AA", 1, 4)
    before = matplotlib.get_backend()
    plt.switch_backend("svg")                  # not Agg: a backend of the caller's
    try:
        mine = plt.figure()
        (tmp_path / "figs" / "wer_diff_lsc_AA.png").mkdir(parents=True)   # that plot fails
        with caplog.at_level(logging.WARNING):
            report.write_results(tmp_path, plots_dir=tmp_path / "figs", repo_dir=REPO)
        assert "Plot plot_wer_difference failed" in caplog.text
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [mine.number]
        report.write_results(tmp_path, repo_dir=REPO)          # plots drawn: none left open
        assert (tmp_path / "plots" / "wer_diff_lsc_AA.png").stat().st_size > 10_000
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == [mine.number]
    finally:
        plt.close("all")
        plt.switch_backend(before)


def test_plot_links_to_a_folder_with_spaces_and_parentheses_are_whole(tmp_path):
    """``--plots_dir "my figs (1)"``: the link was ``(my figs (1)/x.png)``, which Markdown cuts
    at the first space; such a target is written in angle brackets (others as before)."""
    make_run(tmp_path, "source", "lsc_AA", 0, 6)
    make_run(tmp_path / "n5", "suta", "lsc_AA", 1, 4, hparams={"steps": 5})
    make_run(tmp_path / "n10", "suta", "lsc_AA", 1, 3, hparams={"steps": 10})
    out = report.write_results(tmp_path, plots_dir=tmp_path / "my figs (1)", repo_dir=REPO)
    assert "- [wer_vs_steps_lsc_AA.png](<my figs (1)/wer_vs_steps_lsc_AA.png>)" in out.read_text()


def _text_run(root, method, pairs):
    """A run of stream ``ja`` whose transcripts hold these (reference, hypothesis) texts."""
    d = Path(root) / method
    d.mkdir(parents=True)
    writer, n_err, n_words = records.RecordWriter(d), 0, 0
    for pos, (ref, hyp) in enumerate(pairs):
        w = metrics.word_errors(ref, hyp)
        n_err, n_words = n_err + w.n_err, n_words + w.n_ref
        writer.transcript(records.Transcript(pos, f"u{pos}", "", 0, 1.0, ref, hyp, w.n_ref,
                                             w.n_err, w.n_sub, w.n_del, w.n_ins))
    writer.close()
    summary.write_summary(d, summary.Summary(
        method=method, stream="ja", seed=0, wer=100.0 * n_err / n_words, wer_per_domain={},
        n_utts=len(pairs), n_words=n_words, n_err=n_err, n_skipped=0, skipped=[], resets=[],
        boundaries=[], counts={}, wall_time_s=1.0, audio_s=1.0, time_per_audio_s=1.0,
        num_adapted_params=0, hparams={}, device="cpu", versions={}))
    return d


def test_character_error_rates_are_reported_beside_the_word_ones(tmp_path, capsys):
    """``--metric cer``: every table and plot of character error rates (a language written
    without spaces has one "word" a sentence: one wrong character is 100 % WER), into
    RESULTS_cer.md and cer_* plots beside the WER report, which stays as it was."""
    _text_run(tmp_path, "source", [("日本語のテスト", "日本語のテクト"), ("はい", "はい")])
    d = _text_run(tmp_path, "suta", [("日本語のテスト", "日本語のテスト"), ("はい", "はいい")])
    data = json.loads((d / "summary.json").read_text())
    for key in ("cer", "cer_per_domain"):            # a summary written before CER: still read
        assert key in data
        del data[key]
    (d / "summary.json").write_text(json.dumps(data))
    assert summary.read_summary(d).cer is None
    assert report.main(["--exp_dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert report.main(["--exp_dir", str(tmp_path), "--metric", "cer"]) == 0
    assert "|source|11.1 (n=1)|" in capsys.readouterr().out      # the table printed: of CER too
    wer, cer = (tmp_path / "RESULTS.md").read_text(), (tmp_path / "RESULTS_cer.md").read_text()
    assert table_rows(section(wer, "WER (%) per method and stream"))[1:] == [
        ["source", "50.0 (n=1)"], ["suta", "50.0 (n=1)"]]
    # source: 1 of 9 characters; suta: 1 insertion
    assert table_rows(section(cer, "CER (%) per method and stream"))[1:] == [
        ["source", "11.1 (n=1)"], ["suta", "11.1 (n=1)"]]
    assert "CER (%) = 100 * character edits / reference characters" in cer and "WER" not in \
        section(cer, "Runs")
    assert table_rows(section(cer, "Per-experiment scores"))[0][:3] == ["dataset", "Snt", "Chr"]
    assert table_rows(section(cer, "Per-experiment scores"))[1] == [
        "ja", "2", "9", "88.9", "11.1", "0.0", "0.0", "11.1", "50.0"]
    assert table_rows(section(cer, "Per-experiment scores"))[3] == [   # suta: an insertion
        "ja", "2", "9", "100.0", "0.0", "0.0", "11.1", "11.1", "50.0"]
    for name in ("wer_diff_ja.png", "cer_diff_ja.png"):
        png_size(tmp_path / "plots" / name)
    assert "(plots/cer_diff_ja.png)" in cer and "(plots/wer_diff_ja.png)" in wer
    assert long.main(["--exp_dir", str(tmp_path), "--stream", "ja", "--window", "1",
                      "--metric", "cer", "--no_plots"]) == 0
    rows = table_rows((tmp_path / "LONG_cer.md").read_text())
    assert rows[0][3] == "CER %" and rows[2][:5] == ["suta", "0", "2", "11.1", "50.0 @ 1"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        report.main(["--exp_dir", str(tmp_path), "--metric", "ter"])
    err = capsys.readouterr().err
    assert "--metric" in err and "'ter'" in err and "'cer'" in err


def test_the_official_codes_scoring_deletes_apostrophes(tmp_path):
    """``--metric wer_official``: the words the official code's jiwer scoring counts (its
    punctuation removal deletes the apostrophe: DONT is DON'T there; here one substitution), in
    RESULTS_wer_official.md and LONG_wer_official.md, beside the WER report."""
    _text_run(tmp_path, "source", [("I DON'T KNOW", "I DONT KNOW"), ("IT'S ME", "ITS ME")])
    _text_run(tmp_path, "suta", [("I DON'T KNOW", "I DON'T NO"), ("IT'S ME", "IT S ME")])
    assert metrics.official_words("it's  l'été-x") == ["ITS", "LÉTÉ", "X"]
    assert report.main(["--exp_dir", str(tmp_path), "--no_plots"]) == 0
    assert report.main(["--exp_dir", str(tmp_path), "--metric", "wer_official",
                        "--no_plots"]) == 0
    wer = (tmp_path / "RESULTS.md").read_text()
    off = (tmp_path / "RESULTS_wer_official.md").read_text()
    # WER: source 2 substitutions of 5 words; suta 1 + (IT S: 1 sub, 1 ins) = 3 of 5
    assert table_rows(section(wer, "WER (%) per method and stream"))[1:] == [
        ["source", "40.0 (n=1)"], ["suta", "60.0 (n=1)"]]
    # official: source 0; suta: KNOW/NO 1, ITS/IT S 1 sub + 1 ins: 3 of 5
    assert table_rows(section(off, "WER-official (%) per method and stream"))[1:] == [
        ["source", "0.0 (n=1)"], ["suta", "60.0 (n=1)"]]
    assert "apostrophes deleted" in off
    assert long.main(["--exp_dir", str(tmp_path), "--stream", "ja", "--window", "1",
                      "--metric", "wer_official", "--no_plots"]) == 0
    text = (tmp_path / "LONG_wer_official.md").read_text()
    rows = table_rows(text)
    assert rows[0][3] == "WER-official %" and rows[1][:4] == ["source", "0", "2", "0.0"]
    assert "Windowed WER-official: errors / words over the last 1 utterances" in text  # not chars


@pytest.mark.filterwarnings("ignore:Glyph .* missing from font")   # no CJK font here
def test_plot_files_of_streams_with_like_names_are_apart(tmp_path):
    """Stream names without ASCII letters all became ``unnamed`` (one plot file, drawn over by
    each stream, linked twice), as did names that differ in a space or a '_'."""
    for stream in ("嘈杂", "安静", "md easy", "md_easy"):
        make_run(tmp_path, "suta", stream, 0, 2)
    runs = report.collect_runs(tmp_path)
    written = [Path(p).name for p in plots.make_all_plots(runs, tmp_path / "plots")]
    diff = sorted(n for n in written if n.startswith("wer_diff_"))
    assert len(diff) == 4 and "wer_diff_嘈杂.png" in diff and "wer_diff_安静.png" in diff
    assert {n[:len("wer_diff_md_easy-")] for n in diff if "md" in n} == {"wer_diff_md_easy-"}
    assert plots.file_names(["md_easy", "lsc_AA"]) == {"md_easy": "md_easy", "lsc_AA": "lsc_AA"}


def test_curves_are_drawn_at_stream_positions(tmp_path):
    """A skipped utterance shifted the rest of the curve (and the resets drawn on it) one
    position to the left of the boundaries."""
    make_run(tmp_path, "source", "lsc_AA", 0, lambda p, dom: 10 if p >= 50 else 0)
    run = report.collect_runs(tmp_path)[0]
    run.transcripts = [t for t in run.transcripts if t.position != 10]     # position 10 skipped
    curve = plots._mean_curve([run], 1)
    assert len(curve) == 100 and np.isnan(curve[10]) and curve[49] == 0 and curve[50] == 100
    # a seed that skipped the last utterances: the mean over seeds, cut to the shorter run
    short = dataclasses.replace(run, transcripts=[t for t in report.collect_runs(tmp_path)[0]
                                                  .transcripts if t.position < 90])
    both = plots._mean_curve([run, short], 1)
    assert len(both) == 90 and both[10] == 0 and both[49] == 0 and both[50] == 100


def test_difference_curves_compare_the_utterances_both_runs_scored(tmp_path):
    """A run that skipped an utterance the baseline decoded: its windows lacked that utterance's
    errors while the baseline's held them, so the difference curve dipped or rose near the skip
    by the skipped utterance's WER, not the methods'. Now both count the utterances both scored;
    runs with the same skips give the curves they gave before."""
    make_run(tmp_path, "source", "lsc_AA", 0, lambda p, dom: 10 if p in (30, 31) else 2)
    make_run(tmp_path, "suta", "lsc_AA", 0, 2)
    runs = report.collect_runs(tmp_path)
    has_base, [(label, curve, group)] = plots.difference_curves(runs, "lsc_AA", window=4)
    assert has_base and label[0] == "suta" and [r.method for r in group] == ["suta"]
    assert np.nanmax(np.abs(curve)) > 0          # the baseline's hard utterances, both scored
    suta = next(r for r in runs if r.method == "suta")
    suta.transcripts = [t for t in suta.transcripts if t.position not in (30, 31)]  # its skips
    _, [(_, curve, _)] = plots.difference_curves(runs, "lsc_AA", window=4)
    assert len(curve) == 100 and np.nanmax(np.abs(curve)) == 0
    _, [(_, alone, _)] = plots.difference_curves([suta], "lsc_AA", window=4)    # no baseline:
    assert np.nanmax(alone) == np.nanmin(alone) == 100.0 * 2 / WORDS          # absolute WER
    from tta_brain.report.long import collapse_figures
    source = next(r for r in runs if r.method == "source")
    assert collapse_figures(suta, source, window=4, margin=0.0)["first_above"] is None
    source.transcripts = [t for t in source.transcripts if t.position != 40]   # and its skip,
    suta.transcripts = [dataclasses.replace(t, n_err=10) if t.position in (40, 60) else t
                        for t in suta.transcripts]                # where suta erred: not counted
    assert collapse_figures(suta, source, window=4, margin=0.0)["first_above"] == 60
    _, [(_, curve, _)] = plots.difference_curves([source, suta], "lsc_AA", window=4)
    assert np.nanmax(np.abs(curve[40:44])) == 0                 # the plot leaves it out too
    assert curve[60] == pytest.approx(100.0 * (2 + 2 + 2 + 10) / 40 - 100.0 * 8 / 40)


def _figures(monkeypatch):
    """The figures the plots draw (caught at their save), to read what they show."""
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig) or str(path))
    return figs


def _trailing(errs, window):
    """By hand: 100 * errors / words of the (up to) ``window`` utterances ending at each one."""
    out = []
    for t in range(len(errs)):
        win = errs[max(0, t - window + 1):t + 1]
        out.append(100.0 * sum(win) / (WORDS * len(win)))
    return np.array(out)


def test_the_plots_show_the_runs_numbers(tmp_path, monkeypatch):
    """What each figure draws, against the runs' per-utterance errors computed here: the WER
    difference curves (mean over seeds minus the baseline's; the resets on their curve; the true
    boundaries), the reset timeline, the LII histograms, and WER vs steps (means, sample stds,
    the source's WER)."""
    layout = stream_layout("md_easy")
    src, e1, e2, e3 = (lambda p, d: 5 if d == "GS" else 2), (lambda p, d: p % 3), \
        (lambda p, d: p % 5 + (d == "NB")), (lambda p, d: 9)
    errs = {f: [f(p, d) for p, (d, _) in enumerate(layout)] for f in (src, e1, e2, e3)}
    make_run(tmp_path, "source", "md_easy", 0, src)
    make_run(tmp_path, "suta", "md_easy", 1, e1)
    make_run(tmp_path, "suta", "md_easy", 2, e2)
    make_run(tmp_path, "suta", "md_easy", 3, e3)
    make_run(tmp_path, "dsuta+dynamic", "md_easy", 1, lambda p, d: p % 7, resets=DYN_RESETS[1],
             lii=dynamic_lii(DYN_RESETS[1]))
    runs = report.collect_runs(tmp_path)
    figs = _figures(monkeypatch)
    assert plots.plot_wer_difference(runs, "md_easy", tmp_path / "d.png", window=4)
    [ax] = figs[-1].axes
    lines = {ln.get_label(): ln for ln in ax.lines}
    suta = sum(_trailing(errs[e], 4) for e in (e1, e2, e3)) / 3        # the mean over seeds
    np.testing.assert_allclose(lines["suta (n=3)"].get_ydata(), suta - _trailing(errs[src], 4))
    assert list(lines["suta (n=3)"].get_xdata()) == list(range(600))
    dyn = _trailing([p % 7 for p in range(600)], 4) - _trailing(errs[src], 4)
    np.testing.assert_allclose(lines["dsuta+dynamic (n=1)"].get_ydata(), dyn)
    marks = lines["resets of dsuta+dynamic (all seeds)"]
    assert list(marks.get_xdata()) == [205, 450]
    np.testing.assert_allclose(marks.get_ydata(), dyn[[205, 450]])
    assert not [name for name in lines if name.startswith("source")]
    assert sorted(ln.get_xdata()[0] for ln in ax.lines if ln.get_linestyle() == "--") == [200, 400]
    assert ax.get_title() == "md_easy: WER difference to source over time (window 4 utts)"
    # another baseline: the source is a curve like the others, against suta's mean
    plots.plot_wer_difference(runs, "md_easy", tmp_path / "d.png", window=4, baseline="suta")
    lines = {ln.get_label(): ln for ln in figs[-1].axes[0].lines}
    np.testing.assert_allclose(lines["source (n=1)"].get_ydata(), _trailing(errs[src], 4) - suta)
    assert "suta (n=3)" not in lines
    plots.plot_wer_difference(runs, "md_easy", tmp_path / "d.png", window=600)  # never fills:
    assert figs[-1].axes[0].get_title().endswith("(cumulative: the stream is no longer than the "
                                                 "600-utt window)")
    # the reset timeline: the run's resets on its row, the segments named at their middles
    assert plots.plot_reset_timeline(runs, "md_easy", tmp_path / "r.png")
    ax = figs[-1].axes[0]
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines
            if ln.get_marker() == "|"] == [([205, 450], [0, 0])]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["dsuta+dynamic seed 1"]
    assert [(t.get_position()[0], t.get_text()) for t in ax.texts] == [
        (100, "AA"), (300, "GS"), (500, "NB")]
    assert ax.get_xlim() == (0, 600)
    dynamic = next(r for r in runs if r.method == "dsuta+dynamic")
    kept = dynamic.transcripts
    dynamic.transcripts = [t for t in kept if t.position < 350]   # the last ones skipped:
    plots.plot_reset_timeline(runs, "md_easy", tmp_path / "r.png")
    assert figs[-1].axes[0].get_xlim() == (0, 401)                # the boundary at 400 shown
    dynamic.transcripts = kept
    # the LII histogram: 393 in-domain values of 0.1, 57 out-of-domain of 2.0 (test_split_lii)
    assert plots.plot_lii_histogram([dynamic], tmp_path / "l.png")
    ax = figs[-1].axes[0]
    for bars, label, at in zip(ax.containers, ("in-domain (n=393)", "out-of-domain (n=57)"),
                               (0.1, 2.0)):
        assert bars.patches[0].get_label() == label
        full = [p for p in bars.patches if p.get_height() > 0]
        assert len(full) == 1 and full[0].get_x() <= at <= full[0].get_x() + full[0].get_width()
        assert full[0].get_height() * full[0].get_width() == pytest.approx(1.0)   # a density


def test_the_steps_plot_shows_means_and_stds_over_seeds(tmp_path, monkeypatch):
    make_run(tmp_path, "source", "lsc_AA", 0, 6)
    make_run(tmp_path, "source", "lsc_AA", 1, 4)
    for steps, errs in ((1, (5, 4)), (5, (4, 2)), (10, (3, 3))):
        for seed, e in zip((1, 2), errs):
            make_run(tmp_path / f"n{steps}", "suta", "lsc_AA", seed, e, hparams={"steps": steps})
    runs = report.collect_runs(tmp_path)
    figs = _figures(monkeypatch)
    assert plots.plot_wer_vs_steps(runs, "lsc_AA", tmp_path / "s.png")
    ax = figs[0].axes[0]
    [bars] = ax.containers
    line, _, (spans,) = bars.lines
    assert list(line.get_xdata()) == [1, 5, 10] and list(line.get_ydata()) == [45.0, 30.0, 30.0]
    half = [(seg[1][1] - seg[0][1]) / 2 for seg in spans.get_segments()]
    np.testing.assert_allclose(half, [statistics.stdev([50, 40]), statistics.stdev([40, 20]), 0.0])
    assert [list(ln.get_ydata()) for ln in ax.lines if ln.get_linestyle() == ":"] == [[50.0, 50.0]]


def test_curves_of_one_colour_are_told_apart_by_their_line_styles(tmp_path, monkeypatch):
    """A tag's colour is hashed from its letters: a grid's tent_lr0.1_steps1 and
    tent_lr0.1_steps10 (a '0' more: 48, a multiple of the 8 colours) and tent_lr0.01_steps1 get
    one colour, and a tag run at two step counts (suta (N=1), suta (N=10)) one too; the
    WER-difference, long-stream and steps plots drew such curves in one colour and one line
    style, the same figure whichever was which. Pinned: each curve has its own (colour, line
    style); the first of a colour stays solid."""
    hashed = ["tent_lr0.1_steps1", "tent_lr0.1_steps10", "tent_lr0.01_steps1",
              "tent_lr0.01_steps10"]
    assert len({tags.color(t) for t in hashed}) == 1                      # the premise
    assert tags.color("tent_lr0.1") == tags.color("tent_lr0.01")
    make_run(tmp_path, "source", "lsc_AA", 0, 6)
    for steps, e in ((1, 5), (10, 3)):
        make_run(tmp_path / f"n{steps}", "suta", "lsc_AA", 1, e, hparams={"steps": steps})
    for i, tag in enumerate(hashed):
        make_run(tmp_path, tag, "lsc_AA", 1, i + 1, hparams={"steps": int(tag.split("steps")[1])})
    runs = report.collect_runs(tmp_path)
    figs = _figures(monkeypatch)

    def styles(lines, labels=None):
        lines = list(lines)
        return {name: (ln.get_color(), ln.get_linestyle())
                for name, ln in zip(labels or [ln.get_label() for ln in lines], lines)}
    plots.plot_wer_difference(runs, "lsc_AA", tmp_path / "d.png", window=4)
    drawn = styles(ln for ln in figs[-1].axes[0].lines if ln.get_label().endswith("(n=1)"))
    assert len(drawn) == 6 and len(set(drawn.values())) == 6, drawn
    assert drawn["suta (N=1) (n=1)"][1] == drawn["tent_lr0.01_steps1 (n=1)"][1] == "-"
    long.plot_long(runs, "lsc_AA", tmp_path / "l.png", window=4)
    drawn = styles(ln for ln in figs[-1].axes[0].lines if ln.get_label().endswith("(n=1)"))
    assert len(drawn) == 7 and len(set(drawn.values())) == 7, drawn
    plots.plot_wer_vs_steps(runs, "lsc_AA", tmp_path / "s.png")
    bars = figs[-1].axes[0].containers                      # (errorbar: its line is unnamed)
    drawn = styles([c.lines[0] for c in bars], [c.get_label() for c in bars])
    assert sorted(drawn) == ["suta", "tent_lr0.01", "tent_lr0.1"]
    assert len(set(drawn.values())) == 3, drawn


def test_cli_prints_main_table(results, tmp_path, capsys):
    out = tmp_path / "R.md"
    rc = report.main(["--exp_dir", str(results), "--out", str(out), "--no_plots"])
    assert rc == 0 and out.is_file()
    stdout = capsys.readouterr().out
    assert "|Method|lsc_AA|lsc_GS|md_easy|" in stdout and "33.3 ± 10.0 (n=3)" in stdout
    for opt, value, why in (("--digits", "-1", ">= 0"), ("--smooth", "0", ">= 1"),
                            ("--window", "-5", ">= 0")):
        with pytest.raises(SystemExit):                 # was a ValueError traceback (--digits)
            report.main(["--exp_dir", str(results), opt, value, "--no_plots"])
        assert f"{opt} {value}: must be an integer {why}" in capsys.readouterr().err


def test_cli_output_places_and_baseline_are_checked(results, tmp_path, capsys, caplog):
    """--out naming a folder was a traceback; a --plots_dir that cannot be made was a traceback
    logged for every plot; a mistyped --baseline silently plotted absolute WER."""
    folder = tmp_path / "out"
    folder.mkdir()
    assert report.main(["--exp_dir", str(results), "--out", str(folder), "--no_plots"]) == 1
    assert f"ERROR: cannot write {folder}: is a folder (--out names the RESULTS.md file) " \
        "(--out)" in capsys.readouterr().err and not list(folder.iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("")
    caplog.set_level("WARNING")
    out = tmp_path / "R.md"
    assert report.main(["--exp_dir", str(results), "--out", str(out), "--plots_dir",
                        str(blocker / "plots"), "--baseline", "sorce"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
                and not r.getMessage().startswith("Skipping")]
    assert warnings == [
        "--baseline 'sorce': no run has that tag (tags: alpha, awmc, dsuta, dsuta+dynamic, source, "
        "suta, zeta); the WER-over-time plots show absolute WER",
        f"No plots: cannot create {blocker / 'plots'} (Not a directory; --plots_dir)"]
    assert "## Plots" not in out.read_text() and "|Method|" in out.read_text()
    new = tmp_path / "new" / "R.md"                 # a folder not there yet: made
    assert report.main(["--exp_dir", str(results), "--out", str(new), "--no_plots"]) == 0
    assert "|Method|" in new.read_text()


def test_cli_baseline_is_the_one_the_difference_plots_take(tmp_path, monkeypatch):
    """``--baseline suta``: the difference curves are to suta's (mutation audit: a report that
    took the source whatever was given)."""
    make_run(tmp_path, "source", "lsc_AA", 0, 6)
    make_run(tmp_path, "suta", "lsc_AA", 1, 4)
    figs = _figures(monkeypatch)
    assert report.main(["--exp_dir", str(tmp_path), "--baseline", "suta", "--smooth", "10"]) == 0
    labels = {ax.get_ylabel() for fig in figs for ax in fig.axes}
    assert "WER difference to suta (% abs.)" in labels
    assert not any("to source" in label for label in labels)


def test_empty_root(tmp_path, capsys):
    with pytest.raises(report.NoRunsError, match="No experiment directory"):
        report.write_results(tmp_path)
    assert report.main(["--exp_dir", str(tmp_path / "missing")]) == 1
    assert "nothing to report" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "tta_brain.report", "--exp_dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "No experiment directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    (tmp_path / "RESULTS.md").write_text("# results of runs deleted since\n")
    assert report.main(["--exp_dir", str(tmp_path), "--no_plots"]) == 1
    err = capsys.readouterr().err                 # kept, but not passed off as current
    assert f"{tmp_path / 'RESULTS.md'} is an earlier report (written " in err
    assert "it does not describe the runs there now" in err
    assert (tmp_path / "RESULTS.md").read_text() == "# results of runs deleted since\n"


def test_damaged_bytes_in_a_record_name_the_file_and_a_damaged_memory_csv_keeps_the_run(
        tmp_path, caplog):
    """A record file that is not UTF-8 (a damaged copy) skips its run with one line naming the
    file and line (it stopped the whole report with a traceback); a damaged ``memory.csv``, a
    diagnostic, costs the run's memory figures, not its WER."""
    bad = make_run(tmp_path, "suta", "md_easy", 0, 1)
    kept = make_run(tmp_path, "source", "md_easy", 0, 2)
    with open(bad / "transcripts.csv", "ab") as f:
        f.write(b"\xff\xfe\n")
    (kept / "memory.csv").write_text("position,rss_mb,cuda_mb\n49,\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        runs = report.collect_runs(tmp_path)
    assert [r.name for r in runs] == ["md_easy/source/0"]
    n = len((bad / "transcripts.csv").read_bytes().splitlines())
    assert any(f"transcripts.csv:{n}: not UTF-8 text" in m for m in caplog.messages), caplog.messages
    assert any("memory.csv:2: rss_mb '' is not float" in m and "memory figures left out" in m
               for m in caplog.messages)
    assert runs[0].memory == [] and "rss_mb" in runs[0].memory_error
    from tta_brain.run.records import RecordError, read_transcripts
    with pytest.raises(RecordError, match=f"transcripts.csv:{n}: not UTF-8"):
        read_transcripts(bad)
    text = long.write_long_report(runs, tmp_path, "md_easy", plots=False).read_text()
    assert "samples in memory.csv): md_easy/source/0 (memory.csv unreadable)." in text


def test_a_record_line_past_csvs_field_limit_names_its_own_line(tmp_path):
    """A record file with a damaged line too long for csv (bytes without a line end, a block of
    NULs left by a crash) is one line naming the file and that line: it named the line before it
    (csv.DictReader's count, of the rows read before the bad one)."""
    d = make_run(tmp_path, "suta", "md_easy", 0, 1)
    path = d / "transcripts.csv"
    with open(path, "ab") as f:
        f.write(b"\0" * 200_000 + b"\n")
    n = len(path.read_bytes().splitlines())
    with pytest.raises(records.RecordError,
                       match=f"transcripts.csv:{n}: malformed CSV: field larger than field limit"):
        records.read_transcripts(d)
    path.write_bytes(b"position,ID\n" + b"\0" * 200_000)           # right after the header
    with pytest.raises(records.RecordError, match="transcripts.csv:2: malformed CSV"):
        records.read_transcripts(d)


def test_a_record_line_cut_short_says_how_many_of_its_fields_it_has(tmp_path):
    """A line that stops before the header's last column (a copy cut short mid-line) names the
    fields it has, the header's count and the first one missing."""
    (tmp_path / "memory.csv").write_text("position,rss_mb,cuda_mb\n4,512.0,0.0\n9,513.5\n",
                                         encoding="utf-8")
    with pytest.raises(records.RecordError,
                       match=r"memory\.csv:3: 2 of the header's 3 fields, no 'cuda_mb' "
                             r"\(the line is cut short\)"):
        records.read_memory(tmp_path)


def test_a_grids_steps_sweep_gets_its_steps_table_and_reference(tmp_path):
    """The grid names a steps sweep's runs suta_steps1 / suta_steps10: they were two methods, so
    RESULTS.md had no "WER vs adaptation steps" table and every efficiency ratio was '-'."""
    make_run(tmp_path, "suta_steps1", "lsc_AA", 0, 2, time_per_audio=0.02, hparams={"steps": 1})
    make_run(tmp_path, "suta_steps10", "lsc_AA", 0, 3, time_per_audio=0.08,
             hparams={"steps": 10})
    make_run(tmp_path, "dsuta_steps1", "lsc_AA", 0, 2, time_per_audio=0.04,
             hparams={"steps": 1})
    runs = report.collect_runs(tmp_path)
    rows = table_rows(tables.table_steps(runs).split("\n\n", 1)[1])
    assert rows == [["Method", "N=1", "N=10"], ["suta", "20.0 (n=1)", "30.0 (n=1)"]]
    eff = tables.table_efficiency(runs, "lsc_AA")
    assert "Time x SUTA_STEPS10" in eff
    assert {r[0]: r[7] for r in table_rows(eff)[1:]} == {
        "dsuta_steps1": "0.50", "suta_steps1": "0.25", "suta_steps10": "1.00"}
    assert tags.without_steps("suta_steps10_lr0.1") == "suta_lr0.1"
    assert tags.without_steps("suta_stepsize") == "suta_stepsize"
    assert tags.without_steps("suta_steps10") == "suta"                  # at the end too
    assert tags.without_steps("suta_steps10k_lr0.1") == "suta_steps10k_lr0.1"   # no steps option


def test_pooled_runs_are_checked_though_the_first_has_no_fingerprint(tmp_path):
    """The check compared every run with the first one only, and skipped the cell when that
    one had no fingerprint: three suta runs at three learning rates were one cell, unwarned."""
    for seed, fp in ((0, {}), (1, {"hparams": {"seed": 1, "lr": 3e-4}}),
                     (2, {"hparams": {"seed": 2, "lr": 1e-2}})):
        d = make_run(tmp_path, "suta", "md_easy", seed, 1)
        summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint=fp))
    said = report.pooling_warnings(report.collect_runs(tmp_path))
    assert len(said) == 1 and said[0].startswith(
        "suta on md_easy: settings other than the seed differ (hparams.lr) and 1 run(s) record "
        "no settings to compare (md_easy/suta/0: no fingerprint in summary.json) across its 3 "
        "runs"), said


def test_a_method_at_several_step_counts_is_checked_per_step_count(tmp_path):
    """The tables split a method run at several step counts into rows ``suta (N=5)``, ``suta
    (N=10)``: each row's seeds are checked apart (pooled, seed 0 was "more than once" and the
    steps "settings that differ"), and a row whose seeds differ in lr is still named."""
    for steps, lrs in ((5, (1e-4, 1e-4)), (10, (1e-4, 2e-4))):
        for seed, lr in enumerate(lrs):
            d = make_run(tmp_path / f"n{steps}", "suta", "md_easy", seed, 1,
                         hparams={"steps": steps})
            summary.write_summary(d, dataclasses.replace(summary.read_summary(d), fingerprint={
                "hparams": {"seed": seed, "steps": steps, "lr": lr}}))
    runs = report.collect_runs(tmp_path)
    assert [r[0] for r in table_rows(tables.table_main(runs))[1:]] == ["suta (N=5)", "suta (N=10)"]
    said = report.pooling_warnings(runs)
    assert len(said) == 1 and said[0].startswith(
        "suta (N=10) on md_easy: settings other than the seed differ (hparams.lr) across its 2 runs "
        "(n10/md_easy/suta/0, n10/md_easy/suta/1)"), said


def test_a_summary_that_is_no_object_and_long_md_lists_what_it_left_out(tmp_path, capsys):
    """summary.json holding ``null`` or ``5`` was a TypeError traceback (report and
    compare_runs); LONG.md left unreadable runs out without a word (RESULTS.md lists them)."""
    make_run(tmp_path, "source", "md_easy", 0, 2)
    for i, text in enumerate(("null", "5")):
        bad = make_run(tmp_path, "suta", "md_easy", i, 2)
        (bad / "summary.json").write_text(text)
    skipped = []
    runs = report.collect_runs(tmp_path, skipped)
    assert [r.name for r in runs] == ["md_easy/source/0"]
    assert sorted(skipped) == [
        ("md_easy/suta/0", f"{tmp_path}/md_easy/suta/0/summary.json: not a summary (a JSON "
                           "NoneType, not an object)"),
        ("md_easy/suta/1", f"{tmp_path}/md_easy/suta/1/summary.json: not a summary (a JSON "
                           "int, not an object)")]
    assert long.main(["--exp_dir", str(tmp_path), "--stream", "md_easy", "--no_plots"]) == 0
    text = (tmp_path / "LONG.md").read_text()
    assert "## Not reported" in text and "- `md_easy/suta/1`: " in text
    sys.path.insert(0, str(REPO / "tools"))
    import compare_runs
    assert compare_runs.main([str(tmp_path), str(tmp_path)]) == 1
    assert "not a summary (a JSON NoneType" in capsys.readouterr().out


def test_a_long_method_tag_gets_a_file_name_that_fits():
    """A 260-character tag was 'File name too long' for its LII plot (a traceback)."""
    long_tag = "dsuta+dynamic_" + "x" * 250
    name = plots.safe_name(long_tag)
    assert len(name.encode()) <= plots.MAX_PART and name.startswith("dsuta_dynamic_xxx")
    assert name != plots.safe_name(long_tag + "y")          # still one file per tag
    assert plots.safe_name("md_easy") == "md_easy"


def test_utterances_every_run_skipped_are_said(tmp_path):
    """Runs that all skipped the same utterances (a too-short audio, an empty reference) gave
    WERs over fewer utterances than the stream holds, and RESULTS.md said nothing of it (no
    warning: the runs agree); now the notes say so and the Runs table counts each run's skips."""
    for method in ("source", "suta"):
        d = make_run(tmp_path, method, "md_easy", 0, 1)
        skips = [{"position": 3, "ID": "utt00003", "reason": "too short for the model"}]
        summary.write_summary(d, dataclasses.replace(summary.read_summary(d), n_skipped=1,
                                                     skipped=skips))
    runs = report.collect_runs(tmp_path)
    md = report.build_markdown(runs)
    assert "are in no WER: 2 in all" in section(md, "WER (%) per method and stream")
    rows = table_rows(section(md, "Runs"))
    assert rows[0][5:7] == ["Utts", "Skipped"] and [r[6] for r in rows[1:]] == ["1", "1"]
    make_run(tmp_path / "none", "source", "md_easy", 0, 1)
    assert "in no WER" not in report.build_markdown(report.collect_runs(tmp_path / "none"))


def test_digits_reach_the_espnet_tables(tmp_path):
    """--digits gave the other tables' WERs 2 decimals and left the ESPnet tables' Err (the same
    WER) at 1: 13.40 beside 13.4."""
    make_run(tmp_path, "source", "lsc_AA", 0, lambda p, d: 1 if p % 3 else 2)
    runs = report.collect_runs(tmp_path)
    md = report.build_markdown(runs, digits=2)
    wer = table_rows(section(md, "Runs"))[1][-1]
    assert wer == "13.40"
    assert table_rows(section(md, "Per-experiment scores"))[1][7] == wer
    assert table_rows(section(report.build_markdown(runs), "Per-experiment scores"))[1][7] == "13.4"


def test_digits_reach_means_and_stds_of_every_wer_table(tmp_path):
    """--digits: the means and stds over seeds of the main, Table 1 and steps tables (two seeds
    of 10.0 and 13.4 %); the efficiency table counts each cell's runs (mutation audit)."""
    for steps in (1, 2):
        for seed, errs in ((1, 1), (2, lambda p, d: 1 if p % 3 else 2)):
            make_run(tmp_path / f"n{steps}", "suta", "lsc_AA", seed, errs,
                     hparams={"steps": steps})
    runs = report.collect_runs(tmp_path)
    md = report.build_markdown(runs, digits=2)
    wers = [10.0, 13.4]
    cell = f"{statistics.fmean(wers):.2f} ± {statistics.stdev(wers):.2f} (n=2)"
    assert cell == "11.70 ± 2.40 (n=2)"
    assert table_rows(section(md, "WER (%) per method and stream"))[1:] == [
        ["suta (N=1)", cell], ["suta (N=2)", cell]]
    assert table_rows(section(md, "WER (%) on single-domain streams"))[1] == [
        "suta (N=1)", cell, "11.70"]
    assert table_rows(section(md, "WER (%) vs number of adaptation steps"))[1] == [
        "suta", cell, cell]
    eff = table_rows(section(md, "Efficiency"))
    assert eff[0][-1] == "Runs" and [r[-1] for r in eff[1:]] == ["2", "2"]


def test_wer_file_counts_insertions_and_deletions_of_the_hypothesis(tmp_path):
    """wer.txt scores each hypothesis against its reference: a word the hypothesis adds is an
    insertion, one it lacks a deletion (by hand: 1 ins + 2 del + 1 sub of 7 words)."""
    def t(i, ref, hyp):
        return records.Transcript(i, f"u{i}", "d", 0, 1.0, ref, hyp, 0, 0, 0, 0, 0)
    records.write_wer_file(tmp_path, [t(0, "A B C", "A B C D"), t(1, "E F G H", "E X")])
    head = (tmp_path / "wer.txt").read_text().splitlines()[0]
    assert "[ 4 / 7, 1 ins, 2 del, 1 sub ]" in head, head


def test_lii_values_round_trip_through_lii_csv(tmp_path):
    """lii.csv keeps an LII to 6 significant digits (they are about 1e-4 to 1e-2 apart)."""
    writer = records.RecordWriter(tmp_path)
    values = [0.0123456789, -0.000987654321, 1.23456789]
    for p, v in enumerate(values):
        writer.lii(p, v, "construction" if p < 2 else "detection")
    writer.close()
    rows = records.read_lii(tmp_path)
    assert [(r.position, r.stage) for r in rows] == [(0, "construction"), (1, "construction"),
                                                     (2, "detection")]
    assert [r.lii for r in rows] == [pytest.approx(v, rel=1e-5) for v in values]


# ------------------------------------------- the numbers recomputed by hand (statistics module)
# from the runs' own counts (mutation audit of tta_brain.report.tables)
def _wer(transcripts):
    return 100.0 * sum(t.n_err for t in transcripts) / sum(t.n_words for t in transcripts)


def test_per_domain_cells_pool_counts_and_a_run_without_a_domain_is_left_out(tmp_path):
    """Per-domain table of md_easy: the "all" column is each run's WER over its own counts (not
    the mean of its domain WERs: one run skipped most of NB), and a run that scored no NB
    utterance is left out of NB's cell (it was counted as 0 %)."""
    errs = {"AA": 1, "GS": 4, "NB": 9}
    for seed in (1, 2, 3):
        make_run(tmp_path, "suta", "md_easy", seed, lambda p, d, s=seed: min(errs[d] + s - 1, 10))
    runs = report.collect_runs(tmp_path)
    by_seed = {r.seed: r for r in runs}
    by_seed[2].transcripts = [t for t in by_seed[2].transcripts         # NB mostly skipped
                              if t.domain != "NB" or t.position % 10 == 0]
    by_seed[3].transcripts = [t for t in by_seed[3].transcripts if t.domain != "NB"]
    rows = table_rows(tables.table_breakdown(runs, "md_easy"))
    assert rows[0] == ["Method", "AA", "GS", "NB", "all"]
    cell = dict(zip(rows[0], rows[1]))

    def stat(values):
        return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f} (n={len(values)})"
    alls = [_wer(by_seed[s].transcripts) for s in (1, 2, 3)]
    nb = [_wer([t for t in by_seed[s].transcripts if t.domain == "NB"]) for s in (1, 2)]
    assert cell["all"] == stat(alls)
    assert cell["NB"] == stat(nb) == "95.0 ± 7.1 (n=2)"


def test_a_domains_wer_pools_the_counts_of_its_utterances(tmp_path):
    """A domain's WER is its errors over its reference words (utterances of 10 and 20 words,
    one error each: 2 of 30, 6.7 %), not the mean of its utterances' WERs (7.5 %)."""
    make_run(tmp_path, "suta", "md_easy", 0, 1)
    runs = report.collect_runs(tmp_path)
    runs[0].transcripts = [dataclasses.replace(t, n_words=20 if t.position % 2 else 10)
                           for t in runs[0].transcripts]
    by_domain = tables.run_domain_wer(runs[0])
    assert by_domain == {d: _wer([t for t in runs[0].transcripts if t.domain == d])
                         for d in ("AA", "GS", "NB")}
    assert table_rows(tables.table_breakdown(runs, "md_easy"))[1][1:] == ["6.7 (n=1)"] * 4


def test_mean_delay_and_wall_time_are_means_over_what_they_average(tmp_path):
    """Reset table: the mean delay of three detected boundaries (1, 10, 61: 24.0; the median
    is 10). Efficiency: the wall time of a cell is the mean over its runs (it was summed)."""
    make_run(tmp_path, "suta", "md_easy", 1, 1, resets=[201, 410], time_per_audio=0.02)
    make_run(tmp_path, "suta", "md_easy", 2, 1, time_per_audio=0.06)
    runs = report.collect_runs(tmp_path)
    run = runs[0]
    run.summary = dataclasses.replace(run.summary, boundaries=[100, 200, 400])
    run.resets = [101, 210, 461]
    row = table_rows(tables.table_resets(runs, "md_easy"))[1]
    assert row[2:] == ["101, 210, 461", "3", "3/3", "0",
                       f"{statistics.fmean([1, 10, 61]):.1f}"]
    eff = table_rows(tables.table_efficiency(runs, "md_easy"))
    cells = dict(zip(eff[0], eff[1]))
    walls = [r.summary.wall_time_s for r in runs]
    assert cells["Wall time (s)"] == f"{statistics.fmean(walls):.1f}" == "48.0"


def test_a_stream_of_several_domains_in_one_segment_is_not_single_domain(tmp_path):
    """One's own manifest with a domain column and no segment column: no true boundary, but
    two domains; it gets its per-domain table, not a column of the single-domain table titled
    by its first domain."""
    make_run(tmp_path, "suta", "own", 0, lambda p, dom: 2 if p < 50 else 6)
    runs = report.collect_runs(tmp_path)
    runs[0].transcripts = [dataclasses.replace(t, domain="B" if t.position < 50 else "A")
                           for t in runs[0].transcripts]
    assert runs[0].boundaries == [] and not tables.is_single_domain(runs[0])
    text = report.build_markdown(runs)
    assert "single-domain streams" not in text
    assert table_rows(section(text, "Per-domain WER (%) on own")) == [     # in stream order
        ["Method", "B", "A", "all"], ["suta", "20.0 (n=1)", "60.0 (n=1)", "40.0 (n=1)"]]
    # nor one of one domain in two segments (a true boundary at 50): no column of Table 1
    # averaged with the single-domain streams (mutation audit)
    runs[0].transcripts = [dataclasses.replace(t, domain="A") for t in runs[0].transcripts]
    runs[0].summary = dataclasses.replace(runs[0].summary, boundaries=[50])
    assert not tables.is_single_domain(runs[0])
    text = report.build_markdown(runs)
    assert "single-domain streams" not in text and "Per-domain WER (%) on own" in text


def test_single_domain_streams_of_one_domain_are_titled_by_stream(tmp_path):
    """Two single-domain streams of the same domain (AA): their columns are titled by stream,
    not both "AA"."""
    make_run(tmp_path, "suta", "lsc_AA", 0, 1)
    make_run(tmp_path, "suta", "noisy_AA", 0, 3)
    rows = table_rows(tables.table_domains(report.collect_runs(tmp_path)))
    assert rows == [["Method", "lsc_AA", "noisy_AA", "Avg"],
                    ["suta", "10.0 (n=1)", "30.0 (n=1)", "20.0"]]
