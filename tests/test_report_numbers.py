"""The report's numbers recomputed by hand (statistics module) from the runs' own counts
(mutation audit of tta_brain.report.tables: each test names the mutants it kills)."""
import dataclasses
import statistics

from test_report import make_run, table_rows
from tta_brain.report import results as report, tables


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


def test_single_domain_streams_of_one_domain_are_titled_by_stream(tmp_path):
    """Two single-domain streams of the same domain (AA): their columns are titled by stream,
    not both "AA"."""
    make_run(tmp_path, "suta", "lsc_AA", 0, 1)
    make_run(tmp_path, "suta", "noisy_AA", 0, 3)
    rows = table_rows(tables.table_domains(report.collect_runs(tmp_path)))
    assert rows == [["Method", "lsc_AA", "noisy_AA", "Avg"],
                    ["suta", "10.0 (n=1)", "30.0 (n=1)", "20.0"]]
