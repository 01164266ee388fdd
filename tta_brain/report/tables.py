"""Numbers of a set of runs (:class:`tta_brain.run.folder.Run`) and the Markdown tables of RESULTS.md:
per-run WERs, grouping by method label and stream, mean +- sample std over seeds, resets against
the true boundaries, ESPnet-style scores, efficiency, WER vs adaptation steps. The same tables of
CER: :func:`in_metric` (``--metric cer``)."""
import dataclasses
import math
import statistics
from collections import OrderedDict, defaultdict
from typing import AbstractSet, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from tta_brain.report import tags
from tta_brain.asr.metrics import char_errors, error_rate, errors, official_words
from tta_brain.run.folder import Run

COUNT_KEYS = ("adapt_forward", "adapt_backward", "infer_forward", "aux_forward")
Label = Tuple[str, Optional[int]]


#: the error rates a report can show: name -> what its counts count
METRICS = {"wer": "word", "cer": "char", "wer_official": "word"}
#: each metric's name in titles, axes and table headers
LABELS = {"wer": "WER", "cer": "CER", "wer_official": "WER-official"}


def label(metric: str) -> str:
    """The name of ``metric`` in a report (``WER``, ``CER``, ``WER-official``)."""
    return LABELS.get(metric, metric.upper())


# ----------------------------------------------------------------------------- per run
def in_metric(runs: Sequence[Run], metric: str = "wer") -> List[Run]:
    """The runs as ``metric`` counts them. ``wer``: as they are. ``cer``: copies whose transcripts
    hold the character counts of their (normalised) reference and hypothesis, spaces counted, in
    the word-count fields (``n_words`` = reference characters, ``n_err``/``n_sub``/... the
    character edits), so every table, plot and score of the report is the CER one, as ESPnet's
    ``score_cer`` gives the ``score_wer`` tables of characters. For languages written without
    spaces, where a word error rate counts whole sentences. ``wer_official``: the word counts
    the official Dynamic-SUTA code's scoring gives (:func:`~tta_brain.asr.metrics.official_words`:
    apostrophes deleted, not kept), to set beside the paper's tables."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: one of {', '.join(METRICS)}")
    if metric == "wer":
        return list(runs)
    out = []
    for r in runs:
        ts = []
        for t in r.transcripts:
            e = (char_errors(t.ref, t.hyp) if metric == "cer"
                 else errors(official_words(t.ref), official_words(t.hyp)))
            ts.append(dataclasses.replace(t, n_words=e.n_ref, n_err=e.n_err, n_sub=e.n_sub,
                                          n_del=e.n_del, n_ins=e.n_ins))
        out.append(dataclasses.replace(r, transcripts=ts))
    return out


def run_wer(run: Run) -> float:
    """WER (%) of one run: 100 * errors / reference words over its transcripts."""
    return error_rate(sum(t.n_err for t in run.transcripts), sum(t.n_words for t in run.transcripts))


def position_counts(run: Run, only: Optional[AbstractSet[int]] = None
                    ) -> Tuple["np.ndarray", "np.ndarray"]:
    """(errors, reference words) indexed by stream position: 0 and 0 where an utterance was
    skipped, so a curve's x is the stream position its boundaries and resets are drawn at.
    ``only``: the positions to count (others 0 and 0, as if skipped): see :func:`common_positions`."""
    import numpy as np
    n = max(t.position for t in run.transcripts) + 1 if run.transcripts else 0
    err, words = np.zeros(n), np.zeros(n)
    for t in run.transcripts:
        if only is None or t.position in only:
            err[t.position] += t.n_err
            words[t.position] += t.n_words
    return err, words


def common_positions(runs: Sequence[Run]) -> Set[int]:
    """The stream positions every run scored: two runs' windowed WERs compared position by
    position count the same utterances (one run's skips left out of the other's windows too)."""
    sets = [{t.position for t in r.transcripts} for r in runs]
    return set.intersection(*sets) if sets else set()


def run_domain_wer(run: Run) -> "OrderedDict[str, float]":
    """WER (%) per domain in order of first appearance in the stream."""
    err, words = OrderedDict(), defaultdict(int)
    for t in run.transcripts:
        err[t.domain] = err.get(t.domain, 0) + t.n_err
        words[t.domain] += t.n_words
    return OrderedDict((d, error_rate(e, words[d])) for d, e in err.items())


def is_single_domain(run: Run) -> bool:
    return not run.boundaries and len(run_domain_wer(run)) <= 1


# ----------------------------------------------------------------------------- grouping
def method_labels(runs: Sequence[Run]) -> Dict[int, Label]:
    """id(run) -> (method, steps or None); steps only for methods run with several counts."""
    seen = defaultdict(set)
    for r in runs:
        seen[r.method].add(r.steps)
    return {id(r): (r.method, r.steps if len(seen[r.method]) > 1 else None) for r in runs}


def label_text(label: Label) -> str:
    method, steps = label
    return method if steps is None else f"{method} (N={steps})"


def _label_key(label: Label):
    return tags.sort_key(label[0]), -1 if label[1] is None else label[1]


def group_runs(runs: Sequence[Run], labels: Optional[Dict[int, Label]] = None
               ) -> "OrderedDict[Label, Dict[str, List[Run]]]":
    """label -> stream -> runs, labels in method order; ``labels``: those of all the report's
    runs (:func:`method_labels`), so a table of some streams labels a method as the main table
    does (``suta (N=1)``, not ``suta``, where N=10 ran on another stream)."""
    labels = labels or method_labels(runs)
    table = defaultdict(lambda: defaultdict(list))
    for r in runs:
        table[labels[id(r)]][r.stream].append(r)
    return OrderedDict((k, table[k]) for k in sorted(table, key=_label_key))


def streams_of(runs: Sequence[Run]) -> List[str]:
    return sorted({r.stream for r in runs})


def aggregate(values: Iterable[float]) -> Tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; std is nan when n < 2."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return float("nan"), float("nan"), 0
    std = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return statistics.fmean(vals), std, len(vals)


def steps_groups(runs: Sequence[Run]) -> Dict[str, Dict[str, Dict[int, List[Run]]]]:
    """stream -> method -> steps -> runs, for methods run with >= 2 step counts on a stream (a
    grid's steps sweep, ``suta_steps1`` ... ``suta_steps10``, is one method: ``suta``)."""
    out = {}
    for stream in streams_of(runs):
        by_method = defaultdict(lambda: defaultdict(list))
        for r in runs:
            if r.stream == stream and r.steps is not None:
                by_method[tags.without_steps(r.method)][r.steps].append(r)
        kept = {m: dict(v) for m, v in by_method.items() if len(v) >= 2}
        if kept:
            out[stream] = kept
    return out


# ----------------------------------------------------------------------------- formatting
def fmt_stat(values: Iterable[float], digits: int = 1) -> str:
    mean, std, n = aggregate(values)
    if n == 0:
        return "-"
    if n == 1:
        return f"{mean:.{digits}f} (n=1)"
    return f"{mean:.{digits}f} ± {std:.{digits}f} (n={n})"


def fmt(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["|" + "|".join(header) + "|",
             "|" + "|".join(":--" if i == 0 else "--:" for i in range(len(header))) + "|"]
    return "\n".join(lines + ["|" + "|".join(str(c) for c in row) + "|" for row in rows])


def fmt_positions(positions: Sequence[int], limit: int = 20) -> str:
    if not positions:
        return "-"
    text = ", ".join(str(p) for p in positions[:limit])
    return text + (f", ... (+{len(positions) - limit} more)" if len(positions) > limit else "")


# ----------------------------------------------------------------------------- tables
def table_main(runs: Sequence[Run], digits: int = 1) -> str:
    """Methods x streams, WER mean +- sample std over seeds."""
    streams = streams_of(runs)
    rows = [[label_text(label)] + [fmt_stat([run_wer(r) for r in by.get(s, [])], digits)
                                   for s in streams]
            for label, by in group_runs(runs).items()]
    return md_table(["Method"] + streams, rows)


def _single_domain_columns(runs: Sequence[Run]) -> "OrderedDict[str, str]":
    """stream -> column title (its domain when domains are unique across streams, else stream)."""
    stream_domain = OrderedDict()
    for r in runs:
        if is_single_domain(r):
            doms = list(run_domain_wer(r))
            # a manifest without a domain column (one's own data): the stream names the column
            stream_domain.setdefault(r.stream, doms[0] if doms and doms[0] else r.stream)
    ordered = sorted(stream_domain, key=lambda s: (stream_domain[s], s))
    unique = len(set(stream_domain.values())) == len(stream_domain)
    return OrderedDict((s, stream_domain[s] if unique else s) for s in ordered)


def table_domains(runs: Sequence[Run], digits: int = 1) -> Optional[str]:
    """Methods x single-domain streams (the paper's Table 1), with the mean over columns."""
    columns = _single_domain_columns(runs)
    if not columns:
        return None
    rows = []
    for label, by in group_runs([r for r in runs if r.stream in columns],
                                method_labels(runs)).items():
        means = [aggregate(run_wer(r) for r in by.get(s, []))[0] for s in columns]
        avg = statistics.fmean(means) if all(not math.isnan(m) for m in means) else float("nan")
        rows.append([label_text(label)] + [fmt_stat([run_wer(r) for r in by.get(s, [])], digits)
                                           for s in columns] + [fmt(avg, digits)])
    return md_table(["Method"] + list(columns.values()) + ["Avg"], rows)


def table_breakdown(runs: Sequence[Run], stream: str, digits: int = 1) -> str:
    """Per-domain WER of one multi-domain stream (domains in stream order, then all)."""
    sruns = [r for r in runs if r.stream == stream]
    domains: List[str] = []
    for r in sruns:
        domains += [d for d in run_domain_wer(r) if d not in domains]
    rows = []
    for label, by in group_runs(sruns, method_labels(runs)).items():
        group = by[stream]
        cells = [fmt_stat([run_domain_wer(r).get(d, float("nan")) for r in group], digits)
                 for d in domains]
        rows.append([label_text(label)] + cells + [fmt_stat([run_wer(r) for r in group], digits)])
    return md_table(["Method"] + domains + ["all"], rows)


def detect_boundaries(resets: Sequence[int], boundaries: Sequence[int], window: int = 100) -> dict:
    """Match resets to true boundaries.

    A reset at position r (the row the reset model decodes from) belongs to the last
    boundary b <= r and detects it when r - b <= window; one reset detects one boundary at most.
    Returns ``detected`` {b: delay of its first reset}, ``missed`` [b], ``false`` [r] (resets
    before the first boundary or later than ``window`` after theirs).
    """
    bounds = sorted(boundaries)
    detected, false = OrderedDict(), []
    for r in sorted(resets):
        owner = [b for b in bounds if b <= r]
        if owner and r - owner[-1] <= window and owner[-1] not in detected:
            detected[owner[-1]] = r - owner[-1]
        else:
            false.append(r)
    detected = OrderedDict((b, detected[b]) for b in bounds if b in detected)
    return {"detected": detected, "missed": [b for b in bounds if b not in detected],
            "false": false}


def has_resets(run: Run) -> bool:
    """A run of a reset-capable configuration (a reset policy in its tag, resets or LIIs)."""
    return bool(run.resets) or "+" in run.method or bool(run.lii)


def table_resets(runs: Sequence[Run], stream: str, window: int = 100) -> Optional[str]:
    """Reset positions per run beside the true boundaries (the paper's Table 5) + detection."""
    sruns = [r for r in runs if r.stream == stream and has_resets(r)]
    if not sruns:
        return None
    rows, labels = [], method_labels(runs)      # (dsuta+dynamic (N=1): as the tables above)
    for r in sruns:
        det = detect_boundaries(r.resets, r.boundaries, window)
        delays = list(det["detected"].values())
        rows.append([label_text(labels[id(r)]), str(r.seed), fmt_positions(r.resets),
                     str(len(r.resets)),
                     f"{len(det['detected'])}/{len(r.boundaries)}", str(len(det["false"])),
                     fmt(statistics.fmean(delays), 1) if delays else "-"])
    head = (f"True boundaries (first position of a new segment): "
            f"{fmt_positions(sruns[0].boundaries, 50)}; detection window {window} utterances.\n\n")
    return head + md_table(["Method", "Seed", "Reset positions", "#Resets", "Detected", "False",
                            "Mean delay"], rows)


def espnet_rows(run: Run, digits: int = 1) -> List[List[str]]:
    """ESPnet ``|dataset|Snt|Wrd|Corr|Sub|Del|Ins|Err|S.Err|`` rows: the stream, then its domains;
    percentages with ``digits`` decimals (the report's ``--digits``)."""
    groups = OrderedDict([(run.stream, run.transcripts)])
    domains = OrderedDict()
    for t in run.transcripts:
        domains.setdefault(t.domain, []).append(t)
    if len(domains) > 1:
        groups.update((f"{run.stream}/{d}", ts) for d, ts in domains.items())
    out = []
    for name, ts in groups.items():
        wrd = sum(t.n_words for t in ts)
        sub, dele, ins = (sum(getattr(t, k) for t in ts) for k in ("n_sub", "n_del", "n_ins"))
        err = sum(t.n_err for t in ts)
        pct = (lambda x: fmt(100.0 * x / wrd, digits)) if wrd else (lambda x: "-")
        serr = 100.0 * sum(1 for t in ts if t.n_err > 0) / len(ts) if ts else float("nan")
        out.append([name, str(len(ts)), str(wrd), pct(wrd - sub - dele), pct(sub), pct(dele),
                    pct(ins), pct(err), fmt(serr, digits)])
    return out


def table_espnet(run: Run, metric: str = "wer", digits: int = 1) -> str:
    """ESPnet's result table; with ``metric="cer"`` of a run from :func:`in_metric` (``Chr``)."""
    unit = "Chr" if metric == "cer" else "Wrd"
    return md_table(["dataset", "Snt", unit, "Corr", "Sub", "Del", "Ins", "Err", "S.Err"],
                    espnet_rows(run, digits))


def efficiency_stats(runs: Sequence[Run]) -> dict:
    """Means over runs: per-utterance pass counts, total wall time, time per audio second."""
    per_utt = {k: aggregate(r.summary.counts.get(k, float("nan")) / max(r.summary.n_utts, 1)
                            for r in runs)[0] for k in COUNT_KEYS}
    return {**per_utt, "passes": sum(v for v in per_utt.values() if not math.isnan(v)),
            "wall_time_s": aggregate(r.summary.wall_time_s for r in runs)[0],
            "time_per_audio_s": aggregate(r.summary.time_per_audio_s for r in runs)[0],
            "n": len(runs)}


def table_efficiency(runs: Sequence[Run], stream: str, reference: str = "suta") -> Optional[str]:
    """Forward/backward passes per utterance and runtime per audio second, ratios to SUTA."""
    sruns = [r for r in runs if r.stream == stream]
    if not sruns:
        return None
    by_label = group_runs(sruns, method_labels(runs))
    stats = OrderedDict((label, efficiency_stats(by[stream])) for label, by in by_label.items())
    # the reference's runs: its tag, else its one tagged variant (a grid's suta_steps1); of
    # several step counts, its packaged default (SUTA's N=10)
    refs = [(k, s) for k, s in stats.items() if k[0] == reference] or \
        [(k, s) for k, s in stats.items() if k[0].startswith(reference + "_")]
    if len(refs) > 1:             # the variant that ran the packaged step count, by its runs
        steps = packaged_steps(reference)
        refs = [(k, s) for k, s in refs
                if {r.steps for r in by_label[k][stream]} == {steps} and steps is not None
                and (k[0] == reference or tags.without_steps(k[0]) == reference)]
    ref_label, ref = refs[0] if len(refs) == 1 else ((reference, None), None)
    rows = []
    for label, s in stats.items():
        t_ratio = (s["time_per_audio_s"] / ref["time_per_audio_s"]
                   if ref and ref["time_per_audio_s"] else float("nan"))
        p_ratio = s["passes"] / ref["passes"] if ref and ref["passes"] else float("nan")
        rows.append([label_text(label)] + [fmt(s[k], 2) for k in COUNT_KEYS]
                    + [fmt(s["wall_time_s"], 1), fmt(s["time_per_audio_s"], 3), fmt(t_ratio, 2),
                       fmt(p_ratio, 2), str(s["n"])])
    header = ["Method", "Adapt fwd/utt", "Adapt bwd/utt", "Infer fwd/utt", "Aux fwd/utt",
              "Wall time (s)", "s per audio s", f"Time x {label_text(ref_label).upper()}",
              f"Passes x {label_text(ref_label).upper()}", "Runs"]
    return md_table(header, rows)


def packaged_steps(method: str) -> Optional[int]:
    """``steps`` of the packaged yaml of ``method`` (None: no such yaml, or no integer there)."""
    from tta_brain import hparams
    try:
        found = dict((k, v) for k, v, _ in hparams.describe(method))
        return int(found["steps"])
    except (FileNotFoundError, KeyError, ValueError):
        return None


def table_steps(runs: Sequence[Run], digits: int = 1) -> Optional[str]:
    groups = steps_groups(runs)
    if not groups:
        return None
    parts = []
    for stream, by_method in groups.items():
        steps = sorted({s for v in by_method.values() for s in v})
        rows = [[m] + [fmt_stat([run_wer(r) for r in by_method[m].get(s, [])], digits)
                       for s in steps] for m in sorted(by_method, key=tags.sort_key)]
        parts.append(f"**{stream}**\n\n" + md_table(["Method"] + [f"N={s}" for s in steps], rows))
    return "\n\n".join(parts)


def runs_inventory(runs: Sequence[Run], digits: int = 1, metric: str = "wer") -> str:
    """One row per run: its utterances scored and those it skipped (``rejects.csv``: in no
    error rate of the report), and its error rate."""
    rows = [[r.name, r.method, r.stream, str(r.seed), "-" if r.steps is None else str(r.steps),
             str(r.summary.n_utts), str(r.summary.n_skipped or 0), fmt(run_wer(r), digits)]
            for r in runs]
    return md_table(["Experiment", "Method", "Stream", "Seed", "Steps", "Utts", "Skipped",
                     f"{label(metric)} (%)"], rows)
