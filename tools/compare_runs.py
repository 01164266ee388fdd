#!/usr/bin/env python3
"""Are two result trees the same run for run? Compares every experiment folder (a folder with a
``summary.json``) found under both roots, by relative path: the record files row by row and the
summary's result fields exactly (timings, versions and recorded settings are not compared).

Used to check that a refactoring changed no result (bit for bit on CPU)::

    python tools/compare_runs.py /tmp/exp_before /tmp/exp_after

Prints one line per folder (``same``, what differs, with the first differing row, or on which
side alone it finished) and exits with 1 if anything differs or a folder is missing or
unfinished on one side, 2 if a root is not a directory or neither holds a run folder.
"""
import argparse
import csv
import os
import sys
from pathlib import Path

from tta_brain.run.folder import walk
from tta_brain.run.records import RecordError
from tta_brain.run.summary import read_summary

RECORDS = ("transcripts.csv", "resets.csv", "lii.csv", "rejects.csv")
SUMMARY_KEYS = ("method", "stream", "seed", "wer", "wer_per_domain", "n_utts", "n_words", "n_err",
                "n_skipped", "skipped", "resets", "boundaries", "counts")


def runs(root: Path):
    """The run folders under ``root`` (a ``summary.json``) by relative path, found as the report
    finds them (``run.folder.walk``: linked folders followed)."""
    return {os.path.relpath(d, root): Path(d) for d, files in walk(root)
            if "summary.json" in files}


def _rows(path: Path):
    if not path.is_file():
        return None
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as e:       # a corrupt record
        raise ValueError(f"{path} is not a UTF-8 CSV ({e})") from None


def compare(a: Path, b: Path):
    """Differences between two experiment folders (empty: the same results)."""
    diffs = []
    for name in RECORDS:
        try:
            ra, rb = _rows(a / name), _rows(b / name)
        except ValueError as e:                          # a difference, named
            diffs.append(f"{name}: {e}")
            continue
        if ra != rb:
            if ra is None or rb is None:
                diffs.append(f"{name}: missing on one side")
                continue
            first = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y),
                         min(len(ra), len(rb)))
            diffs.append(f"{name}: {len(ra)} vs {len(rb)} rows, first difference at row {first}: "
                         f"{ra[first] if first < len(ra) else '-'} != "
                         f"{rb[first] if first < len(rb) else '-'}")
    try:                      # through the module that owns the file (an unreadable one: a line)
        sa, sb = read_summary(a), read_summary(b)
    except RecordError as e:
        return diffs + [str(e)]
    for key in SUMMARY_KEYS:
        if getattr(sa, key) != getattr(sb, key):
            diffs.append(f"summary {key}: {getattr(sa, key)!r} != {getattr(sb, key)!r}")
    return diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root_a", type=Path)
    p.add_argument("root_b", type=Path)
    args = p.parse_args(argv)
    for root in (args.root_a, args.root_b):   # nothing compared must not read as "the same"
        if not root.is_dir():
            print(f"ERROR: {root}: no such directory", file=sys.stderr)
            return 2
    ra, rb = runs(args.root_a), runs(args.root_b)
    if not ra and not rb:
        print(f"ERROR: no run folder (one with a summary.json) under {args.root_a} or "
              f"{args.root_b}: nothing to compare", file=sys.stderr)
        return 2
    bad = 0
    for name in sorted(set(ra) | set(rb)):
        if name not in ra or name not in rb:
            has, lacks = ((args.root_a, args.root_b) if name in ra else
                          (args.root_b, args.root_a))
            unfinished = (lacks / name).is_dir()     # a run killed, or still running, there
            print(f"{name}: only under {has}" + (f" (under {lacks}: unfinished, no summary.json)"
                                                 if unfinished else ""))
            bad += 1
            continue
        diffs = compare(ra[name], rb[name])
        print(f"{name}: " + ("same" if not diffs else "DIFFERENT\n  " + "\n  ".join(diffs)))
        bad += bool(diffs)
    print(f"{len(set(ra) | set(rb)) - bad} same, {bad} different or missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
