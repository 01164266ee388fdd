"""Which parameters a method adapts, declared in yaml.

A selection is a list of groups; each group names a selector and an optional learning-rate
multiplier, e.g. the paper's default (and the official SUTA code)::

    adapt_params:
      - {select: layernorm}
      - {select: cnn, lr_mult: 1.0}

Selectors (a parameter belongs to the first group that selects it):

* ``layernorm``: weight and bias of every ``nn.LayerNorm``
* ``feature_extractor``: the convolutional feature encoder (with its GroupNorm / LayerNorms)
* ``feature_projection``: the projection (LayerNorm + Linear) into the transformer
* ``cnn``: ``feature_extractor`` + ``feature_projection``
* ``encoder_bias``: every bias inside the transformer encoder
* ``all``: every parameter
* ``regex:<pattern>``: parameter names matching a regular expression

The official SUTA/DSUTA code puts the CNN tensors into the optimiser several times (conv weights
and GroupNorm 4x, feature projection 2x), which gives them several Adam updates per step; an
``lr_mult`` per group approximates that (see README, "Deviations").
"""
import logging
import re
from typing import Dict, Iterable, List, Sequence, Tuple, Union

from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["select_parameters", "param_groups", "describe_selection", "SELECTORS"]


def _in_module(name: str, module_name: str) -> bool:
    return re.search(rf"(^|\.){module_name}\.", name) is not None


def _layernorm_names(model: nn.Module) -> set:
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.LayerNorm):
            for p_name, _ in mod.named_parameters(recurse=False):
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


SELECTORS = {
    "layernorm": lambda name, ln: name in ln,
    "feature_extractor": lambda name, ln: _in_module(name, "feature_extractor"),
    "feature_projection": lambda name, ln: _in_module(name, "feature_projection"),
    "cnn": lambda name, ln: _in_module(name, "feature_extractor") or _in_module(name, "feature_projection"),
    "encoder_bias": lambda name, ln: _in_module(name, "encoder") and name.endswith(".bias"),
    "all": lambda name, ln: True,
}


def _selector(spec: str):
    if spec.startswith("regex:"):
        pattern = re.compile(spec[len("regex:"):])
        return lambda name, ln: pattern.search(name) is not None
    if spec not in SELECTORS:
        raise ValueError(f"Unknown parameter selector '{spec}'. Valid: "
                         f"{', '.join(SELECTORS)}, regex:<pattern>")
    return SELECTORS[spec]


GroupSpec = Union[str, Dict]


def _assign(model: nn.Module, groups: Sequence[GroupSpec]) -> List[Tuple[str, nn.Parameter, float, str]]:
    """``[(name, parameter, lr_mult, selector)]`` in model order (first matching group wins)."""
    if not groups:
        raise ValueError("adapt_params is empty: select at least one parameter group")
    specs = []
    for g in groups:
        g = {"select": g} if isinstance(g, str) else dict(g)
        unknown = set(g) - {"select", "lr_mult"}
        if "select" not in g or unknown:
            raise ValueError(f"Bad adapt_params entry {g}: use {{select: <selector>, lr_mult: <float>}}")
        specs.append((g["select"], _selector(g["select"]), float(g.get("lr_mult", 1.0))))
    ln = _layernorm_names(model)
    chosen = []
    for name, p in model.named_parameters():
        for spec, sel, mult in specs:
            if sel(name, ln):
                chosen.append((name, p, mult, spec))
                break
    for spec, sel, _ in specs:
        if not any(sel(n, ln) for n, _ in model.named_parameters()):
            logger.warning("Parameter selector '%s' matches no parameter of %s", spec,
                           type(model).__name__)
    if not chosen:
        raise ValueError(f"adapt_params {list(groups)} selects no parameter of {type(model).__name__}")
    return chosen


def select_parameters(model: nn.Module, groups: Sequence[GroupSpec]) -> List[Tuple[str, nn.Parameter, float]]:
    """``[(name, parameter, lr_mult)]`` in model order for the given group specs."""
    return [(n, p, m) for n, p, m, _ in _assign(model, groups)]


def describe_selection(model: nn.Module, groups: Sequence[GroupSpec]) -> str:
    """What each group selects, for the log: ``layernorm (lr x1): 25 tensors, 0.012M; ...``."""
    by_group: Dict[str, List] = {}
    for _, p, mult, spec in _assign(model, groups):
        by_group.setdefault(f"{spec} (lr x{mult:g})", []).append(p)
    return "; ".join(f"{g}: {len(ps)} tensors, {sum(p.numel() for p in ps) / 1e6:.3f}M"
                     for g, ps in by_group.items())


def param_groups(selected: Iterable[Tuple[str, nn.Parameter, float]], lr: float) -> List[Dict]:
    """Optimiser parameter groups, one per distinct lr multiplier."""
    by_mult: Dict[float, List] = {}
    for _, p, mult in selected:
        by_mult.setdefault(mult, []).append(p)
    return [{"params": ps, "lr": lr * m} for m, ps in by_mult.items()]
