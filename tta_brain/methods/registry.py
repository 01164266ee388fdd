"""The method registry: a name -> method class map that refuses a second class under a taken name;
``build_method`` is how yaml files and the API build a method."""
import inspect
import os
from typing import Dict

__all__ = ["METHODS", "register", "build_method"]

METHODS: Dict[str, type] = {}


def register(name: str):
    """Class decorator: make a method available as ``name``. A name already taken by another
    class is an error (re-importing the same module, as a reload does, is not)."""
    def deco(cls):
        old = METHODS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"method name '{name}' is taken by {old.__module__}.{old.__qualname__}; "
                             f"register {cls.__module__}.{cls.__qualname__} under another name")
        cls.name = name
        METHODS[name] = cls
        return cls
    return deco


def build_method(name: str, **kwargs):
    """The registered method ``name`` built with ``kwargs``; unknown names or options are errors
    naming them and listing what is valid."""
    if name not in METHODS:
        raise ValueError(f"Unknown TTA method '{name}'. Valid: {', '.join(sorted(METHODS))} (a "
                         f"method of your own is registered when its module is imported: the "
                         f"yaml's __module: !apply:importlib.import_module [your_module], above "
                         f"method:, and the module on PYTHONPATH)")
    cls = METHODS[name]
    bad = unknown_options(name, kwargs)
    if bad:
        raise TypeError(bad)
    _check_values(name, kwargs)
    model = kwargs.get("model")
    try:
        return cls(**kwargs)
    except BaseException:       # a subclass that refused after the skeleton marked the model
        if getattr(model, "_tta_method", None) is not None:   # (CEA, SGEM, ...): not taken
            del model._tta_method             # (methods.base.bind_model)
        raise


def unknown_options(name: str, keys) -> str:
    """``build_method``'s refusal of those of ``keys`` that the registered method ``name`` does
    not take, known without building anything ("" when it takes them all, or is not
    registered)."""
    valid = _accepted(METHODS[name]) if name in METHODS else None
    bad = sorted(k for k in keys if valid is not None and k not in valid)
    return bad and (f"method '{name}' has no option(s) {', '.join(bad)}; "
                    f"valid: {', '.join(sorted(valid))}") or ""


#: What a method uses of its ``model``: an ``HFCTCLobe`` (``tta_brain.lobes.hf_ctc``) has them
#: all (a lobe of your own provides them as it does; ARCHITECTURE.md, "The model a method adapts").
MODEL_MEMBERS = ("model", "runtime", "blank_id", "device", "prepare", "logits", "decode",
                 "feature_cache_blocker", "train_draws", "padding_blocker")
#: Options that are true or false in every method (a string "false" was truthy: episodic).
_FLAGS = ("episodic", "train_mode")


def _check_values(name: str, kwargs: dict) -> None:
    """A Python caller's options, checked as a yaml's values are (``tta_brain.hparams.rules``;
    a yaml's were checked when it was read, and pass again): one ValueError naming the option."""
    from tta_brain.hparams import rules         # (the yamls' rules: read here, not imported above)
    where = f"build_method('{name}')"
    for key, value in kwargs.items():
        kind, rng = rules.RULES.get(key) or ((rules.BOOL, None) if key in _FLAGS else (None, None))
        if hasattr(value, "item") and getattr(value, "shape", None) == ():
            value = value.item()       # a numpy or torch scalar (np.int64(3) from an arange)
        if kind == rules.TEXT and isinstance(value, os.PathLike):
            continue                   # a pathlib.Path is a path as its string is
        if kind is not None and not rules.valid_value(value, kind, rng):
            raise ValueError(f"{where}: {key} = {value!r} is not valid: {key} must be "
                             f"{rules.expected(kind, rng)}")
    if "adapt_params" in kwargs:
        try:
            rules.check_adapt_params(where, kwargs["adapt_params"])
        except rules.HparamsError as e:
            raise ValueError(str(e)) from None
    policy = kwargs.get("reset_policy")
    if policy is not None and not callable(getattr(policy, "bind", None)):
        raise ValueError(f"{where}: reset_policy = {policy!r} is not a reset policy: build one "
                         f"with tta_brain.methods.resets.make_reset_policy"
                         f"({str(policy)!r} if a name, ...)")
    model = kwargs.get("model")
    if model is not None:
        missing = [m for m in MODEL_MEMBERS if not hasattr(model, m)]
        if missing:
            raise ValueError(f"{where}: model is a {type(model).__name__}, which has no "
                             f"{', '.join(missing)}: a method adapts an HFCTCLobe "
                             f"(tta_brain.lobes.hf_ctc.HFCTCLobe(source): any transformers CTC "
                             f"checkpoint, a folder or a hub name)")


def _accepted(cls):
    """Keyword arguments the class accepts along its constructor chain (None: any)."""
    names = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        names.update(n for n, p in params.items() if n != "self"
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return names
    return names
