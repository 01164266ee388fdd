"""RESULTS.md tables (mean +- spread over seeds), plots and an efficiency table.

Reads every experiment directory (any depth) under a results root, i.e. every directory holding a
``summary.json`` as written by ``tta_brain.decode`` (see ARCHITECTURE.md, "Experiment directory"),
together with its ``transcripts.csv``, ``resets.csv`` and (dynamic reset only) ``lii.csv``.

Usage::

    python -m tta_brain.report --exp_dir results/ [--out results/RESULTS.md]
        [--plots_dir results/plots] [--smooth 100] [--baseline source] [--window 100]

Conventions used throughout (also written into RESULTS.md):

* WER of a run = 100 * sum(n_err) / sum(n_words) over its transcripts (falls back to the
  summary's ``n_err``/``n_words``, then to its ``wer``, which is taken to be a percentage).
* Cells are ``mean +- sample std (n=runs)`` over the runs (seeds) of a (method, stream) pair;
  with one run only the mean is shown.
* A reset logged at position ``r`` means utterance ``r`` is the first one decoded from the reset
  model (resets.csv). It detects the last true boundary ``b <= r`` (the first position of a new
  segment) when ``r - b <= window``; other resets are false resets.
* A method with runs of several adaptation-step counts (``steps``, see :func:`find_steps`) is
  split into one row per count, labelled ``method (N=steps)``.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger("tta_brain.report")  # same name under python -m

METHOD_ORDER = ["source", "suta", "sgem", "sdpl", "csuta", "awmc", "dsuta",
                "dsuta+dynamic", "dsuta+fixed", "dsuta+oracle"]
STEP_KEYS = ("steps", "n_steps", "num_steps", "adapt_steps", "adaptation_steps")
COUNT_KEYS = ("adapt_forward", "adapt_backward", "infer_forward", "aux_forward")
VERSION_PACKAGES = ("torch", "torchaudio", "transformers", "speechbrain")
SKIP_DIRS = {"save", "plots", "__pycache__"}
INT_COLUMNS = ("position", "segment", "n_words", "n_err", "n_sub", "n_del", "n_ins", "reset")


class NoRunsError(ValueError):
    """Raised when a results root holds no readable experiment directory."""


# --------------------------------------------------------------------------------------------
# Reading experiment directories
# --------------------------------------------------------------------------------------------
def _to_int(value, default=0) -> int:
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return default


def _to_float(value, default=float("nan")) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _read_csv(path: Path) -> Optional[List[dict]]:
    """Rows of a CSV file as dicts, or None when the file is absent or unreadable."""
    if not path.is_file():
        return None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as err:
        logger.warning("Cannot read %s (%s); ignoring it", path, err)
        return None


def load_transcripts(path: Path) -> Optional[List[dict]]:
    """transcripts.csv rows with typed counts, sorted by stream position (ref/hyp are dropped)."""
    rows = _read_csv(path)
    if rows is None:
        return None
    out = []
    for i, row in enumerate(rows):
        rec = {k: _to_int(row.get(k), 0) for k in INT_COLUMNS}
        rec["position"] = _to_int(row.get("position"), i)
        rec["ID"] = row.get("ID", "")
        rec["domain"] = row.get("domain") or "unknown"
        rec["duration"] = _to_float(row.get("duration"), 0.0)
        out.append(rec)
    out.sort(key=lambda r: r["position"])
    return out


def load_resets(path: Path) -> Optional[List[int]]:
    rows = _read_csv(path)
    if rows is None:
        return None
    return sorted(_to_int(r.get("position"), -1) for r in rows if r.get("position") not in (None, ""))


def load_lii(path: Path) -> Optional[List[dict]]:
    rows = _read_csv(path)
    if rows is None:
        return None
    out = []
    for r in rows:
        lii = _to_float(r.get("lii"))
        if math.isnan(lii) or r.get("position") in (None, ""):
            continue
        out.append({"position": _to_int(r["position"]), "lii": lii,
                    "stage": (r.get("stage") or "").strip().lower()})
    out.sort(key=lambda r: r["position"])
    return out


def find_steps(summary: dict) -> Optional[int]:
    """Number of adaptation steps of a run, looked up defensively.

    Checks ``summary[k]`` then ``summary["hparams"][k]`` then one level deeper
    (``summary["hparams"][<group>][k]``) for k in :data:`STEP_KEYS`; returns None if absent.
    """
    candidates = [summary]
    hp = summary.get("hparams")
    if isinstance(hp, dict):
        candidates.append(hp)
        candidates.extend(v for v in hp.values() if isinstance(v, dict))
    for scope in candidates:
        for key in STEP_KEYS:
            value = scope.get(key)
            if isinstance(value, bool) or value is None:
                continue
            try:
                return int(value)
            except (TypeError, ValueError):
                continue
    return None


def _boundaries_from_transcripts(rows: Sequence[dict]) -> List[int]:
    return [b["position"] for a, b in zip(rows, rows[1:]) if a["segment"] != b["segment"]]


def load_run(run_dir: Path, root: Optional[Path] = None) -> Optional[dict]:
    """One experiment directory as a dict (summary keys + parsed files); None if unusable."""
    run_dir = Path(run_dir)
    try:
        with open(run_dir / "summary.json", encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError) as err:
        logger.warning("Skipping %s: cannot read summary.json (%s)", run_dir, err)
        return None
    if not isinstance(summary, dict) or not summary.get("method") or not summary.get("stream"):
        logger.warning("Skipping %s: summary.json lacks 'method' or 'stream'", run_dir)
        return None
    run = dict(summary)
    run["method"], run["stream"] = str(summary["method"]), str(summary["stream"])
    run["dir"] = str(run_dir)
    run["name"] = os.path.relpath(run_dir, root) if root is not None else run_dir.name
    run["steps"] = find_steps(summary)
    run["transcripts"] = load_transcripts(run_dir / "transcripts.csv")
    resets = load_resets(run_dir / "resets.csv")
    if resets is None:
        resets = [_to_int(p) for p in summary.get("resets") or []]
        if not resets and run["transcripts"]:
            resets = [r["position"] for r in run["transcripts"] if r["reset"]]
    run["resets"] = sorted(resets)
    if isinstance(summary.get("boundaries"), list):
        run["boundaries"] = sorted(_to_int(b) for b in summary["boundaries"])
    else:
        run["boundaries"] = _boundaries_from_transcripts(run["transcripts"] or [])
    run["lii"] = load_lii(run_dir / "lii.csv")
    return run


def _seed_key(seed) -> Tuple[int, float, str]:
    """Numeric seeds in numeric order, others after them as text."""
    try:
        return 0, float(seed), ""
    except (TypeError, ValueError):
        return 1, 0.0, str(seed)


def collect_runs(root) -> List[dict]:
    """All experiment directories under ``root`` (any depth), sorted by (stream, method, seed)."""
    root = Path(root)
    if not root.is_dir():
        logger.warning("Results root %s does not exist", root)
        return []
    runs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        if "summary.json" in filenames:
            run = load_run(Path(dirpath), root)
            if run is not None:
                runs.append(run)
        elif "transcripts.csv" in filenames:
            logger.warning("Skipping %s: transcripts.csv but no summary.json (unfinished run?)", dirpath)
    runs.sort(key=lambda r: (r["stream"], method_sort_key(r["method"]), _seed_key(r.get("seed")), r["name"]))
    return runs


# --------------------------------------------------------------------------------------------
# Per-run numbers
# --------------------------------------------------------------------------------------------
def run_wer(run: dict) -> float:
    """WER (%) of one run, from transcript counts, else summary counts, else summary ``wer``."""
    rows = run.get("transcripts")
    if rows:
        words = sum(r["n_words"] for r in rows)
        return 100.0 * sum(r["n_err"] for r in rows) / words if words else float("nan")
    if run.get("n_words"):
        return 100.0 * _to_float(run.get("n_err")) / _to_float(run["n_words"])
    return _to_float(run.get("wer"))


def run_domain_wer(run: dict) -> "OrderedDict[str, float]":
    """WER (%) per domain in order of first appearance in the stream."""
    rows = run.get("transcripts")
    if not rows:
        per = run.get("wer_per_domain") or {}
        return OrderedDict((str(k), _to_float(v)) for k, v in per.items())
    err, words = OrderedDict(), defaultdict(int)
    for r in rows:
        err[r["domain"]] = err.get(r["domain"], 0) + r["n_err"]
        words[r["domain"]] += r["n_words"]
    return OrderedDict((d, 100.0 * e / words[d] if words[d] else float("nan")) for d, e in err.items())


def run_domains(run: dict) -> List[str]:
    return list(run_domain_wer(run).keys())


def is_single_domain(run: dict) -> bool:
    return not run["boundaries"] and len(run_domains(run)) <= 1


def run_time_per_audio(run: dict) -> float:
    if run.get("time_per_audio_s") is not None:
        return _to_float(run["time_per_audio_s"])
    audio = _to_float(run.get("audio_s"))
    return _to_float(run.get("wall_time_s")) / audio if audio else float("nan")


def run_n_utts(run: dict) -> int:
    if run.get("n_utts"):
        return _to_int(run["n_utts"])
    return len(run.get("transcripts") or [])


# --------------------------------------------------------------------------------------------
# Grouping, ordering and statistics
# --------------------------------------------------------------------------------------------
def method_sort_key(method: str) -> Tuple[int, str]:
    """Known tags in paper order (source first), unknown tags after them alphabetically."""
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def _label_sort_key(label: Tuple[str, Optional[int]]):
    method, steps = label
    return method_sort_key(method), -1 if steps is None else steps


def method_labels(runs: Sequence[dict]) -> Dict[int, Tuple[str, Optional[int]]]:
    """id(run) -> (method, steps or None). Steps only kept for methods run with several counts."""
    steps_seen = defaultdict(set)
    for r in runs:
        steps_seen[r["method"]].add(r.get("steps"))
    return {id(r): (r["method"], r.get("steps") if len(steps_seen[r["method"]]) > 1 else None)
            for r in runs}


def label_text(label: Tuple[str, Optional[int]]) -> str:
    method, steps = label
    return method if steps is None else f"{method} (N={steps})"


def group_runs(runs: Sequence[dict]) -> "OrderedDict[Tuple, Dict[str, List[dict]]]":
    """label -> stream -> runs, labels in method order."""
    labels = method_labels(runs)
    table = defaultdict(lambda: defaultdict(list))
    for r in runs:
        table[labels[id(r)]][r["stream"]].append(r)
    for label, streams in table.items():
        for stream, group in streams.items():
            seeds = [r.get("seed") for r in group]
            if len(set(map(str, seeds))) < len(seeds):
                logger.warning("%s on %s: several runs share a seed (%s)", label_text(label), stream,
                               ", ".join(r["name"] for r in group))
    return OrderedDict((k, table[k]) for k in sorted(table, key=_label_sort_key))


def aggregate(values: Iterable[float]) -> Tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; std is nan when n < 2."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return float("nan"), float("nan"), 0
    std = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return statistics.fmean(vals), std, len(vals)


def fmt_stat(values: Iterable[float], digits: int = 1) -> str:
    mean, std, n = aggregate(values)
    if n == 0:
        return "-"
    if n == 1:
        return f"{mean:.{digits}f} (n=1)"
    return f"{mean:.{digits}f} ± {std:.{digits}f} (n={n})"


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align_first_left=True) -> str:
    lines = ["|" + "|".join(header) + "|",
             "|" + "|".join((":--" if (i == 0 and align_first_left) else "--:") for i in range(len(header))) + "|"]
    lines += ["|" + "|".join(str(c) for c in row) + "|" for row in rows]
    return "\n".join(lines)


def streams_of(runs: Sequence[dict]) -> List[str]:
    return sorted({r["stream"] for r in runs})


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
def table_main(runs: Sequence[dict], digits: int = 1) -> str:
    """Methods x streams, WER mean +- sample std over seeds."""
    streams = streams_of(runs)
    rows = []
    for label, by_stream in group_runs(runs).items():
        rows.append([label_text(label)] + [fmt_stat([run_wer(r) for r in by_stream.get(s, [])], digits)
                                           for s in streams])
    return md_table(["Method"] + streams, rows)


def _single_domain_columns(runs: Sequence[dict]) -> "OrderedDict[str, str]":
    """stream -> column title (its domain when domains are unique across streams, else stream)."""
    stream_domain = OrderedDict()
    for r in runs:
        if is_single_domain(r):
            doms = run_domains(r)
            stream_domain.setdefault(r["stream"], doms[0] if doms else r["stream"])
    ordered = sorted(stream_domain, key=lambda s: (stream_domain[s], s))
    unique = len(set(stream_domain.values())) == len(stream_domain)
    return OrderedDict((s, stream_domain[s] if unique else s) for s in ordered)


def table_domains(runs: Sequence[dict], digits: int = 1) -> Optional[str]:
    """Methods x single-domain streams (the paper's Table 1), with the mean over columns."""
    columns = _single_domain_columns(runs)
    if not columns:
        return None
    single = [r for r in runs if r["stream"] in columns]
    rows = []
    for label, by_stream in group_runs(single).items():
        means = [aggregate(run_wer(r) for r in by_stream.get(s, []))[0] for s in columns]
        avg = statistics.fmean(means) if all(not math.isnan(m) for m in means) else float("nan")
        rows.append([label_text(label)]
                    + [fmt_stat([run_wer(r) for r in by_stream.get(s, [])], digits) for s in columns]
                    + [_fmt(avg, digits)])
    return md_table(["Method"] + list(columns.values()) + ["Avg"], rows)


def table_breakdown(runs: Sequence[dict], stream: str, digits: int = 1) -> str:
    """Per-domain WER of one multi-domain stream (domains in stream order, then all)."""
    sruns = [r for r in runs if r["stream"] == stream]
    domains: List[str] = []
    for r in sruns:
        domains += [d for d in run_domains(r) if d not in domains]
    rows = []
    for label, by_stream in group_runs(sruns).items():
        group = by_stream[stream]
        cells = [fmt_stat([run_domain_wer(r).get(d, float("nan")) for r in group], digits) for d in domains]
        rows.append([label_text(label)] + cells + [fmt_stat([run_wer(r) for r in group], digits)])
    return md_table(["Method"] + domains + ["all"], rows)


def detect_boundaries(resets: Sequence[int], boundaries: Sequence[int], window: int = 100) -> dict:
    """Match resets to true boundaries.

    A reset at position r (the first utterance decoded from the reset model) belongs to the last
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
    missed = [b for b in bounds if b not in detected]
    return {"detected": detected, "missed": missed, "false": false}


def _fmt_positions(positions: Sequence[int], limit: int = 20) -> str:
    if not positions:
        return "-"
    text = ", ".join(str(p) for p in positions[:limit])
    return text + (f", ... (+{len(positions) - limit} more)" if len(positions) > limit else "")


def _has_resets(run: dict) -> bool:
    return bool(run["resets"]) or "+" in run["method"] or bool(run.get("lii"))


def table_resets(runs: Sequence[dict], stream: str, window: int = 100) -> Optional[str]:
    """Reset positions per run beside the true boundaries (the paper's Table 6) + detection."""
    sruns = [r for r in runs if r["stream"] == stream and _has_resets(r)]
    if not sruns:
        return None
    bounds = sruns[0]["boundaries"]
    rows = []
    for r in sruns:
        det = detect_boundaries(r["resets"], r["boundaries"], window)
        delays = list(det["detected"].values())
        rows.append([r["method"], str(r.get("seed", "-")), _fmt_positions(r["resets"]), str(len(r["resets"])),
                     f"{len(det['detected'])}/{len(r['boundaries'])}", str(len(det["false"])),
                     _fmt(statistics.fmean(delays), 1) if delays else "-"])
    head = (f"True boundaries (first position of a new segment): {_fmt_positions(bounds, 50)}; "
            f"detection window {window} utterances.\n\n")
    return head + md_table(["Method", "Seed", "Reset positions", "#Resets", "Detected", "False", "Mean delay"],
                           rows)


def espnet_rows(run: dict) -> List[List[str]]:
    """ESPnet ``|dataset|Snt|Wrd|Corr|Sub|Del|Ins|Err|S.Err|`` rows: the stream, then its domains."""
    rows = run.get("transcripts")
    if not rows:
        words = run.get("n_words")
        return [[run["stream"], str(run_n_utts(run)), "-" if words is None else str(_to_int(words)),
                 "-", "-", "-", "-", _fmt(run_wer(run)), "-"]]
    groups = OrderedDict([(run["stream"], rows)])
    domains = OrderedDict()
    for r in rows:
        domains.setdefault(r["domain"], []).append(r)
    if len(domains) > 1:
        groups.update((f"{run['stream']}/{d}", rs) for d, rs in domains.items())
    out = []
    for name, rs in groups.items():
        wrd = sum(r["n_words"] for r in rs)
        sub, dele, ins = (sum(r[k] for r in rs) for k in ("n_sub", "n_del", "n_ins"))
        err = sum(r["n_err"] for r in rs)
        pct = (lambda x: _fmt(100.0 * x / wrd)) if wrd else (lambda x: "-")
        serr = 100.0 * sum(1 for r in rs if r["n_err"] > 0) / len(rs)
        out.append([name, str(len(rs)), str(wrd), pct(wrd - sub - dele), pct(sub), pct(dele), pct(ins),
                    pct(err), _fmt(serr)])
    return out


def table_espnet(run: dict) -> str:
    return md_table(["dataset", "Snt", "Wrd", "Corr", "Sub", "Del", "Ins", "Err", "S.Err"], espnet_rows(run))


def efficiency_stats(runs: Sequence[dict]) -> dict:
    """Means over runs: per-utterance pass counts, total wall time, time per audio second."""
    per_utt = {k: aggregate(_to_float((r.get("counts") or {}).get(k)) / max(run_n_utts(r), 1) for r in runs)[0]
               for k in COUNT_KEYS}
    return {**per_utt,
            "passes": sum(v for v in per_utt.values() if not math.isnan(v)),
            "wall_time_s": aggregate(_to_float(r.get("wall_time_s")) for r in runs)[0],
            "time_per_audio_s": aggregate(run_time_per_audio(r) for r in runs)[0],
            "n": len(runs)}


def table_efficiency(runs: Sequence[dict], stream: str, reference: str = "suta") -> Optional[str]:
    """Forward/backward passes per utterance and runtime per audio second, ratios to SUTA."""
    sruns = [r for r in runs if r["stream"] == stream and (r.get("counts") or r.get("wall_time_s") is not None)]
    if not sruns:
        return None
    groups = group_runs(sruns)
    stats = OrderedDict((label, efficiency_stats(by[stream])) for label, by in groups.items())
    ref = next((s for (m, _), s in stats.items() if m == reference), None)
    rows = []
    for label, s in stats.items():
        t_ratio = s["time_per_audio_s"] / ref["time_per_audio_s"] if ref and ref["time_per_audio_s"] else float("nan")
        p_ratio = s["passes"] / ref["passes"] if ref and ref["passes"] else float("nan")
        rows.append([label_text(label)] + [_fmt(s[k], 2) for k in COUNT_KEYS]
                    + [_fmt(s["wall_time_s"], 1), _fmt(s["time_per_audio_s"], 3), _fmt(t_ratio, 2),
                       _fmt(p_ratio, 2), str(s["n"])])
    header = ["Method", "Adapt fwd/utt", "Adapt bwd/utt", "Infer fwd/utt", "Aux fwd/utt", "Wall time (s)",
              "s per audio s", f"Time x {reference.upper()}", f"Passes x {reference.upper()}", "Runs"]
    return md_table(header, rows)


def steps_groups(runs: Sequence[dict]) -> Dict[str, Dict[str, Dict[int, List[dict]]]]:
    """stream -> method -> steps -> runs, for methods run with >= 2 step counts on a stream."""
    out: Dict[str, Dict[str, Dict[int, List[dict]]]] = {}
    for stream in streams_of(runs):
        by_method = defaultdict(lambda: defaultdict(list))
        for r in runs:
            if r["stream"] == stream and r.get("steps") is not None:
                by_method[r["method"]][r["steps"]].append(r)
        kept = {m: dict(v) for m, v in by_method.items() if len(v) >= 2}
        if kept:
            out[stream] = kept
    return out


def table_steps(runs: Sequence[dict], digits: int = 1) -> Optional[str]:
    groups = steps_groups(runs)
    if not groups:
        return None
    parts = []
    for stream, by_method in groups.items():
        steps = sorted({s for v in by_method.values() for s in v})
        rows = [[m] + [fmt_stat([run_wer(r) for r in by_method[m].get(s, [])], digits) for s in steps]
                for m in sorted(by_method, key=method_sort_key)]
        parts.append(f"**{stream}**\n\n" + md_table(["Method"] + [f"N={s}" for s in steps], rows))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------
# Environment block
# --------------------------------------------------------------------------------------------
def _package_version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # PackageNotFoundError and broken metadata alike
        return "not installed"


def _command(args: Sequence[str], cwd=None) -> Optional[str]:
    if shutil.which(args[0]) is None:
        return None
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(repo_dir=None) -> "OrderedDict[str, str]":
    repo_dir = Path(repo_dir) if repo_dir else Path(__file__).resolve().parents[1]
    env = OrderedDict()
    env["date"] = _dt.datetime.now().astimezone().strftime("%a %b %d %H:%M:%S %Z %Y")
    env["python version"] = sys.version.split()[0]
    for pkg in VERSION_PACKAGES:
        env[f"{pkg} version"] = _package_version(pkg)
    env["Git hash"] = _command(["git", "rev-parse", "HEAD"], cwd=repo_dir) or "unavailable"
    env["CPU"] = f"{_cpu_name()} ({os.cpu_count()} cores)"
    gpus = _command(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    env["GPU"] = "; ".join(gpus.splitlines()) if gpus else "none detected"
    return env


def environment_block(runs: Sequence[dict], repo_dir=None) -> str:
    lines = ["## Environments"] + [f"- {k}: `{v}`" for k, v in environment(repo_dir).items()]
    recorded = OrderedDict()
    for r in runs:
        v = r.get("versions")
        if isinstance(v, dict) and v:
            recorded.setdefault(json.dumps(v, sort_keys=True), []).append(r["name"])
    for versions, names in recorded.items():
        text = ", ".join(f"{k} {val}" for k, val in json.loads(versions).items())
        lines.append(f"- decoded with ({len(names)} run{'s' if len(names) > 1 else ''}): `{text}`")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# RESULTS.md
# --------------------------------------------------------------------------------------------
def _runs_inventory(runs: Sequence[dict], digits: int) -> str:
    rows = [[r["name"], r["method"], r["stream"], str(r.get("seed", "-")),
             "-" if r.get("steps") is None else str(r["steps"]), str(run_n_utts(r)), _fmt(run_wer(r), digits)]
            for r in runs]
    return md_table(["Experiment", "Method", "Stream", "Seed", "Steps", "Utts", "WER (%)"], rows)


def build_markdown(runs: Sequence[dict], plots: Sequence[str] = (), out_dir=None, window: int = 100,
                   digits: int = 1, repo_dir=None) -> str:
    """The whole RESULTS.md text."""
    notes = ("WER (%) = 100 * errors / reference words, pooled over a run's utterances. Cells: mean ± sample "
             "std over runs (seeds), n = number of runs.")
    parts = ["# RESULTS", environment_block(runs, repo_dir),
             "## WER (%) per method and stream", notes, table_main(runs, digits)]
    domains = table_domains(runs, digits)
    if domains:
        parts += ["## WER (%) on single-domain streams", domains]
    multi = [s for s in streams_of(runs) if not all(is_single_domain(r) for r in runs if r["stream"] == s)]
    for s in multi:
        parts += [f"## Per-domain WER (%) on {s}", table_breakdown(runs, s, digits)]
    reset_tables = [(s, table_resets(runs, s, window)) for s in streams_of(runs)]
    if any(t for _, t in reset_tables):
        parts += ["## Reset steps", "Positions are 0-based; a reset at position r means utterance r is the first one decoded "
                  "from the reset model (an oracle reset sits exactly on the boundary). "
                  f"A reset r detects the last boundary b <= r if r - b <= {window} (delay = r - b); "
                  "other resets are false (a second reset in the same segment counts as false)."]
        parts += [f"**{s}**\n\n{t}" for s, t in reset_tables if t]
    eff = [(s, table_efficiency(runs, s)) for s in streams_of(runs)]
    if any(t for _, t in eff):
        parts += ["## Efficiency", "Forward/backward passes per utterance (means over runs, from `counts`), "
                  "wall time, and seconds of compute per second of audio; ratios are to SUTA on the same stream."]
        parts += [f"**{s}**\n\n{t}" for s, t in eff if t]
    steps = table_steps(runs, digits)
    if steps:
        parts += ["## WER (%) vs number of adaptation steps", steps]
    if plots:
        base = Path(out_dir) if out_dir else Path.cwd()
        parts += ["## Plots", "\n".join(f"- [{Path(p).name}]({os.path.relpath(p, base)})" for p in plots)]
    parts += ["## Runs", _runs_inventory(runs, digits), "## Per-experiment scores (ESPnet style)"]
    parts += [f"### {r['name']}\n\n{table_espnet(r)}" for r in runs]
    return "\n\n".join(parts) + "\n"


def write_report(runs: Sequence[dict], root, out=None, plots_dir=None, smooth: int = 100,
                 baseline: str = "source", window: int = 100, digits: int = 1, make_plots: bool = True,
                 repo_dir=None) -> Path:
    """Write plots and RESULTS.md for already collected ``runs``; returns the RESULTS.md path."""
    if not runs:
        raise NoRunsError(f"No experiment directory with a readable summary.json under {root}")
    out = Path(out) if out else Path(root) / "RESULTS.md"
    written: List[str] = []
    if make_plots:
        from tta_brain import plots as _plots  # matplotlib is only imported when plotting
        written = _plots.make_all_plots(runs, plots_dir or Path(root) / "plots", smooth=smooth,
                                        baseline=baseline)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_markdown(runs, written, out.parent, window, digits, repo_dir), encoding="utf-8")
    logger.info("Wrote %s (%d runs, %d plots)", out, len(runs), len(written))
    return out


def write_results(root, out=None, plots_dir=None, smooth: int = 100, baseline: str = "source",
                  window: int = 100, digits: int = 1, make_plots: bool = True, repo_dir=None) -> Path:
    """Collect the runs under ``root``, write plots and RESULTS.md; returns the RESULTS.md path.

    Raises :class:`NoRunsError` when no readable experiment directory is found.
    """
    return write_report(collect_runs(root), root, out, plots_dir, smooth, baseline, window, digits,
                        make_plots, repo_dir)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tta_brain.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--exp_dir", required=True, help="results root holding experiment directories (any depth)")
    p.add_argument("--out", default=None, help="RESULTS.md path (default: <exp_dir>/RESULTS.md)")
    p.add_argument("--plots_dir", default=None, help="plot folder (default: <exp_dir>/plots)")
    p.add_argument("--smooth", type=int, default=100, help="smoothing window (utterances) of WER-over-time plots")
    p.add_argument("--baseline", default="source", help="method tag the WER difference is taken against")
    p.add_argument("--window", type=int, default=100, help="reset detection window (utterances after a boundary)")
    p.add_argument("--digits", type=int, default=1, help="decimals of WER cells")
    p.add_argument("--no_plots", action="store_true", help="tables only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    runs = collect_runs(args.exp_dir)
    try:
        out = write_report(runs, args.exp_dir, args.out, args.plots_dir, args.smooth, args.baseline,
                           args.window, args.digits, not args.no_plots)
    except NoRunsError as err:
        print(f"tta_brain.report: {err}; nothing to report.", file=sys.stderr)
        return 1
    print(table_main(runs, args.digits))
    print(f"\nWrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
