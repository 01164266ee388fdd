"""The method registry: a name -> method class map that refuses a second class under a taken name;
``build_method`` is how yaml files and the API build a method."""
import inspect
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
    valid = _accepted(cls)
    bad = sorted(k for k in kwargs if valid is not None and k not in valid)
    if bad:
        raise TypeError(f"method '{name}' has no option(s) {', '.join(bad)}; "
                        f"valid: {', '.join(sorted(valid))}")
    return cls(**kwargs)


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
