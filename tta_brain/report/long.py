"""Long streams at a glance: collapse figures per run, memory along the stream, one plot.

    python -m tta_brain.report.long --exp_dir exp/long3000/snr20 [--stream md_long] [--window 100]
        [--margin 5] [--out exp/long3000/snr20/LONG.md] [--metric wer|cer|wer_official]
        [--methods "suta dsuta dsuta+dynamic"] [--plots_dir exp/long3000/snr20/plots]

Per run (the paper's MD-Long table, one row per method and seed): the WER, and two collapse
figures on the windowed WER (errors / reference words over the last ``window`` utterances, full
windows only): the **worst window** (its WER and where it ends), and the **first position where
the windowed WER exceeds the source model's by more than ``margin`` points** ("never" if it does
not; "no full N-utt window" for a stream shorter than a window); against the source, the
**largest gap** (run minus source over the windows both have) and the **share of windows below
it**; the **resets** with their positions. The source curve is the ``source`` run of the same
stream file and model (same seed when there is one), both over the utterances both scored. Rows and curves are
labelled as in RESULTS.md (``dsuta (N=1)`` for a method run with several step counts), each row
names its folder, and runs pooled as seeds that are not are listed under ``## Warnings``.
Memory: the process RSS sampled along the stream (``memory.csv``) and its least-squares slope over
the second half of the samples, per 1,000 utterances (on a GPU also that of torch's CUDA memory);
a run is *flat* when that slope is at most ``--flat_mib`` (default 5 MiB per 1,000 utterances,
the 0.5 MiB per 100 of ``tools/bench_memory.py``), judged from 10 samples (500 utterances) on.

The plot (``plots/long_<stream>.png``): windowed WER over stream position per method (mean over
seeds), the domain blocks shaded and labelled, dynamic (detected) resets as markers on their
curve; below it, RSS over position per run. ``--metric cer``: all of it of character error rates
(``LONG_cer.md``, ``plots/long_cer_<stream>.png``; ``--margin`` in CER points); ``--metric
wer_official``: of the official code's word scoring (apostrophes deleted).
"""
import argparse
import errno
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tta_brain.data.cache import same_source
from tta_brain.report import tags
from tta_brain.report.tables import (METRICS, label as metric_label, _label_key, common_positions, fmt, in_metric,
                                     label_text, md_table, method_labels, position_counts,
                                     run_wer)
from tta_brain.run.folder import Run

logger = logging.getLogger("tta_brain.report.long")

WINDOW = 100        # utterances (the windows of 100 of issue #21's measurement)
MARGIN = 5.0        # WER points above the source model's windowed WER that count as collapse
FLAT_MIB = 5.0      # MiB per 1,000 utterances: a larger RSS slope is growth
MIN_SAMPLES = 10    # memory samples (every 50 utterances: 500) before flatness is judged


# ------------------------------------------------------------------------------------------------
# pure figures
# ------------------------------------------------------------------------------------------------
def windowed_wer(n_err: Sequence[float], n_words: Sequence[float],
                 window: int = WINDOW) -> np.ndarray:
    """WER (%) of the ``window`` utterances ending at each position; NaN before the first full
    window and where a window has no reference words."""
    from tta_brain.report.plots import smoothed_wer
    curve = smoothed_wer(n_err, n_words, window)
    curve[:max(int(window), 1) - 1] = np.nan
    return curve


def worst_window(curve: Sequence[float]) -> Tuple[Optional[float], Optional[int]]:
    """``(largest windowed WER, the position its window ends at)``; ``(None, None)`` if none."""
    curve = np.asarray(curve, dtype=float)
    if not np.isfinite(curve).any():
        return None, None
    at = int(np.nanargmax(curve))
    return float(curve[at]), at


def first_above(curve: Sequence[float], reference: Sequence[float],
                margin: float = MARGIN) -> Optional[int]:
    """First position where ``curve`` exceeds ``reference`` by more than ``margin`` points (both
    defined there), or None (never). Positions past the shorter curve are not compared."""
    n = min(len(curve), len(reference))
    diff = np.asarray(curve[:n], dtype=float) - np.asarray(reference[:n], dtype=float)
    with np.errstate(invalid="ignore"):
        hits = np.nonzero(diff > margin)[0]
    return int(hits[0]) if hits.size else None


def gap_to(curve: Sequence[float], reference: Sequence[float]
           ) -> Tuple[Optional[float], Optional[float]]:
    """``(largest gap, share of windows below)``: the largest ``curve - reference`` over the
    positions where both are defined (negative: always below the reference), and the percentage
    of those windows where ``curve`` is below it; ``(None, None)`` where none is defined."""
    n = min(len(curve), len(reference))
    diff = np.asarray(curve[:n], dtype=float) - np.asarray(reference[:n], dtype=float)
    diff = diff[np.isfinite(diff)]
    if not diff.size:
        return None, None
    return float(diff.max()), 100.0 * float((diff < 0).mean())


def memory_slope(positions: Sequence[float], values: Sequence[float]) -> Optional[float]:
    """Least-squares slope of ``values`` over the second half of the samples, per 1,000
    utterances (the first half holds the warm-up: RSS rises for the first ~250 utterances);
    None with fewer than :data:`MIN_SAMPLES` samples."""
    x, y = np.asarray(positions, dtype=float), np.asarray(values, dtype=float)
    if len(x) < MIN_SAMPLES:
        return None
    x, y = x[len(x) // 2:], y[len(y) // 2:]
    if np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0] * 1000.0)


# ------------------------------------------------------------------------------------------------
# runs -> figures, table, plot
# ------------------------------------------------------------------------------------------------
def run_curve(run: Run, window: int = WINDOW, only=None) -> np.ndarray:
    """The run's windowed WER indexed by stream position (NaN at positions it did not decode);
    ``only``: the positions counted (``tables.common_positions``)."""
    if not run.transcripts:
        return np.full(0, np.nan)
    return windowed_wer(*position_counts(run, only), window)


def _stream_sha1(run: Run) -> Optional[str]:
    return (run.summary.fingerprint or {}).get("stream_sha1")


def _source_for(run: Run, runs: Sequence[Run]) -> Optional[Run]:
    """The ``source`` run of ``run``'s stream (same seed when there is one): of the same stream
    file and source model where the fingerprints say (two SNRs' folders hold streams of one name;
    two models' runs in one folder), else of the same stream name."""
    same = [r for r in runs if r.stream == run.stream and r.method == "source"]
    sha = _stream_sha1(run)
    if sha:
        same = [r for r in same if _stream_sha1(r) in (sha, None)]
    model = run.source_model
    if model:                           # and of the same source model where both record it
        same = [r for r in same if r.source_model is None or same_source(r.source_model, model)]
    return next((r for r in same if r.seed == run.seed), same[0] if same else None)


def collapse_figures(run: Run, source: Optional[Run], window: int = WINDOW,
                     margin: float = MARGIN) -> Dict:
    """WER, worst window (WER, position), first position above source + margin, RSS slope."""
    curve = run_curve(run, window)
    worst, at = worst_window(curve)
    out = {"wer": run_wer(run), "worst": worst, "worst_at": at, "first_above": None,
           "has_source": source is not None, "compared": False, "rss_slope": None, "rss": None,
           "cuda_slope": None, "gap": None, "below": None}
    if source is not None:              # over the utterances both scored (a skip in neither)
        both = common_positions([run, source])
        mine, reference = run_curve(run, window, both), run_curve(source, window, both)
        n = min(len(mine), len(reference))
        # "never" only where windows were compared: a stream shorter than a window has none
        out["compared"] = bool((np.isfinite(mine[:n]) & np.isfinite(reference[:n])).any())
        out["first_above"] = first_above(mine, reference, margin)
        out["gap"], out["below"] = gap_to(mine, reference)
    if run.memory:
        out["rss_slope"] = memory_slope([m.position for m in run.memory],
                                        [m.rss_mb for m in run.memory])
        out["rss"] = (run.memory[0].rss_mb, run.memory[-1].rss_mb)
        if any(m.cuda_mb for m in run.memory):        # a GPU run: its device memory too
            out["cuda_slope"] = memory_slope([m.position for m in run.memory],
                                             [m.cuda_mb for m in run.memory])
    return out


def _unjudged(run: Run) -> str:
    """Why a run's memory is not judged: its ``memory.csv`` is damaged, absent or short."""
    if run.memory_error:
        return "memory.csv unreadable"
    if not run.memory:
        return ("memory.csv holds no sample" if (Path(run.dir) / "memory.csv").is_file()
                else "no memory.csv: a run written before it existed")
    return f"{len(run.memory)} sample{'s' * (len(run.memory) != 1)}"


def table_long(runs: Sequence[Run], stream: str, window: int = WINDOW, margin: float = MARGIN,
               flat_mib: float = FLAT_MIB, metric: str = "wer") -> Tuple[str, List[str]]:
    """The Markdown table of ``stream``, the runs whose RSS is not flat and those with too few
    memory samples to tell (``metric="cer"``: runs from ``tables.in_metric``)."""
    rows, not_flat, unknown = [], [], []
    sruns = [r for r in runs if r.stream == stream]
    labels = method_labels(sruns)
    for r in sruns:
        f = collapse_figures(r, _source_for(r, runs), window, margin)
        if r.method == "source":
            above = "-"
        elif not f["has_source"]:
            above = "no source run"
        elif not f["compared"]:
            above = f"no full {window}-utt window"
        else:
            above = "never" if f["first_above"] is None else str(f["first_above"])
        slope, cuda = f["rss_slope"], f["cuda_slope"]
        if slope is None:
            unknown.append(r.name)
        elif max(slope, cuda or 0.0) > flat_mib:
            not_flat.append(r.name)
        rss = "-" if f["rss"] is None else f"{f['rss'][0]:.0f} -> {f['rss'][1]:.0f}"
        compared = r.method != "source" and f["gap"] is not None
        rows.append([label_text(labels[id(r)]), str(r.seed), str(len(r.transcripts)),
                     fmt(f["wer"]),
                     "-" if f["worst"] is None else f"{fmt(f['worst'])} @ {f['worst_at']}",
                     above, _signed(f["gap"]) if compared else "-",
                     f"{f['below']:.1f} %" if compared else "-", _resets(r.resets), rss,
                     "-" if slope is None else _signed(slope)
                     + ("" if cuda is None else f" (CUDA {_signed(cuda)})"), r.name])
    header = ["method", "seed", "utts", f"{metric_label(metric)} %", f"worst {window}-utt window (ends at)",
              f"first position > source + {margin:g}", "largest gap to source",
              "windows below source", "resets (positions)", "RSS MiB (first -> last)",
              "RSS slope MiB / 1k utts", "run"]
    return md_table(header, rows), not_flat, unknown


def _resets(positions: Sequence[int], shown: int = 8) -> str:
    """``n (p1, p2, ...)``: the count and the first ``shown`` positions (``...`` for more)."""
    if not positions:
        return "0"
    listed = ", ".join(map(str, positions[:shown])) + (", ..." if len(positions) > shown else "")
    return f"{len(positions)} ({listed})"


def _signed(value: float) -> str:
    return f"{round(value, 1) + 0.0:+.1f}"      # (+ 0.0: no "-0.0")


def _mean_curves(runs: Sequence[Run], window: int) -> Dict[str, Tuple[np.ndarray, List[Run]]]:
    """label text (``suta (N=1)`` where a method ran with several step counts, as RESULTS.md)
    -> (mean windowed curve over its runs, the runs)."""
    labels = method_labels(runs)
    by: Dict[tuple, List[Run]] = {}
    for r in runs:
        by.setdefault(labels[id(r)], []).append(r)
    out = {}
    for label in sorted(by, key=_label_key):
        curves = [run_curve(r, window) for r in by[label]]
        n = min(len(c) for c in curves)
        with warnings.catch_warnings():     # all-NaN columns (before the first window) stay NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            out[label_text(label)] = (np.nanmean(np.stack([c[:n] for c in curves]), axis=0),
                                      by[label])
    return out


def plot_long(runs: Sequence[Run], stream: str, out_png, window: int = WINDOW,
              metric: str = "wer") -> Optional[str]:
    """Windowed WER over position per method with shaded, labelled domain blocks and reset
    markers; RSS per run below."""
    from tta_brain.report.plots import _save, _segments, colormap, line_style, subplots
    sruns = [r for r in runs if r.stream == stream and r.transcripts]
    if not sruns:
        return None
    has_mem = any(r.memory for r in sruns)
    fig, axes = subplots(2 if has_mem else 1, 1, figsize=(13, 6.5 if has_mem else 4.8),
                             sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1] if has_mem else [1]})
    ax = axes[0][0]
    segs = _segments(max(sruns, key=lambda r: len(r.transcripts)))
    domains = sorted({d for _, _, d in segs})
    shade = {d: colormap("Pastel1")(i % 9) if i < 9 else colormap("Pastel2")(i % 8)
             for i, d in enumerate(domains)}
    end = segs[-1][1]
    for start, stop, domain in segs:
        for a in [x[0] for x in axes]:
            a.axvspan(start, stop, color=shade[domain], alpha=0.6, linewidth=0)
        if stop - start >= end / 60:
            ax.text((start + stop) / 2, 1.01, domain, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7)
    used: Dict[str, int] = {}     # a method's step counts, tags of one colour: other dashes
    for label, (curve, lruns) in _mean_curves(sruns, window).items():
        method = lruns[0].method
        ax.plot(np.arange(len(curve)), curve, color=tags.color(method), linewidth=1.2,
                linestyle=line_style(tags.color(method), used), label=f"{label} (n={len(lruns)})")
        if method != "source" and not method.endswith(("+fixed", "+oracle")):
            resets = sorted({p for r in lruns for p in r.resets if 0 <= p < len(curve)})
            ok = [p for p in resets if np.isfinite(curve[p])]
            if ok:
                ax.plot(ok, curve[ok], linestyle="none", marker="v", markersize=6,
                        color=tags.color(method), markeredgecolor="k")
    ax.set_ylabel(f"{metric_label(metric)} % (last {window} utts)")
    ax.set_title(f"{stream}: windowed {metric_label(metric)} over the stream (shaded: domain blocks; "
                 f"v: resets detected by the method)", pad=18)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if has_mem:
        mem = axes[1][0]
        for r in sruns:
            if r.memory:
                mem.plot([m.position for m in r.memory], [m.rss_mb for m in r.memory],
                         color=tags.color(r.method), linewidth=1.0)
        mem.set_ylabel("RSS MiB")
        mem.grid(alpha=0.3)
    axes[-1][0].set_xlabel("stream position (utterances)")
    axes[-1][0].set_xlim(0, end)
    return _save(fig, Path(out_png))


def write_long_report(runs: Sequence[Run], root, stream: str = "md_long", out=None,
                      window: int = WINDOW, margin: float = MARGIN, flat_mib: float = FLAT_MIB,
                      plots: bool = True, metric: str = "wer", skipped=(),
                      plots_dir=None) -> Path:
    """``LONG.md`` (table + memory verdict + plot link) for ``stream``; returns its path.
    ``metric="cer"``: of character error rates, ``LONG_cer.md`` by default; ``skipped``: the
    run folders ``collect_runs`` left out (listed under "Not reported", as RESULTS.md does)."""
    root = Path(root)
    out = Path(out) if out else root / ("LONG.md" if metric == "wer" else f"LONG_{metric}.md")
    runs = in_metric(runs, metric)
    sruns = [r for r in runs if r.stream == stream]
    if not sruns:
        have = sorted({r.stream for r in runs})
        raise ValueError(f"no finished run of stream {stream!r} under {root}"
                         + (f" (streams there: {', '.join(have)}; --stream)" if have else ""))
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder (--out names the LONG.md file)",
                                str(out))
    table, not_flat, unknown = table_long(runs, stream, window, margin, flat_mib, metric)
    n = max(len(r.transcripts) for r in sruns)
    M, units = metric_label(metric), ("errors / words" if metric != "cer"
                                else "character edits / characters (spaces counted)")
    lines = [f"# {stream}: {n} utterances, {len(sruns)} runs", "",
             f"Windowed {M}: {units} over the last {window} utterances (full windows "
             f"only). Collapse figures: the worst window, and the first position where a run's "
             f"windowed {M} exceeds the source model's by more than {margin:g} points; "
             f"against the source, the largest gap (a run's windowed {M} minus the source's, "
             f"over the windows both have) and the share of those windows where the run is "
             f"below it; the resets with their first positions.", "",
             table, ""]
    rule = (f"RSS (and CUDA memory) slope over the second half of the stream at most "
            f"{flat_mib:g} MiB per 1,000 utterances")
    if not_flat:
        lines.append(f"**Memory grows** ({rule} is flat): {', '.join(not_flat)}.")
    elif not unknown:
        lines.append(f"Memory: flat in every run ({rule}).")
    if unknown:
        why = {r.name: _unjudged(r) for r in sruns}
        lines.append(f"Memory not judged (fewer than {MIN_SAMPLES} samples in memory.csv): "
                     f"{', '.join(f'{name} ({why[name]})' for name in unknown)}.")
    from tta_brain.report.results import pooling_warnings, run_warnings
    pooled = pooling_warnings(sruns) + run_warnings(sruns)
    if pooled:
        lines += ["", "## Warnings", "\n".join(f"- {w}" for w in pooled)]
    if skipped:               # (only on stderr before: the table just had fewer runs)
        lines += ["", "## Not reported", "Run folders left out of the table:", ""] + \
                 [f"- `{rel}`: {why}" for rel, why in skipped]
    if plots:
        from tta_brain.report.plots import safe_name
        name = (f"long_{safe_name(stream)}.png" if metric == "wer"
                else f"long_{metric}_{safe_name(stream)}.png")
        png = plot_long(runs, stream, Path(plots_dir or root / "plots") / name, window, metric)
        if png:
            lines += ["", f"![{stream}]({os.path.relpath(png, out.parent)})"]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tta_brain.report.long",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--exp_dir", required=True, type=os.path.expanduser,
                   help="results root (e.g. exp/long3000/snr20)")
    p.add_argument("--stream", default="md_long")
    p.add_argument("--out", default=None, type=os.path.expanduser,
                   help="default: <exp_dir>/LONG.md (--metric cer: <exp_dir>/LONG_cer.md)")
    p.add_argument("--metric", default="wer", choices=tuple(METRICS),
                   help="error rate of the table and the plot: wer, cer (characters) or "
                        "wer_official (the official code's scoring: apostrophes deleted)")
    p.add_argument("--window", type=int, default=WINDOW, help="window of the WER (utterances)")
    p.add_argument("--margin", type=float, default=MARGIN,
                   help="WER (CER) points above the source")
    p.add_argument("--flat_mib", type=float, default=FLAT_MIB,
                   help="largest RSS slope (MiB per 1,000 utterances) that counts as flat")
    p.add_argument("--no_plots", action="store_true")
    p.add_argument("--plots_dir", default=None, type=os.path.expanduser,
                   help="default: <exp_dir>/plots")
    p.add_argument("--methods", default=None,
                   help="the method tags to report, e.g. \"suta dsuta dsuta+dynamic\" (default: "
                        "all; the source runs, the reference, always)")
    args = p.parse_args(argv)
    if args.window < 1:
        p.error(f"--window {args.window}: must be an integer >= 1 (utterances)")
    for name in ("margin", "flat_mib"):        # nan: nothing is ever above it, all is flat
        if not 0 <= getattr(args, name) < float("inf"):
            p.error(f"--{name} {getattr(args, name)}: must be a finite number >= 0")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from tta_brain.report.results import collect_runs
    try:
        skipped, others = [], set()
        runs = collect_runs(args.exp_dir, skipped, stream=args.stream, other_streams=others)
        if not runs and others:
            raise ValueError(f"no finished run of stream {args.stream!r} under {args.exp_dir} "
                             f"(streams there: {', '.join(sorted(others))}; --stream)")
        if args.methods is not None:
            wanted = set(args.methods.split())
            have = sorted({r.method for r in runs if r.stream == args.stream})
            missing = sorted(wanted - set(have))
            if missing:
                raise ValueError(f"--methods: no run of {', '.join(missing)} on stream "
                                 f"{args.stream!r} (its methods: {', '.join(have) or 'none'})")
            runs = [r for r in runs if r.method in wanted or r.method == "source"]
        out = write_long_report(runs, args.exp_dir, args.stream, args.out, args.window,
                                args.margin, args.flat_mib, not args.no_plots, args.metric,
                                skipped=skipped, plots_dir=args.plots_dir)
    except ValueError as err:
        print(f"ERROR: {err}", file=sys.stderr)
        return 1
    except OSError as err:                  # LONG.md: a folder, no permission, a full disk
        print(f"ERROR: cannot write {err.filename or args.out}: {err.strerror or err} (--out)",
              file=sys.stderr)
        return 1
    print(out.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
