"""Plots of finished runs: WER difference over time, reset timelines, LII distributions and WER vs
number of adaptation steps. Runs are :class:`tta_brain.run.folder.Run` objects; every ``plot_*``
returns the PNG path written, or None when there is nothing to draw. The figures are matplotlib's
``Figure`` objects drawn by Agg, not pyplot's: a report leaves the process's backend (a notebook's
inline one) and the caller's open figures as they were."""
from __future__ import annotations

import bisect
import hashlib
import logging
import re
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np

from tta_brain.report import tags  # noqa: E402
from tta_brain.run.folder import Run  # noqa: E402
from tta_brain.report.tables import (Label, label as metric_label, aggregate, group_runs, has_resets, label_text,  # noqa: E402
                                     common_positions, method_labels, position_counts,
                                     run_wer, steps_groups,
                                     streams_of)

logger = logging.getLogger(__name__)
DPI = 120


#: The longest file-name part (file systems take 255 bytes per name; a plot's name has a
#: prefix and two parts): a longer one is cut, with a short hash of the whole text.
MAX_PART = 80


def safe_name(text: str) -> str:
    """A file-name part of ``text``: letters (of any script), digits, ``.``, ``-``; others
    ``_``; at most :data:`MAX_PART` bytes (a long method tag was 'File name too long')."""
    name = re.sub(r"[^\w.-]+", "_", str(text)).strip("_") or "unnamed"
    if len(name.encode("utf-8")) > MAX_PART:
        digest = hashlib.sha1(str(text).encode("utf-8")).hexdigest()[:8]
        cut = name.encode("utf-8")[:MAX_PART - 9].decode("utf-8", "ignore")
        name = f"{cut}-{digest}"
    return name


def file_names(texts) -> Dict[str, str]:
    """text -> its :func:`safe_name`, made unique: texts whose names would be one file (``md
    easy`` and ``md_easy``) get a short hash of the text appended."""
    names = {t: safe_name(t) for t in texts}
    seen: Dict[str, int] = {}
    for n in names.values():
        seen[n] = seen.get(n, 0) + 1
    return {t: n if seen[n] == 1 else f"{n}-{hashlib.sha1(str(t).encode()).hexdigest()[:6]}"
            for t, n in names.items()}


def subplots(nrows: int = 1, ncols: int = 1, figsize=None, **kwargs):
    """``pyplot.subplots`` without pyplot: a figure with an Agg canvas of its own, which no
    backend switch and no ``close`` concerns (a report made in a notebook had set the process's
    backend to Agg, and a failed plot closed every figure the notebook had open)."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **kwargs)


def colormap(name: str):
    return matplotlib.colormaps[name]


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return str(path)


#: line styles of the curves of one colour in one plot, in turn: a tag's step counts, and tags
#: whose hashed colours are one (``suta_steps1`` and ``suta_steps10``: a '0' more, 48 = 6 * 8)
STYLES = ("-", "--", ":", "-.")


def line_style(color: str, used: Dict[str, int]) -> str:
    """The line style of a plot's next curve of ``color``: solid for the first of a colour, then
    dashed, dotted, dash-dotted (``used``: the plot's curves per colour so far, updated)."""
    k = used[color] = used.get(color, 0) + 1
    return STYLES[(k - 1) % len(STYLES)]


def _draw_boundaries(ax, boundaries: Sequence[int]) -> None:
    for i, b in enumerate(boundaries):
        ax.axvline(b, color="0.4", linestyle="--", linewidth=1, label="true boundary" if i == 0 else None)


# ------------------------------------------------------------------------------------------------
# WER difference over time (paper Fig. 4)
# ------------------------------------------------------------------------------------------------
def smoothed_wer(n_err: Sequence[float], n_words: Sequence[float], window: int = 100) -> np.ndarray:
    """Trailing-window WER (%): value t = sum(err[t-w+1..t]) / sum(words[t-w+1..t]) (partial at start)."""
    window = max(int(window), 1)
    ce = np.concatenate([[0.0], np.cumsum(np.asarray(n_err, dtype=float))])
    cw = np.concatenate([[0.0], np.cumsum(np.asarray(n_words, dtype=float))])
    end = np.arange(1, len(ce))
    start = np.maximum(end - window, 0)
    words = cw[end] - cw[start]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(words > 0, 100.0 * (ce[end] - ce[start]) / words, np.nan)


def _mean_curve(runs: Sequence[Run], window: int, only=None) -> Optional[np.ndarray]:
    """Mean over runs (seeds) of their smoothed WER curves by stream position, cut to the
    shortest run; ``only``: the positions counted (:func:`tables.common_positions`)."""
    curves = [smoothed_wer(*position_counts(r, only), window) for r in runs if r.transcripts]
    if not curves:
        return None
    n = min(len(c) for c in curves)
    with warnings.catch_warnings():     # positions no run has words at stay NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(np.stack([c[:n] for c in curves]), axis=0)


def difference_curves(runs: Sequence[Run], stream: str, window: int = 100,
                      baseline: str = "source") -> Tuple[bool, List[Tuple[Label, np.ndarray,
                                                                       List[Run]]]]:
    """``(has_baseline, [(label, curve, its runs)])`` of ``stream``: each method's smoothed WER
    minus the baseline's by stream position, both over the utterances every one of those runs
    scored (a skip in either leaves that utterance out of both: the curves compare one set of
    utterances); each method's absolute WER where the stream has no baseline run."""
    sruns = [r for r in runs if r.stream == stream and r.transcripts]
    base_runs = [r for r in sruns if r.method == baseline]
    out = []
    for label, by_stream in group_runs(sruns).items():
        group = list(by_stream[stream])
        if label[0] == baseline and base_runs:
            continue
        if base_runs:
            both = common_positions(group + base_runs)
            curve, ref = (_mean_curve(g, window, both) for g in (group, base_runs))
            n = min(len(curve), len(ref))
            curve = curve[:n] - ref[:n]
        else:
            curve = _mean_curve(group, window)
        out.append((label, curve, group))
    return bool(base_runs), out


def plot_wer_difference(runs: Sequence[Run], stream: str, out_png, window: int = 100,
                        baseline: str = "source", metric: str = "wer") -> Optional[str]:
    """Smoothed WER of each method minus the baseline's over stream position
    (:func:`difference_curves`; absolute WER if the stream has no baseline run); boundaries
    dashed, resets of dynamic-reset runs as markers. ``metric="cer"``: of runs from
    ``tables.in_metric``, labelled CER."""
    M = metric_label(metric)
    sruns = [r for r in runs if r.stream == stream and r.transcripts]
    base, curves = difference_curves(sruns, stream, window, baseline)
    fig, ax = subplots(figsize=(10, 4.5))
    drawn, used = 0, {}
    for label, curve, group in curves:
        method = label[0]
        ax.plot(np.arange(len(curve)), curve, color=tags.color(method), linewidth=1.3,
                linestyle=line_style(tags.color(method), used),
                label=f"{label_text(label)} (n={len(group)})")
        drawn += 1
        if "dynamic" in method:
            resets = sorted({p for r in group for p in r.resets if 0 <= p < len(curve)})
            if resets:
                ax.plot(resets, curve[resets], linestyle="none", marker="v", markersize=7,
                        color=tags.color(method), markeredgecolor="k",
                        label=f"resets of {label_text(label)} (all seeds)")
    if not drawn:
        return None
    _draw_boundaries(ax, sruns[0].boundaries)
    longest = max(len(r.transcripts) for r in sruns)
    # a window as long as the stream or longer never fills: every point is the cumulative rate
    smooth = f"window {window} utts" if window < longest else "cumulative: the stream is " \
        f"no longer than the {window}-utt window"
    if base:
        ax.axhline(0, color="k", linewidth=0.8)
        ax.set_ylabel(f"{M} difference to {baseline} (% abs.)")
        ax.set_title(f"{stream}: {M} difference to {baseline} over time ({smooth})")
    else:
        ax.set_ylabel(f"{M} (%)")
        ax.set_title(f"{stream}: {M} over time ({smooth}; no {baseline} run)")
    ax.set_xlabel("stream position (utterances)")
    ax.grid(alpha=0.3)
    # outside the axes: with many methods an inner legend hides curves
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return _save(fig, Path(out_png))


# ------------------------------------------------------------------------------------------------
# Reset timeline (paper Table 5 as a picture)
# ------------------------------------------------------------------------------------------------
def _segments(run: Run) -> List[Tuple[int, int, str]]:
    """(start, end, domain) of the contiguous segments of a run's stream."""
    segs: List[Tuple[int, int, str]] = []
    for t in run.transcripts:
        if segs and segs[-1][3] == t.segment:
            segs[-1][1] = t.position + 1
        else:
            segs.append([t.position, t.position + 1, t.domain, t.segment])
    return [(s, e, d) for s, e, d, _ in segs]


def plot_reset_timeline(runs: Sequence[Run], stream: str, out_png) -> Optional[str]:
    """One row per reset-capable run: reset positions as ticks beside the true boundaries."""
    sruns = [r for r in runs if r.stream == stream and has_resets(r)]
    if not sruns:
        return None
    fig, ax = subplots(figsize=(10, 1.2 + 0.45 * len(sruns)))
    labels, names = [], method_labels(runs)     # (dsuta+dynamic (N=1): as RESULTS.md)
    for y, r in enumerate(sruns):
        labels.append(f"{label_text(names[id(r)])} seed {r.seed}")
        ax.plot(r.resets, [y] * len(r.resets), linestyle="none", marker="|", markersize=14,
                markeredgewidth=2, color=tags.color(r.method))
    _draw_boundaries(ax, sruns[0].boundaries)
    segs = _segments(sruns[0])
    if 1 < len(segs) <= 20:
        for start, end, dom in segs:
            ax.text((start + end) / 2, len(sruns) - 0.4, dom, ha="center", va="bottom", fontsize=8, color="0.3")
    n = max([len(r.transcripts) for r in sruns] + [max(sruns[0].boundaries or [0]) + 1])
    ax.set_xlim(0, n)
    ax.set_ylim(-0.7, len(sruns) - 0.4 + (0.6 if 1 < len(segs) <= 20 else 0.2))
    ax.set_yticks(range(len(sruns)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("stream position (utterances); tick = reset logged at that position")
    ax.set_title(f"{stream}: reset positions vs true domain boundaries")
    ax.grid(axis="x", alpha=0.3)
    if sruns[0].boundaries:
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, Path(out_png))


# ------------------------------------------------------------------------------------------------
# LII distributions (paper Fig. 5)
# ------------------------------------------------------------------------------------------------
def _segment_lookup(run: Run):
    if run.transcripts:
        return {t.position: t.segment for t in run.transcripts}.get
    bounds = run.boundaries
    return lambda pos: bisect.bisect_right(bounds, pos)


def split_lii(run: Run) -> Tuple[List[float], List[float]]:
    """(in-domain, out-of-domain) LIIs of one run.

    Rows are taken in position order. ``construction`` rows are the in-domain reference and set the
    reference segment (the segment phi_D was built on); a ``detection`` row is in-domain when its
    segment equals the segment of the latest construction row, else out-of-domain. Detection rows
    before any construction row, or at positions with no known segment, are dropped.
    """
    seg_of = _segment_lookup(run)
    ref_segment = None
    inside: List[float] = []
    outside: List[float] = []
    for row in run.lii:
        seg = seg_of(row.position)
        if seg is None:
            continue
        if row.stage == "construction":
            ref_segment = seg
            inside.append(row.lii)
        elif ref_segment is not None:
            (inside if seg == ref_segment else outside).append(row.lii)
    return inside, outside


def plot_lii_histogram(runs: Sequence[Run], out_png, title: str = "") -> Optional[str]:
    """Histogram (density) of in-domain vs out-of-domain LIIs pooled over ``runs``."""
    inside, outside = [], []
    for r in runs:
        i, o = split_lii(r)
        inside += i
        outside += o
    if not inside and not outside:
        return None
    bins = np.histogram_bin_edges(np.asarray(inside + outside), bins=40)
    fig, ax = subplots(figsize=(7, 4.5))
    if inside:
        ax.hist(inside, bins=bins, density=True, alpha=0.6, color="tab:blue", label=f"in-domain (n={len(inside)})")
    if outside:
        ax.hist(outside, bins=bins, density=True, alpha=0.6, color="tab:red",
                label=f"out-of-domain (n={len(outside)})")
    ax.set_xlabel(r"LII = $L_{suta}(\phi_D, x) - L_{suta}(\phi_{pre}, x)$ (loss units)")
    ax.set_ylabel("density")
    ax.set_title(title or "LII distribution: in-domain vs out-of-domain")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return _save(fig, Path(out_png))


# ------------------------------------------------------------------------------------------------
# WER vs adaptation steps (paper appendix figure)
# ------------------------------------------------------------------------------------------------
def plot_wer_vs_steps(runs: Sequence[Run], stream: str, out_png, baseline: str = "source",
                      metric: str = "wer") -> Optional[str]:
    """Mean WER (error bars: sample std over seeds) against the number of adaptation steps."""
    by_method = steps_groups(runs).get(stream)
    if not by_method:
        return None
    fig, ax = subplots(figsize=(6.5, 4.5))
    used: Dict[str, int] = {}
    for method in sorted(by_method, key=tags.sort_key):
        steps = sorted(by_method[method])
        stats = [aggregate(run_wer(r) for r in by_method[method][s]) for s in steps]
        ax.errorbar(steps, [m for m, _, _ in stats], yerr=[0.0 if np.isnan(sd) else sd for _, sd, _ in stats],
                    marker="o", capsize=3, color=tags.color(method),
                    linestyle=line_style(tags.color(method), used), label=method)
    base = [run_wer(r) for r in runs if r.stream == stream and r.method == baseline]
    if base:
        ax.axhline(aggregate(base)[0], color="0.3", linestyle=":", label=f"{baseline} (no adaptation)")
    ax.set_xlabel("adaptation steps per utterance (N)")
    ax.set_ylabel(f"{metric_label(metric)} (%)")
    ax.set_title(f"{stream}: {metric_label(metric)} vs number of adaptation steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return _save(fig, Path(out_png))


# ------------------------------------------------------------------------------------------------
def make_all_plots(runs: Sequence[Run], plots_dir, smooth: int = 100, baseline: str = "source",
                   metric: str = "wer") -> List[str]:
    """Every plot that the runs support; a failing plot is logged and skipped. The error-rate
    plots are named by ``metric`` (``wer_diff_*``, ``cer_diff_*``: both reports share a folder)."""
    plots_dir = Path(plots_dir)
    try:
        plots_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:                  # one line, not a traceback for each plot
        logger.warning("No plots: cannot create %s (%s; --plots_dir)", plots_dir,
                       e.strerror or e)
        return []
    jobs, labels = [], method_labels(runs)
    stream_names = file_names(streams_of(runs))
    for s in streams_of(runs):
        name = stream_names[s]
        jobs.append((plot_wer_difference, (runs, s, plots_dir / f"{metric}_diff_{name}.png", smooth,
                                           baseline, metric)))
        jobs.append((plot_reset_timeline, (runs, s, plots_dir / f"resets_{name}.png")))
        jobs.append((plot_wer_vs_steps, (runs, s, plots_dir / f"{metric}_vs_steps_{name}.png",
                                         baseline, metric)))
        lii_runs: Dict[str, List[Run]] = {}     # by label: a method's step counts apart
        for r in runs:
            if r.stream == s and r.lii:
                lii_runs.setdefault(label_text(labels[id(r)]), []).append(r)
        method_names = file_names(lii_runs)
        for method, group in sorted(lii_runs.items()):
            title = f"{s}: LII of {method} (n={len(group)} runs), in- vs out-of-domain"
            png = plots_dir / f"lii_{name}_{method_names[method]}.png"
            jobs.append((plot_lii_histogram, (group, png, title)))
    written = []
    for fn, args in jobs:
        try:
            path = fn(*args)
        except Exception:  # one bad plot must not lose the report
            logger.warning("Plot %s failed for %s", fn.__name__, args[-1] if fn is plot_lii_histogram else args[1],
                           exc_info=True)
            continue
        if path:
            written.append(path)
    return written
