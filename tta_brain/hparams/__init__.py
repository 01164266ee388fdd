"""Method hyperparameters: the packaged yamls (one per method, plus the shared ``run`` and ``reset``
blocks) and the one loader that finds, composes and builds them, with one-line errors.

A method yaml names the blocks it shares on a line ``include: [run, reset]``; :func:`compose`
puts their text in front of its own (a block is a packaged name, or a path relative to the yaml),
so every key of the result is top-level and ``--key=value`` overrides reach all of them. A yaml
without an ``include`` line is used as it is.
"""
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import ruamel.yaml
import ruamel.yaml.error
import yaml
from hyperpyyaml import load_hyperpyyaml, resolve_references

__all__ = ["HPARAMS_DIR", "BLOCKS", "HparamsError", "available", "find", "compose", "load",
           "Resolved", "resolve", "describe", "keys", "check", "check_device", "RULES"]

HPARAMS_DIR = Path(__file__).resolve().parent
BLOCKS = ("run", "reset")
_INCLUDE = re.compile(r"^include:[ \t]*(\[[^\]\n]*\]|[^\s#]+)[^\n]*\n?", re.M)

PathLike = Union[str, os.PathLike]


class HparamsError(ValueError):
    """A yaml or an override that cannot be used; the message is one line naming file and key."""


def available() -> List[str]:
    """The packaged method names (``tta_brain/hparams/<name>.yaml`` minus the blocks)."""
    return sorted(p.stem for p in HPARAMS_DIR.glob("*.yaml") if p.stem not in BLOCKS)


def find(name_or_path: PathLike) -> Path:
    """A yaml path, or the packaged yaml of a method name (``dsuta``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = HPARAMS_DIR / f"{name_or_path}.yaml"
    if str(name_or_path) in available():
        return packaged
    folder = path.parent if str(path.parent) not in ("", ".") else None
    known = (sorted(p.stem for p in folder.glob("*.yaml")) if folder and folder.is_dir()
             else available())
    where = f" (yamls in {folder}: " if folder and folder.is_dir() else " (packaged methods: "
    raise HparamsError(f"hparams file not found: {name_or_path}{where}{', '.join(known)})")


def compose(path: PathLike) -> str:
    """The yaml text of ``path`` with the blocks of its ``include`` line in front."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    match = _INCLUDE.search(text)
    if match is None:
        return text
    names = [n.strip() for n in match.group(1).strip("[]").split(",") if n.strip()]
    parts = []
    for name in names:
        block = HPARAMS_DIR / f"{name}.yaml" if not name.endswith(".yaml") else path.parent / name
        if not block.is_file():
            raise HparamsError(f"{path}: include '{name}' not found (blocks: {', '.join(BLOCKS)}, "
                               f"or a .yaml path relative to {path.parent})")
        parts.append(f"# ---- {name} (from {block.name})\n{block.read_text(encoding='utf-8')}")
    body = text[:match.start()] + text[match.end():]
    return "\n".join(parts) + f"\n# ---- {path.name}\n" + body


@dataclass
class Resolved:
    """A yaml worked out once: composed with its blocks, the overrides applied, the references
    resolved and the values checked. ``values`` are plain (``!new:`` / ``!apply:`` nodes stay
    tagged: for checks, ``--help``, fingerprints and records); :meth:`build` makes the objects
    from the same text; :attr:`record` is what a run folder keeps as ``hyperparams.yaml``."""
    path: Path
    text: str
    values: Dict

    @property
    def record(self) -> str:
        return f"# Resolved from {self.path} with the command-line overrides\n" + self.text

    def build(self) -> Dict:
        """The yaml's objects (model, method, reset policy)."""
        with _errors(self.path):
            return load_hyperpyyaml(self.text)


def resolve(name_or_path: PathLike, overrides: Optional[Union[Dict, str]] = None) -> Resolved:
    """Find, compose and resolve a yaml with ``overrides`` once, and :func:`check` its values."""
    path = find(name_or_path)
    with _errors(path):
        text = resolve_references(compose(path), overrides, overrides_must_match=True).getvalue()
        values = ruamel.yaml.YAML().load(text)
    check(path, values)
    return Resolved(path, text, values)


def load(name_or_path: PathLike, overrides=None) -> Dict:
    """Build the yaml's objects with the overrides applied (after :func:`check` of the values)."""
    return resolve(name_or_path, overrides).build()


def keys(name_or_path: PathLike) -> List[str]:
    """The top-level keys of a yaml (with its blocks), in file order; nothing is resolved."""
    return re.findall(r"^([A-Za-z_]\w*):", compose(find(name_or_path)), re.M)


def describe(name_or_path: PathLike) -> List[Tuple[str, str, str]]:
    """``(key, default, comment)`` of every top-level scalar key, in file order (for ``--help``)."""
    path = find(name_or_path)
    out = []
    for line in compose(path).splitlines():
        m = re.match(r"^([A-Za-z_]\w*):[ \t]*([^#\n]*?)[ \t]*(?:#[ \t]*(.*))?$", line)
        if not m or m.group(1).startswith("__"):
            continue
        if m.group(2).startswith("!"):
            if m.group(2) == "!PLACEHOLDER":
                out.append((m.group(1), "(required)", m.group(3) or ""))
            continue
        if m.group(2) == "":      # a mapping or list follows: not a scalar key
            continue
        out.append((m.group(1), m.group(2), m.group(3) or ""))
    return out


# ---------------------------------------------------------------------------- value checks
#: Types and ranges of the packaged yamls' keys: (kind, test, what a valid value is). A value
#: that fails is an error naming the key before anything is built.
_INT, _FLOAT, _BOOL = "an integer", "a number", "true or false"
RULES = {
    "seed": (_INT, None), "steps": (_INT, ">=0"), "buffer_size": (_INT, ">=1"),
    "ckpt_every": (_INT, ">=0"), "max_duration": (_FLOAT, ">=0"), "lr": (_FLOAT, ">0"),
    "slow_lr": (_FLOAT, ">0?"), "lr_min": (_FLOAT, ">=0"), "em_coef": (_FLOAT, "0..1"),
    "temperature": (_FLOAT, ">0"), "layernorm_lr_mult": (_FLOAT, ">=0"),
    "cnn_lr_mult": (_FLOAT, ">=0"), "ema_decay": (_FLOAT, "0..1"), "renyi_alpha": (_FLOAT, ">0"),
    "ns_coef": (_FLOAT, ">=0"), "ns_threshold": (_FLOAT, ">=0"), "beam_width": (_INT, ">=1"),
    "lm_weight": (_FLOAT, None), "word_bonus": (_FLOAT, None), "reset_every": (_INT, ">=1"),
    "reset_K": (_INT, ">=4"), "reset_patience": (_INT, ">=1"), "reset_threshold": (_FLOAT, None),
    "cuda_graph_cache": (_INT, ">=1"), "cuda_graph_warmup": (_INT, ">=0"),
    "compile": (_BOOL, None), "cpu_native_backward": (_BOOL, None), "train_mode": (_BOOL, None),
    "deterministic": (_BOOL, None),
    "cuda_graphs": (("auto", "on", "off"), None), "cuda_device_steps": (_BOOL, None),
    "precision": (("fp32", "bf16", "fp16"), None), "cache_features": (("auto", "on", "off"), None),
    "reset": (("none", "fixed", "oracle", "dynamic"), None), "fast_moments": (("slow", "zero"), None),
    "slow_grad": (("reuse", "recompute"), None), "param_collection": (("clean", "official"), None),
    "reset_lii_count": (("paper", "official"), None),
}


def _valid(value, kind, rng) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(kind, tuple):
        return isinstance(value, str) and value in kind
    if rng == ">0?" and value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == _INT and not isinstance(value, int):
        return False
    if not math.isfinite(value):
        return False
    return {None: True, ">=0": value >= 0, ">0": value > 0, ">0?": value > 0, ">=1": value >= 1,
            ">=4": value >= 4, "0..1": 0 <= value <= 1}[rng]


def _expected(kind, rng) -> str:
    if isinstance(kind, tuple):
        return "one of " + ", ".join(kind)
    text = {None: "", ">=0": " >= 0", ">0": " > 0", ">0?": " > 0 (or null)", ">=1": " >= 1",
            ">=4": " >= 4", "0..1": " between 0 and 1"}[rng]
    return kind + text


def check(path, values: Dict) -> None:
    """Every known key's value has its type and range, and ``device`` exists here; else an
    :class:`HparamsError` naming the key, the value, what it must be and what the key means."""
    meaning = None
    for key, (kind, rng) in RULES.items():
        if key in values and not _valid(values[key], kind, rng):
            meaning = meaning or {k: c for k, _, c in describe(path)}
            what = f" ({meaning[key]})" if meaning.get(key) else ""
            raise HparamsError(f"{path}: {key} = {values[key]!r} is not valid: {key} must be "
                               f"{_expected(kind, rng)}{what}")
    if values.get("reset") == "dynamic":
        _check_dynamic_reset(path, values)
    if "device" in values:
        check_device(values["device"])


def _check_dynamic_reset(path, values: Dict) -> None:
    """The dynamic reset's K against the LII count and the meta-update period (buffer_size)."""
    K, M = values.get("reset_K"), values.get("buffer_size")
    if K is None:
        return
    if values.get("reset_lii_count") == "official" and K < 5:
        raise HparamsError(f"{path}: reset_K = {K} with reset_lii_count = official is not valid: "
                           f"K/2 utterances build phi_D and the official count keeps K/2 - 1 LII "
                           f"values, at least 2 are needed for the Gaussian; use reset_K >= 5")
    if M is not None and K // 2 < M:
        raise HparamsError(
            f"{path}: reset_K = {K} with buffer_size = {M}: phi_D is saved after K/2 = {K // 2} "
            f"utterances, before the first meta-update (every {M}), so it is the source model, "
            f"every LII is 0 and the reset never fires; use reset_K >= {2 * M}")


def check_device(device) -> None:
    """``cpu``, or a CUDA device that exists on this machine."""
    name = str(device)
    if name == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise HparamsError(f"device = {name!r} (--device) is not valid: use cpu, cuda or cuda:N")
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        build = "" if torch.backends.cuda.is_built() else ", a CPU-only build"
        raise HparamsError(f"--device={name}: no CUDA device here (torch {torch.__version__}"
                           f"{build} sees none); available: cpu")
    index = int(name.split(":")[1]) if ":" in name else 0
    if index >= n:
        raise HparamsError(f"--device={name}: this machine has {n} CUDA device(s): "
                           + ", ".join(f"cuda:{i}" for i in range(n)))


class _errors:
    """Turn hyperpyyaml / yaml / constructor errors into one-line :class:`HparamsError`."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, typ, err, tb):
        if err is None or isinstance(err, HparamsError):
            return False
        where = str(self.path)
        if isinstance(err, KeyError):
            raise HparamsError(f"{where}: {err.args[0]} (check the spelling of the keys and of "
                               f"the --key=value overrides)") from err
        if isinstance(err, (yaml.YAMLError, ruamel.yaml.error.YAMLError)):
            msg = " ".join(str(err).replace("<unicode string>", where).split())
            raise HparamsError(f"{where}: yaml syntax error (in the file or a --key=value "
                               f"override): {msg}") from err
        if isinstance(err, TypeError):
            raise HparamsError(f"{where}: {_describe(err)} (check the spelling of the keys "
                               f"passed to that class in the yaml)") from err
        if isinstance(err, (ValueError, ImportError, AttributeError, RuntimeError, OSError)):
            raise HparamsError(f"{where}: {_describe(err)}") from err
        return False


def _describe(err) -> str:
    """hyperpyyaml wraps constructor errors as ``(context, message)`` tuples: join them."""
    parts = [str(a) for a in err.args] or [type(err).__name__]
    return " ".join(": ".join(parts).split())
