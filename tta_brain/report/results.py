"""RESULTS.md (tables of ``tta_brain.report.tables``, mean +- sample std over seeds) and the plots of a tree
of finished runs.

Usage::

    python -m tta_brain.report --exp_dir results/ [--out results/RESULTS.md]
        [--plots_dir results/plots] [--smooth 100] [--baseline source] [--window 100]
        [--metric wer|cer|wer_official]

Every folder (any depth) holding a ``summary.json`` is read with ``tta_brain.run.folder.load_run``
(its records and summary, through the modules that write them); a folder it cannot read is
skipped with a warning naming the file and why, and a folder with records but no summary (a run
still going or interrupted) is listed as unfinished.
Conventions (also written into RESULTS.md): WER of a run = 100 * errors / reference words over its
transcripts; cells are ``mean ± sample std (n=runs)`` over the runs (seeds) of a (method, stream)
pair; a reset at position r detects the last true boundary b <= r when r - b <= window; a method
run with several step counts is split into rows ``method (N=steps)``. ``--metric cer``: every
table and plot of character error rates instead (100 * character edits / reference characters,
spaces counted; for languages written without spaces), into ``RESULTS_cer.md`` and ``cer_*`` plots
by default, beside the WER report. ``--metric wer_official``: the WERs of the official code's
scoring (apostrophes deleted, as its jiwer pipeline does; ``RESULTS_wer_official.md``), to set
beside the paper's tables.
"""
import argparse
import errno
import json
import logging
import os
import re
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Sequence

from tta_brain.data.cache import same_source
from tta_brain.report import tables, tags
from tta_brain.run.envinfo import environment
from tta_brain.run.folder import Run, load_run, walk
from tta_brain.run.identity import differences
from tta_brain.run.records import RecordError
from tta_brain.run.summary import read_summary

logger = logging.getLogger("tta_brain.report.results")  # same name under python -m

class NoRunsError(ValueError):
    """Raised when a results root holds no readable experiment directory."""


def collect_runs(root, skipped: Optional[list] = None, stream: Optional[str] = None,
                 other_streams: Optional[set] = None) -> List[Run]:
    """All finished experiment folders under ``root`` (any depth), sorted by stream, method, seed.
    The run folders left out (unreadable, unfinished, or started and stopped before any
    utterance: a ``fingerprint.json`` and no record) are logged and, given a list ``skipped``,
    added to it as ``(folder relative to root, why)``. ``stream``: only that stream's runs; the
    others' records are not read (a long report of one stream among 200 runs of 3,000
    utterances read them all: 1 GB), their stream names added to ``other_streams``."""
    root = Path(root)
    if not root.is_dir():
        logger.warning("Results root %s does not exist", root)
        return []
    runs = []

    def skip(dirpath, why):
        logger.warning("Skipping %s: %s", dirpath, why)
        if skipped is not None:
            skipped.append((os.path.relpath(dirpath, root), why))
    for dirpath, filenames in walk(root):
        if "summary.json" in filenames:
            try:
                if stream is not None:
                    name = read_summary(dirpath).stream
                    if name != stream:
                        if other_streams is not None:
                            other_streams.add(name)
                        continue
                runs.append(load_run(dirpath, root))
            except RecordError as err:
                skip(dirpath, str(err))
        elif "transcripts.csv" in filenames:
            skip(dirpath, "transcripts.csv but no summary.json: running or stopped (its "
                          "log.txt says), or none of its utterances could be decoded (its "
                          "rejects.csv says why)")
        elif "fingerprint.json" in filenames:
            skip(dirpath, "no records yet: running, or stopped before its first utterance "
                          "(its log.txt says why)")
    runs.sort(key=lambda r: (r.stream, tags.sort_key(r.method), _seed_key(r.seed), r.name))
    for line in pooling_warnings(runs):
        logger.warning("%s", line)
    return runs


def pooling_warnings(runs: Sequence[Run]) -> List[str]:
    """The (method, stream) cells whose runs are not seeds of one experiment, though the tables
    pool them as such: a seed given twice (a copy, or another SNR's folder of the same stream
    name) or fingerprints that differ in more than the seed (another stream file, model or
    setting). One line each, naming the differing keys and the runs. Then
    :func:`stream_warnings`, then :func:`twin_warnings`."""
    return _cell_warnings(runs) + stream_warnings(runs) + twin_warnings(runs)


def twin_warnings(runs: Sequence[Run]) -> List[str]:
    """Runs of one fingerprint (method, settings, seed, stream file and model alike: one
    experiment) under several labels, e.g. a plain decode's ``suta`` and a grid's
    ``suta_steps2`` of the same settings: shown as other methods' rows. One line per set of
    labels and stream, naming the runs."""
    labels, twins = tables.method_labels(runs), OrderedDict()
    for r in runs:      # (one without its yaml's digests, "structure", does not say the method)
        if (r.summary.fingerprint or {}).get("structure"):
            key = (r.stream, json.dumps(r.summary.fingerprint, sort_keys=True))
            twins.setdefault(key, []).append(r)
    found = OrderedDict()
    for (stream, _), group in twins.items():
        names = tuple(OrderedDict((tables.label_text(labels[id(r)]), None) for r in group))
        if len(names) > 1:
            found.setdefault((names, stream), []).extend(group)
    return [f"{' and '.join(names)} on {stream}: one experiment under {len(names)} labels (runs "
            f"of one fingerprint: method, settings, seed, stream file and model: "
            f"{_names(group)}), shown as other methods' rows: report it once (move the other "
            f"folders out of --exp_dir)" for (names, stream), group in found.items()]


def stream_warnings(runs: Sequence[Run]) -> List[str]:
    """The stream columns whose runs decoded different stream files though the tables compare
    them side by side (a stream written again after some runs, e.g. ``--force_streams``, and
    only some decoded again; another SNR's folder of the same name), or adapted different source
    models (another ``--model`` decoded into the same experiment folder): one line each, naming
    the files (rows, sha1) or models and the runs on each."""
    files, models = OrderedDict(), OrderedDict()
    for r in runs:
        fp = r.summary.fingerprint or {}
        if fp.get("stream_sha1"):
            files.setdefault(r.stream, OrderedDict()).setdefault(
                (fp["stream_sha1"], fp.get("n_rows")), []).append(r)
        if r.source_model:
            models.setdefault(r.stream, OrderedDict()).setdefault(r.source_model, []).append(r)
    lines = []
    for stream, found in files.items():
        if len(found) < 2:
            continue
        parts = [(f"{rows} rows, " if rows is not None else "") + f"sha1 {sha[:10]}: "
                 + _names(group) for (sha, rows), group in found.items()]
        lines.append(f"stream {stream}: its runs decoded {len(found)} different stream files "
                     f"({'; '.join(parts)}), compared side by side as one stream: decode the "
                     f"runs of the stale file again on the current one (--decode_opts="
                     f"--overwrite) or report each file's runs apart (--exp_dir)")
    for stream, found in models.items():
        found = _hub_names_joined(found)
        if len(found) > 1:
            parts = [f"{model if model.startswith('hub:') else model[:17]}: {_names(group)}"
                     for model, group in found.items()]
            lines.append(f"stream {stream}: its runs adapted {len(found)} different source "
                         f"models ({'; '.join(parts)}), compared side by side as one experiment: "
                         f"give each model its own experiment folder (--exp_dir) and report "
                         f"each apart")
    return lines


def _hub_names_joined(found: "OrderedDict[str, List[Run]]") -> "OrderedDict[str, List[Run]]":
    """Runs by source model, a hub model recorded without its commit joined to the one commit
    of that name the others record (two commits: two models, it stays apart: which it ran on is
    not known)."""
    out = OrderedDict()
    for model, group in found.items():
        alike = [m for m in found if m != model and same_source(m, model) and "@" in m]
        key = alike[0] if "@" not in model and len(alike) == 1 else model
        out.setdefault(key, []).extend(group)
    return out


def _names(group: Sequence[Run]) -> str:
    return ", ".join(r.name for r in group[:4]) + (", ..." if len(group) > 4 else "")


def run_warnings(runs: Sequence[Run]) -> List[str]:
    """Each run's own ``warnings`` (summary.json: a reset that cannot fire, adaptation steps
    skipped for non-finite values, many empty hypotheses), one line each naming the run: its
    cell in the tables is a number like any other."""
    return [f"{r.name}: {w}" for r in runs for w in (r.summary.warnings or [])]


def skip_warnings(runs: Sequence[Run]) -> List[str]:
    """One line per stream whose runs scored different utterances (a run skipped some the
    others decoded: too long for its ``max_duration``, unreadable, too short for its model):
    the tables set their WERs side by side, over other sets of utterances."""
    lines = []
    for stream in OrderedDict((r.stream, None) for r in runs):
        sruns = [r for r in runs if r.stream == stream]
        sets = {r.name: frozenset(s.get("position") for s in (r.summary.skipped or []))
                for r in sruns}
        if len(set(sets.values())) > 1:
            said = [f"{name} skipped {len(pos)}" for name, pos in sets.items() if pos]
            lines.append(f"{stream}: the runs scored different utterances ({', '.join(said[:4])}"
                         f"{', ...' if len(said) > 4 else ''}; the others none or other ones): "
                         f"their {stream} WERs are over other sets of utterances (each run's "
                         f"rejects.csv lists its skips)")
    return lines


#: keys whose default follows the seed (FOA's and E-BATS's ``cma_seed: !ref <seed> + N``)
SEEDED_KEYS = ("cma_seed",)


def _follows_seed(runs: Sequence[Run]) -> set:
    """``hparams.<key>`` of :data:`SEEDED_KEYS` that are the seed plus one offset in every run
    (each seed's own draws, as the yaml's default gives them: no other experiment)."""
    out = set()
    for key in SEEDED_KEYS:
        offsets = set()
        for r in runs:
            hp = (r.summary.fingerprint or {}).get("hparams", {})
            try:
                offsets.add(int(hp[key]) - int(hp["seed"]))
            except (KeyError, TypeError, ValueError):
                offsets.add(None)
        if len(offsets) == 1 and None not in offsets:
            out.add(f"hparams.{key}")
    return out


def _cell_warnings(runs: Sequence[Run]) -> List[str]:
    groups, labels = OrderedDict(), tables.method_labels(runs)    # a table's cell: its label
    for r in runs:
        groups.setdefault((labels[id(r)], r.stream), []).append(r)
    lines = []
    for (label, stream), group in groups.items():
        seeds = [str(r.seed) for r in group]
        twice = sorted({s for s in seeds if seeds.count(s) > 1}, key=_seed_key)
        known = [r for r in group if r.summary.fingerprint]     # (the first may have none)
        base = known[0].summary.fingerprint if known else None
        keys = sorted({d.partition(": ")[0] for r in known[1:]
                       for d in differences(base, r.summary.fingerprint, recorded=True)}
                      - {"hparams.seed"} - _follows_seed(known))
        unknown = [r.name for r in group if not r.summary.fingerprint] if known else []
        why = ([f"seed{'s' if len(twice) > 1 else ''} {', '.join(twice)} more than once"] if twice
               else []) + \
              ([f"settings other than the seed differ ({', '.join(keys)})"] if keys else []) + \
              ([f"{len(unknown)} run(s) record no settings to compare ({', '.join(unknown[:4])}"
                f"{', ...' if len(unknown) > 4 else ''}: no fingerprint in summary.json)"]
               if unknown else [])
        if why:
            names = [r.name for r in group]
            lines.append(f"{tables.label_text(label)} on {stream}: {' and '.join(why)} across "
                         f"its {len(group)} runs ({', '.join(names[:4])}"
                         f"{', ...' if len(names) > 4 else ''}), pooled "
                         f"as seeds of one experiment: if they are other experiments, name them "
                         f"apart (--method_tag; the grid's --decode_opts and --sweep do) or "
                         f"report each experiment's folder (--exp_dir)")
    return lines


def _seed_key(seed):
    """Numeric seeds in numeric order, others after them as text."""
    try:
        return 0, float(seed), ""
    except (TypeError, ValueError):
        return 1, 0.0, str(seed)


def environment_block(runs: Sequence[Run], repo_dir=None) -> str:
    lines = ["## Environments", "Where this report was written (each run's own machine, versions and "
             "checkout are in its env.log):"] \
        + [f"- {k}: `{v}`" for k, v in environment(repo_dir).items()]
    recorded = OrderedDict()
    for r in runs:
        if r.summary.versions:
            recorded.setdefault(json.dumps(r.summary.versions, sort_keys=True), []).append(r.name)
    for versions, names in recorded.items():
        text = ", ".join(f"{k} {val}" for k, val in json.loads(versions).items())
        lines.append(f"- decoded with ({len(names)} run{'s' if len(names) > 1 else ''}): `{text}`")
    return "\n".join(lines)


#: what a cell of each metric is, for the notes of RESULTS.md
DEFINITIONS = {"wer": "WER (%) = 100 * errors / reference words",
               "cer": "CER (%) = 100 * character edits / reference characters (spaces counted, "
                      "after the same normalisation as the WER)",
               "wer_official": "WER-official (%) = 100 * errors / reference words, words as the "
                              "official code's jiwer scoring splits them (apostrophes deleted: "
                              "DON'T is DONT)"}


def build_markdown(runs: Sequence[Run], plots: Sequence[str] = (), out_dir=None, window: int = 100,
                   digits: int = 1, repo_dir=None, metric: str = "wer", skipped=()) -> str:
    """The whole RESULTS.md text; ``metric="cer"``: of runs from :func:`tables.in_metric`;
    ``skipped``: the run folders :func:`collect_runs` left out, listed under "Not reported"."""
    M = tables.label(metric)
    notes = (f"{DEFINITIONS[metric]}, pooled over a run's utterances. Cells: "
             "mean ± sample std over runs (seeds), n = number of runs.")
    skipped_utts = sum(r.summary.n_skipped or 0 for r in runs)
    if skipped_utts:      # (were only in each run's rejects.csv: a WER over fewer utterances)
        notes += (f" Utterances a run skipped (its rejects.csv: audio too short or too long, "
                  f"unreadable, an empty reference) are in no {M}: "
                  f"{skipped_utts} in all, each run's count in the Runs table (Skipped).")
    warnings = pooling_warnings(runs) + run_warnings(runs) + skip_warnings(runs)
    parts = ["# RESULTS", environment_block(runs, repo_dir)]
    if warnings:
        parts += ["## Warnings", "\n".join(f"- {w}" for w in warnings)]
    if skipped:                  # (were only on stderr: the tables just lacked those runs)
        parts += ["## Not reported", "Run folders left out of every table:\n\n"
                  + "\n".join(f"- `{rel}`: {why}" for rel, why in skipped)]
    parts += [f"## {M} (%) per method and stream", notes, tables.table_main(runs, digits)]
    domains = tables.table_domains(runs, digits)
    if domains:
        parts += [f"## {M} (%) on single-domain streams", domains]
    for s in tables.streams_of(runs):
        sruns = [r for r in runs if r.stream == s]
        # (a stream without domains, in segments: its one domain "" was a column without title)
        if not all(map(tables.is_single_domain, sruns)) and \
                any(d for r in sruns for d in tables.run_domain_wer(r)):
            parts += [f"## Per-domain {M} (%) on {s}", tables.table_breakdown(runs, s, digits)]
    resets = [(s, tables.table_resets(runs, s, window)) for s in tables.streams_of(runs)]
    if any(t for _, t in resets):
        parts += ["## Reset steps",
                  "Positions are 0-based; a reset at position r means utterance r is the first one "
                  "decoded from the reset model (an oracle reset sits exactly on the boundary). "
                  f"A reset r detects the last boundary b <= r if r - b <= {window} (delay = r - b); "
                  "other resets are false (a second reset in the same segment counts as false)."]
        parts += [f"**{s}**\n\n{t}" for s, t in resets if t]
    eff = [(s, tables.table_efficiency(runs, s)) for s in tables.streams_of(runs)]
    if any(t for _, t in eff):
        parts += ["## Efficiency", "Forward/backward passes per utterance (means over runs; a "
                  "pass is one forward or one backward of the model, auxiliary forwards such as "
                  "AWMC's anchor or the dynamic reset's LII included), wall time of the decode "
                  "loop (model loading left out; mean over runs), and seconds of compute per "
                  "second of audio; ratios are to SUTA on the same stream (its one tagged "
                  "variant, e.g. suta_steps1, where no run is tagged suta): time per audio "
                  "second, and passes per utterance (the four columns' sum)."]
        parts += [f"**{s}**\n\n{t}" for s, t in eff if t]
    steps = tables.table_steps(runs, digits)
    if steps:
        parts += [f"## {M} (%) vs number of adaptation steps", steps]
    if plots:
        base = Path(out_dir) if out_dir else Path.cwd()
        parts += ["## Plots", "\n".join(f"- [{Path(p).name}]({_link(os.path.relpath(p, base))})"
                                        for p in plots)]
    parts += ["## Runs", tables.runs_inventory(runs, digits, metric),
              "## Per-experiment scores (ESPnet style)"]
    parts += [f"### {r.name}\n\n{tables.table_espnet(r, metric, digits)}" for r in runs]
    return "\n\n".join(parts) + "\n"


def _link(path: str) -> str:
    """A Markdown link target: a path with spaces or parentheses (``--plots_dir "my figs (1)"``)
    in angle brackets, where the link was cut at its first space."""
    return f"<{path}>" if re.search(r"[\s()<>]", path) else path


def write_report(runs: Sequence[Run], root, out=None, plots_dir=None, smooth: int = 100,
                 baseline: str = "source", window: int = 100, digits: int = 1,
                 make_plots: bool = True, repo_dir=None, metric: str = "wer",
                 skipped=()) -> Path:
    """Write plots and RESULTS.md (``metric="cer"``: RESULTS_cer.md and ``cer_*`` plots, of
    character error rates) for already collected ``runs``; returns the RESULTS.md path."""
    if not runs:
        raise NoRunsError(f"No experiment directory with a readable summary.json under {root}")
    out = Path(out) if out else Path(root) / ("RESULTS.md" if metric == "wer"
                                              else f"RESULTS_{metric}.md")
    if out.is_dir():                                  # before the plots: they take a while
        raise IsADirectoryError(errno.EISDIR, "is a folder (--out names the RESULTS.md file)",
                                str(out))
    runs = tables.in_metric(runs, metric)
    written: List[str] = []
    if make_plots:
        from tta_brain.report import plots  # matplotlib is only imported when plotting
        written = plots.make_all_plots(runs, plots_dir or Path(root) / "plots", smooth=smooth,
                                       baseline=baseline, metric=metric)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build_markdown(runs, written, out.parent, window, digits, repo_dir, metric,
                                  skipped), encoding="utf-8")
    logger.info("Wrote %s (%d runs, %d plots)", out, len(runs), len(written))
    return out


def write_results(root, out=None, **kwargs) -> Path:
    """Collect the runs under ``root``, write plots and RESULTS.md; returns the RESULTS.md path.
    Raises :class:`NoRunsError` when no readable experiment directory is found."""
    skipped = []
    return write_report(collect_runs(root, skipped), root, out, skipped=skipped, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tta_brain.report",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--exp_dir", required=True, type=os.path.expanduser,
                   help="results root holding experiment directories")
    p.add_argument("--out", default=None, type=os.path.expanduser,
                   help="RESULTS.md path (default: <exp_dir>/RESULTS.md; "
                   "with --metric cer: <exp_dir>/RESULTS_cer.md)")
    p.add_argument("--metric", default="wer", choices=tuple(tables.METRICS),
                   help="error rate of every table and plot: wer (words) or cer (characters, "
                        "spaces counted: languages written without spaces) or wer_official "
                        "(words as the official code scores them: apostrophes deleted)")
    p.add_argument("--plots_dir", default=None, type=os.path.expanduser,
                   help="plot folder (default: <exp_dir>/plots)")
    p.add_argument("--smooth", type=int, default=100,
                   help="smoothing window (utterances) of WER-over-time plots")
    p.add_argument("--baseline", default=None, help="tag the WER difference is taken against "
                   "(default: source)")
    p.add_argument("--window", type=int, default=100,
                   help="reset detection window (utterances after a boundary)")
    p.add_argument("--digits", type=int, default=1, help="decimals of WER (CER) cells")
    p.add_argument("--no_plots", action="store_true", help="tables only")
    args = p.parse_args(argv)
    for name, low in (("smooth", 1), ("window", 0), ("digits", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name} {getattr(args, name)}: must be an integer >= {low}")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    skipped = []
    runs = collect_runs(args.exp_dir, skipped)
    tags = sorted({r.method for r in runs})
    if args.baseline is not None and runs and args.baseline not in tags and not args.no_plots:
        logger.warning("--baseline %r: no run has that tag (tags: %s); the %s-over-time plots "
                       "show absolute %s", args.baseline, ", ".join(tags), tables.label(args.metric),
                       tables.label(args.metric))
    try:
        out = write_report(runs, args.exp_dir, args.out, args.plots_dir, args.smooth,
                           args.baseline or "source", args.window, args.digits,
                           not args.no_plots, metric=args.metric, skipped=skipped)
    except NoRunsError as err:
        print(f"tta_brain.report.results: {err}; nothing to report.", file=sys.stderr)
        old = Path(args.out) if args.out else Path(args.exp_dir) / (
            "RESULTS.md" if args.metric == "wer" else f"RESULTS_{args.metric}.md")
        if old.is_file():               # kept (nothing is deleted), but not taken for current
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(old.stat().st_mtime))
            print(f"tta_brain.report.results: {old} is an earlier report (written {when}), "
                  f"left as it was; it does not describe the runs there now.", file=sys.stderr)
        return 1
    except OSError as err:                  # RESULTS.md: a folder, no permission, a full disk
        print(f"ERROR: cannot write {err.filename or args.out}: {err.strerror or err} (--out)",
              file=sys.stderr)
        return 1
    print(tables.table_main(tables.in_metric(runs, args.metric), args.digits))
    print(f"\nWrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
