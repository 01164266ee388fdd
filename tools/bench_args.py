"""Argument types of the benchmark tools (bench_speed, bench_memory, bench_sweep) and gpu_check:
a bad value is one argparse line naming the option, before any model is built or run. Every
number is finite: ``nan`` and ``inf`` are refused too (``--lr nan`` ran with every step
skipped)."""
import argparse
import math
import os


def _bounded(kind, ok, says: str, name: str):
    """An argparse type: a finite ``kind(text)`` for which ``ok(value)``, else "<text> is not
    <says>"."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if isinstance(value, float) and not math.isfinite(value):   # 10**400: an OverflowError
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {says}")
        return value
    parse.__name__ = name
    return parse


def positive(kind):
    """``type=positive(int)``: a number > 0."""
    return _bounded(kind, lambda v: v > 0, "> 0", f"positive {kind.__name__}")


def at_least(kind, low):
    """``type=at_least(int, 0)``: a number >= ``low``."""
    return _bounded(kind, lambda v: v >= low, f">= {low:g}", f"{kind.__name__} >= {low:g}")


def finite(kind):
    """``type=finite(float)``: any number but nan and inf (a threshold that may be negative)."""
    return _bounded(kind, lambda v: True, "", f"finite {kind.__name__}")


def seed(text):
    """``type=seed``: a seed the runs take (``rules``' range: numpy's, 0 .. 2**32 - 1)."""
    from tta_brain.hparams.rules import RANGES
    ok, says = RANGES["seed"]
    return _bounded(int, ok, says.strip(), "seed")(text)


def auto_or(one):
    """``type=auto_or(at_least(int, 1))``: ``auto``, or what the type ``one`` takes (the run
    block's graph options)."""
    def parse(text):
        return "auto" if text == "auto" else one(text)
    parse.__name__ = f"auto or {one.__name__}"
    return parse


def output_file(text):
    """``type=output_file``: a file whose folder exists (checked before the benchmark runs, not
    after: its figures would be lost)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder")
    return text


def device(text):
    """``type=device``: cpu, or a CUDA device this machine has (the runs' own rule)."""
    from tta_brain.hparams.rules import HparamsError, check_device
    try:
        check_device(text)
    except HparamsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def positives(kind, n):
    """``type=positives(float, 2)``: ``n`` comma-separated numbers > 0 (``3,8``)."""
    one = positive(kind)

    def parse(text):
        values = [one(v) for v in text.split(",")]
        if len(values) != n:
            raise argparse.ArgumentTypeError(f"{text!r}: {n} values, comma-separated")
        return values
    parse.__name__ = f"{n} positive {kind.__name__}s"
    return parse
