"""Which parameters a method adapts, declared in yaml.

A selection is a list of groups; each group names a selector and an optional learning-rate
multiplier, e.g. the paper's default (and the official SUTA code)::

    adapt_params:
      - {select: layernorm}
      - {select: cnn, lr_mult: 1.0}

Selectors (a parameter belongs to the first group that selects it):

* ``layernorm``: weight and bias of every ``nn.LayerNorm``
* ``feature_extractor``: the convolutional feature encoder (with its GroupNorm / LayerNorms);
  Parakeet CTC's (FastConformer): its convolutional subsampling (``encoder.subsampling.layers``)
* ``feature_projection``: the projection (LayerNorm + Linear) into the transformer; Parakeet's:
  the subsampling's Linear (``encoder.subsampling.linear``)
* ``cnn``: ``feature_extractor`` + ``feature_projection``
* ``encoder_bias``: every bias inside the transformer encoder (Parakeet's: not its subsampling)
* ``all``: every parameter
* ``regex:<pattern>``: parameter names matching a regular expression

How the optimiser sees the selection is one more entry of the list, ``{param_collection: X}``
(the packaged yamls set it from the top-level key ``param_collection``):

* ``clean`` (default): every selected tensor once.
* ``official``: the optimiser list of the paper's code (``SUTASystem.collect_params`` in
  hhhaaahhhaa/Dynamic-SUTA; the original SUTA repository's differs in one point: its LayerNorm
  rule is unguarded, so there the projection's LayerNorm appears 3x). It walks
  ``named_modules()`` in order; a ``LayerNorm``'s weight and bias are appended once (guarded by
  ``requires_grad``), and *every* module at or below the feature encoder or the feature
  projection appends all of its parameters, recursively and unguarded. A tensor
  therefore appears once per module on its path from ``feature_extractor`` / ``feature_projection``
  down to its owner: wav2vec2-base's conv weights and GroupNorm 4x, the projection's Linear and
  LayerNorm 2x (63 tensors, 94 entries). The repeats are derived from the module tree of any
  model; selected tensors outside these two rules (``encoder_bias``, ``regex``) enter once.
  ``tta_brain.methods.optim.RepeatedAdam`` applies such a list exactly as
  ``torch.optim.AdamW(..., foreach=True)`` over the list with the repeats (what the official code
  runs on a GPU), without putting a tensor into torch's list twice.
* ``ebats``: the list of the E-BATS reference benchmark's ``collect_params`` (its CEA's first
  stage: LayerNorm + feature encoder + projection), which is the official list with the
  LayerNorm rule unguarded (a LayerNorm at or below the projection is appended by that rule
  too: wav2vec2-base's projection LayerNorm 3x), applied as its AdamW runs it, ``foreach=False``:
  a tensor that appears ``k`` times takes ``k`` complete Adam steps one after the other
  (``RepeatedAdam(sequential=True)``).
"""
import logging
import re
from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["select_parameters", "param_groups", "describe_selection", "SELECTORS", "Selection",
           "COLLECTIONS", "FEATURE_MODULES", "official_entries"]

#: How the optimiser sees the selected tensors (``param_collection``).
COLLECTIONS = ("clean", "official", "ebats")
#: The modules under which the official collection appends every module's parameters again.
FEATURE_MODULES = ("feature_extractor", "feature_projection")


def _in_module(name: str, module_name: str) -> bool:
    return re.search(rf"(^|\.){module_name}\.", name) is not None


def _layernorm_names(model: nn.Module) -> set:
    names = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.LayerNorm):
            for p_name, _ in mod.named_parameters(recurse=False):
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


#: The feature encoder and the projection by family: the wav2vec 2.0 family's modules, and
#: Parakeet CTC's convolutional subsampling (inside its encoder) and its Linear.
FEATURE_ENCODERS = ("feature_extractor", r"encoder\.subsampling\.layers")
PROJECTIONS = ("feature_projection", r"encoder\.subsampling\.linear")


def _in_any(name: str, module_names: Sequence[str]) -> bool:
    return any(_in_module(name, m) for m in module_names)


SELECTORS = {
    "layernorm": lambda name, ln: name in ln,
    "feature_extractor": lambda name, ln: _in_any(name, FEATURE_ENCODERS),
    "feature_projection": lambda name, ln: _in_any(name, PROJECTIONS),
    "cnn": lambda name, ln: _in_any(name, FEATURE_ENCODERS + PROJECTIONS),
    "encoder_bias": lambda name, ln: (_in_module(name, "encoder") and name.endswith(".bias")
                                      and not _in_module(name, r"encoder\.subsampling")),
    # a module's own weight and bias (CoTTA's reference collect_params): not a weight norm's
    # g and v (parametrizations.weight.original0/1), nor wav2vec2's masked_spec_embed
    "weights_and_biases": lambda name, ln: name.rpartition(".")[2] in ("weight", "bias"),
    "all": lambda name, ln: True,
}


def _selector(spec: str):
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec[len("regex:"):])
        except re.error as e:
            raise ValueError(f"Bad parameter selector '{spec}': {e}") from None
        return lambda name, ln: pattern.search(name) is not None
    if spec not in SELECTORS:
        raise ValueError(f"Unknown parameter selector '{spec}'. Valid: "
                         f"{', '.join(SELECTORS)}, regex:<pattern>")
    return SELECTORS[spec]


GroupSpec = Union[str, Dict]


def _collection(groups: Sequence[GroupSpec], key: str = "adapt_params"
                ) -> Tuple[List[GroupSpec], str]:
    """The selector groups and the ``{param_collection: ...}`` entry's value (default clean);
    ``key``: the yaml key they come from, in the messages."""
    rest, found = [], []
    for g in groups or ():
        if isinstance(g, dict) and "param_collection" in g:
            if set(g) != {"param_collection"} or g["param_collection"] not in COLLECTIONS:
                raise ValueError(f"Bad {key} entry {g}: use {{param_collection: "
                                 f"{' | '.join(COLLECTIONS)}}}")
            found.append(g["param_collection"])
        else:
            rest.append(g)
    if len(found) > 1:
        raise ValueError(f"{key} sets param_collection {len(found)} times")
    return rest, (found[0] if found else "clean")


def group_specs(groups: Sequence[GroupSpec], key: str = "adapt_params"
                ) -> List[Tuple[str, object, float]]:
    """``[(selector spec, selector, lr_mult)]`` of ``adapt_params`` (its ``param_collection``
    entry left out), every entry checked: a ValueError saying which is wrong (the yaml check,
    ``hparams.rules.check_adapt_params``, asks this before anything is built); ``key``: the yaml
    key they come from (``adapt_params``, CEA's ``stage2_params``), in the messages."""
    if not isinstance(groups, (list, tuple)):
        raise ValueError(f"{key} = {groups!r} is not a list of selector groups, e.g. "
                         f"[layernorm, {{select: cnn, lr_mult: 2}}]")
    groups, _ = _collection(groups, key)
    if not groups:
        raise ValueError(f"{key} is empty: select at least one parameter group")
    specs = []
    for g in groups:
        g = {"select": g} if isinstance(g, str) else g
        if not isinstance(g, dict) or "select" not in g or set(g) - {"select", "lr_mult"} \
                or not isinstance(g["select"], str):
            raise ValueError(f"Bad {key} entry {g!r}: a selector name or {{select: "
                             f"<selector>, lr_mult: <float>}}")
        mult = g.get("lr_mult", 1.0)
        if isinstance(mult, bool) or not isinstance(mult, (int, float)) \
                or not 0 <= mult < float("inf"):
            raise ValueError(f"Bad {key} entry {dict(g)}: lr_mult {mult!r} must be a "
                             f"number >= 0")
        specs.append((g["select"], _selector(g["select"]), float(mult)))
    return specs


def _assign(model: nn.Module, groups: Sequence[GroupSpec]) -> List[Tuple[str, nn.Parameter, float, str]]:
    """``[(name, parameter, lr_mult, selector)]`` in model order (first matching group wins)."""
    specs = group_specs(groups)
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


class Selection(list):
    """The selected ``(name, parameter, lr_mult)`` triples, each tensor once, in model order (what
    a method adapts, snapshots and restores), plus how its optimiser sees them:

    * ``collection``: ``clean``, ``official`` or ``ebats``;
    * ``order``: indices into the selection, one per entry of the optimiser's list, in the
      official code's order with its repeats (``clean``: each index once, in model order);
    * ``repeats``: entries per tensor (aligned with the selection).
    """

    def __init__(self, items=(), collection: str = "clean", order: Optional[Sequence[int]] = None):
        super().__init__(items)
        if collection not in COLLECTIONS:
            raise ValueError(f"param_collection must be one of {', '.join(COLLECTIONS)}, "
                             f"not '{collection}'")
        self.collection = collection
        self.order = list(range(len(self))) if order is None else list(order)
        count = Counter(self.order)
        if sorted(count) != list(range(len(self))):
            raise ValueError("Selection.order must name every selected tensor at least once")
        self.repeats = [count[i] for i in range(len(self))]

    def entries(self) -> List[Tuple[str, nn.Parameter, float]]:
        """The optimiser's list: ``(name, parameter, lr_mult)`` per entry, with the repeats."""
        return [self[i] for i in self.order]

    def on(self, tensors: Sequence[torch.Tensor]) -> "Selection":
        """The same selection (names, multipliers, collection, order) over other tensors of the
        same shapes, e.g. DSUTA's meta-parameters."""
        tensors = list(tensors)
        if len(tensors) != len(self):
            raise ValueError(f"Selection.on: {len(tensors)} tensors for {len(self)} selected")
        return Selection([(n, t, m) for (n, _, m), t in zip(self, tensors)], self.collection,
                         self.order)


def _under_feature_module(module_name: str) -> bool:
    return any(part in FEATURE_MODULES for part in module_name.split("."))


def official_entries(model: nn.Module, chosen: Sequence[nn.Parameter],
                     guard_layernorm: bool = True) -> List[Tuple[str, nn.Parameter]]:
    """The official code's optimiser list restricted to the ``chosen`` tensors: ``[(name,
    parameter)]`` with repeats, in its order. Walking ``named_modules()`` (pre-order):

    1. a ``LayerNorm``'s ``weight`` / ``bias`` are appended if not in the list yet (with
       ``guard_layernorm=False``, the E-BATS reference's rule: whether in the list or not);
    2. a module at or below ``feature_extractor`` / ``feature_projection`` appends all its
       parameters (``named_parameters()``, recursive), whether in the list already or not;
    3. (beyond the official rules) a chosen tensor of another module, not in the list yet, is
       appended once at its owning module.

    For the CTC models of ``transformers`` (``<base>.feature_extractor...``) rule 2 is the
    official ``name.split('.')[1] in (feature_extractor, feature_projection)``.
    """
    want = {id(p) for p in chosen}
    out, seen = [], set()

    def add(name, p):
        out.append((name, p))
        seen.add(id(p))

    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, nn.LayerNorm):
            for pn, p in mod.named_parameters():
                if pn in ("weight", "bias") and id(p) in want \
                        and not (guard_layernorm and id(p) in seen):
                    add(prefix + pn, p)
        if _under_feature_module(mod_name):
            for pn, p in mod.named_parameters():
                if id(p) in want:
                    add(prefix + pn, p)
        elif not isinstance(mod, nn.LayerNorm):
            for pn, p in mod.named_parameters(recurse=False):
                if id(p) in want and id(p) not in seen:
                    add(prefix + pn, p)
    missing = want - seen
    if missing:
        raise ValueError(f"official_entries: {len(missing)} chosen tensors are not parameters "
                         f"of {type(model).__name__}")
    return out


def select_parameters(model: nn.Module, groups: Sequence[GroupSpec]) -> Selection:
    """``[(name, parameter, lr_mult)]`` in model order for the given group specs (a
    :class:`Selection`; an entry ``{param_collection: official | ebats}`` sets its optimiser
    order)."""
    _, collection = _collection(groups)
    chosen = Selection([(n, p, m) for n, p, m, _ in _assign(model, groups)])
    if collection == "clean":
        return chosen
    index = {id(p): i for i, (_, p, _) in enumerate(chosen)}
    order = [index[id(p)] for _, p in official_entries(model, [p for _, p, _ in chosen],
                                                        guard_layernorm=collection != "ebats")]
    return Selection(chosen, collection, order)


def describe_selection(model: nn.Module, groups: Sequence[GroupSpec]) -> str:
    """What each group selects, for the log: ``layernorm (lr x1): 25 tensors, 0.012M; ...``
    (with the official collection: how many optimiser entries, and the repeats)."""
    by_group: Dict[str, List] = {}
    for _, p, mult, spec in _assign(model, groups):
        by_group.setdefault(f"{spec} (lr x{mult:g})", []).append(p)
    text = "; ".join(f"{g}: {len(ps)} tensors, {sum(p.numel() for p in ps) / 1e6:.3f}M"
                     for g, ps in by_group.items())
    sel = select_parameters(model, groups)
    if sel.collection != "clean":
        hist = Counter(sel.repeats)
        text += (f"; param_collection {sel.collection}: {len(sel.order)} optimiser entries for "
                 f"{len(sel)} tensors (" + ", ".join(f"{hist[k]} x{k}" for k in sorted(hist, reverse=True))
                 + ")")
    return text


def param_groups(selected: Iterable[Tuple[str, nn.Parameter, float]], lr: float) -> List[Dict]:
    """Optimiser parameter groups, one per distinct lr multiplier. With the official collection
    each group also holds ``repeats`` (entries per tensor, for ``tta_brain.methods.optim.RepeatedAdam``)."""
    selected = list(selected) if not isinstance(selected, Selection) else selected
    repeats = getattr(selected, "repeats", None) if getattr(selected, "collection", "clean") != "clean" else None
    by_mult: Dict[float, Dict] = {}
    for i, (_, p, mult) in enumerate(selected):
        g = by_mult.setdefault(mult, {"params": [], "lr": lr * mult})
        g["params"].append(p)
        if repeats is not None:
            g.setdefault("repeats", []).append(repeats[i])
    return list(by_mult.values())
