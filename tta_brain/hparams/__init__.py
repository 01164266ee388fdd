"""Method hyperparameters: the packaged yamls (one per method, plus the shared ``run`` and ``reset``
blocks) and the one loader that finds, composes and builds them, with one-line errors.

A method yaml names the blocks it shares on a line ``include: [run, reset]``; :func:`compose`
puts their text in front of its own (a block is a packaged name, or a path relative to the yaml),
so every key of the result is top-level and ``--key=value`` overrides reach all of them. A yaml
without an ``include`` line is used as it is.
"""
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import ruamel.yaml
import ruamel.yaml.comments
import ruamel.yaml.error
import yaml
from hyperpyyaml import load_hyperpyyaml, resolve_references

from tta_brain.hparams import rules
from tta_brain.hparams.rules import RULES, HparamsError, check_device

__all__ = ["HPARAMS_DIR", "BLOCKS", "HparamsError", "available", "find", "compose", "load",
           "Resolved", "resolve", "check_required", "describe", "keys", "check", "check_device",
           "RULES", "structure"]

HPARAMS_DIR = Path(__file__).resolve().parent
BLOCKS = ("run", "reset")
_INCLUDE = re.compile(r"^include:[ \t]*(\[[^\]\n]*\]|[^\s#]+)[^\n]*\n?", re.M)

PathLike = Union[str, os.PathLike]


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


_TOP_KEY = re.compile(r"^([A-Za-z_]\w*)[ \t]*:")


def _entries(lines: List[str]) -> List[Tuple[Optional[str], List[int]]]:
    """Top-level entries of yaml ``lines``: (key or None, its line indices); an entry runs on
    over indented lines and column-0 list items (``key:`` then ``- a``)."""
    out: List[Tuple[Optional[str], List[int]]] = []
    for i, line in enumerate(lines):
        m = _TOP_KEY.match(line)
        if m:
            out.append((m.group(1), [i]))
        elif out and out[-1][0] is not None and (line[:1] in (" ", "\t") or line.startswith("- ")):
            out[-1][1].append(i)
        else:
            out.append((None, [i]))
    return out


def composed_lines(path: PathLike) -> List[Tuple[str, Path, int]]:
    """The lines of :func:`compose` as ``(text, file, line number in that file)``: the blocks of
    the ``include`` line first, each without the keys ``path`` sets itself (the file's own value
    wins over its block's), then the file without its ``include`` line."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    match = _INCLUDE.search(text)
    own = [(t, path, n) for n, t in enumerate(text.splitlines(), 1)]
    if match is None:
        return own
    include_line = text[:match.start()].count("\n") + 1
    body = [x for x in own if x[2] != include_line]
    mine = {k for k, _ in _entries([t for t, _, _ in body]) if k}
    names = [n.strip() for n in match.group(1).strip("[]").split(",") if n.strip()]
    out = []
    for name in names:
        block = HPARAMS_DIR / f"{name}.yaml" if not name.endswith(".yaml") else path.parent / name
        if not block.is_file():
            raise HparamsError(f"{path}: include '{name}' not found (blocks: {', '.join(BLOCKS)}, "
                               f"or a .yaml path relative to {path.parent})")
        block_text = block.read_text(encoding="utf-8")
        inner = _INCLUDE.search(block_text)         # (not followed: its blocks must be listed)
        missing = [n.strip() for n in (inner.group(1).strip("[]").split(",") if inner else [])
                   if n.strip() and n.strip() not in names]
        if missing:
            listed = ", ".join(missing + names)
            raise HparamsError(f"{path}: include '{name}' ({block.name}) includes "
                               f"{', '.join(missing)} itself; includes are not followed: list "
                               f"{'it' if len(missing) == 1 else 'them'} in this file's include "
                               f"line (include: [{listed}])")
        lines = block_text.splitlines()
        out += [("", block, 0)] if out else []                  # a blank line between blocks
        out.append((f"# ---- {name} (from {block.name})", block, 0))
        out += [(lines[i], block, i + 1) for key, idx in _entries(lines) if key not in mine
                for i in idx]
    return out + [("", path, 0), (f"# ---- {path.name}", path, 0)] + body


def compose(path: PathLike) -> str:
    """The yaml text of ``path`` with the blocks of its ``include`` line in front (a key the file
    sets itself is taken out of its block: the file's value wins)."""
    text = "\n".join(t for t, _, _ in composed_lines(path))
    return text + "\n" if Path(path).read_text(encoding="utf-8").endswith("\n") else text


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
        # (first: the yamls import SpeechBrain, which without this changes torch's settings)
        from tta_brain import quirks  # noqa: F401
        with _errors(self.path):
            return load_hyperpyyaml(self.text)


def resolve(name_or_path: PathLike, overrides: Optional[Union[Dict, str]] = None,
            device_here: bool = True) -> Resolved:
    """Find, compose and resolve a yaml with ``overrides`` once, and :func:`check` its values
    (``device_here=False``: the run decodes on another machine, whose devices are not known here:
    a Slurm job's node)."""
    path = find(name_or_path)
    with _errors(path):
        lines = composed_lines(path)
        composed = compose(path)
    try:                        # the file's own syntax first: its errors at its file:line
        preview = ruamel.yaml.YAML().load(composed)
    except ruamel.yaml.error.YAMLError as e:
        raise HparamsError(f"{path}: yaml syntax error: {_located(e, lines)}") from None
    _check_mapping_overrides(path, preview, overrides)
    with _errors(path):
        try:
            text = resolve_references(composed, overrides, overrides_must_match=True).getvalue()
        except (yaml.YAMLError, ruamel.yaml.error.YAMLError) as e:   # the file parsed: an override
            msg = re.sub(r'(in "<unicode string>", )?line \d+, column \d+:?|\(line: \d+\)', "",
                         " ".join(str(e).split()))
            raise HparamsError(f"{path}: a --key=value override is not valid yaml: "
                               f"{' '.join(msg.split())}") from None
        values = ruamel.yaml.YAML().load(text)
    given = _check_override_keys(path, values, overrides)
    _check_read(path, [t for t, _, _ in lines], given)
    check(path, values, device_here)
    rules.check_overrides(path, values, given)       # (after the values: a bad one says so first)
    return Resolved(path, text, values)


def _check_mapping_overrides(path, preview, overrides) -> None:
    """A mapping (``--adapt_params={select: cnn}``) for a key whose yaml value is none was
    hyperpyyaml's "The structure of the overrides doesn't match the structure of the document"
    with every override listed: now the key's own message (its rule's, the selector groups'),
    or one line naming it."""
    if not overrides:
        return
    given = ruamel.yaml.YAML().load(overrides) if isinstance(overrides, str) else overrides
    for key, value in (given or {}).items():
        if isinstance(value, dict) and not isinstance((preview or {}).get(key, {}), dict):
            check(path, {key: dict(value)})
            raise HparamsError(f"{path}: --{key}={dict(value)}: {key} takes no mapping "
                               f"({{...}} is key: value pairs)")


def check_required(resolved: "Resolved") -> None:
    """A required key (``!PLACEHOLDER``) of a command-line run given empty or null
    (``--output_folder=``: an unset shell variable) is refused as one not given: it was taken as
    no value, and the run wrote its records into a folder named ``None`` before a TypeError
    traceback. (A live stream, :class:`tta_brain.stream.TTAStream`, has no manifest or folder.)"""
    for key in re.findall(r"^(\w+):[ \t]*!PLACEHOLDER\b", compose(resolved.path), re.M):
        value = resolved.values.get(key)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise HparamsError(f"{_required(resolved.path, key)}; it was given empty")


#: The objects a run is made of: an override of one must build another (a ``!new:`` /
#: ``!apply:`` / ``!ref`` value), not replace it by a plain value (``--method=foo`` failed
#: half-way through opening the run folder, ``--model=x`` with "'str' object has no attribute").
BUILT_KEYS = ("model", "method", "runtime")
#: Objects a method yaml builds and passes to its method (``optimizer: !name:...``): the same
#: (``--optimizer=sgd`` was "'str' object is not callable" once the model had loaded; an empty
#: one ran plain AdamW, eata's ``eata_optimizer`` dropped), but not read by name; a mapping
#: overrides its arguments (``--optimizer={weight_decay: 0.1}``).
PASSED_OBJECTS = ("optimizer",)


def _check_override_keys(path, values: Dict, overrides) -> List[str]:
    """Refuse an override of an internal key (``__set_seed``: replacing the yaml's seeding step
    left a run unseeded whose records said seed 0) or a plain value for one of
    :data:`BUILT_KEYS` or :data:`PASSED_OBJECTS`. Returns the overridden keys."""
    if not overrides:
        return []
    given = ruamel.yaml.YAML().load(overrides) if isinstance(overrides, str) else overrides
    for key, value in (given or {}).items():
        if str(key).startswith("__"):
            raise HparamsError(f"--{key}: an internal key of {path} (a step the yaml runs when "
                               f"it is built), not an option")
        tag = getattr(getattr(value, "tag", None), "value", None)
        built = isinstance(tag, str) and tag.startswith("!")
        if not built and (key in BUILT_KEYS or (key in PASSED_OBJECTS    # (a mapping: new
                                                and not isinstance(value, dict))):  # arguments)
            raise HparamsError(f"--{key}={value}: '{key}' is an object the yaml builds (see "
                               f"{path}), not a value; change its arguments (python -m "
                               f"tta_brain.decode <method> --help) or build another in a yaml "
                               f"of your own")
    return list(given or {})


#: Keys that name a run and change nothing in it: a ``!ref`` of theirs is no reading.
_LABELS = ("method_tag",)


def _read_by_name() -> set:
    """Keys the code reads by name from a run's values, not through a ``!ref`` of the yaml: the
    run block's (``seed``, ``source``, ``max_duration``, ...), the labels and the objects."""
    return set(keys(HPARAMS_DIR / "run.yaml")) | set(_LABELS) | set(BUILT_KEYS)


def _check_read(path, lines: List[str], given) -> None:
    """Refuse an override of a key that nothing reads: no ``!ref <key>`` of the composed yaml
    (a label, ``method_tag``, does not count: it names the run, it does not change it) and no
    key the code reads by name. A key of one's own yaml that is not passed on to its class
    (``min_conf: 0.5`` without ``min_conf: !ref <min_conf>`` under ``method:``), or the reset
    block's keys in a yaml that builds its own ``reset_policy`` (``--reset=oracle``: a grid's
    ``+oracle`` token), decoded the same run under another name and fingerprint."""
    if not given:
        return
    refs, labels, by_name = set(), set(), _read_by_name()
    for key, idx in _entries(lines):
        (labels if key in _LABELS else refs).update(
            re.findall(r"<(\w+)", "\n".join(lines[i] for i in idx)))
    unread = [k for k in given if k not in refs and k not in by_name
              and not str(k).startswith("__")]
    if unread:
        key = unread[0]
        block = (HPARAMS_DIR / "reset.yaml").read_text(encoding="utf-8")
        hint = ("the reset block's keys are read by its reset_policy, which this yaml replaces "
                "with its own" if re.search(rf"^{key}\s*:", block, re.M) else
                f"a key of your own reaches your class as '{key}: !ref <{key}>' under method:")
        where = (f"only the label {' / '.join(_LABELS)} names it" if key in labels
                 else f"no !ref <{key}>")
        raise HparamsError(f"{path}: --{key} would not change the run: nothing in this yaml reads "
                           f"it ({where}; {hint})")


def structure(path: PathLike, keys, overrides: Optional[Union[Dict, str]] = None,
              added: Sequence[str] = ()) -> Dict[str, str]:
    """A digest (sha1, 12 hex digits) of each of ``keys`` (a yaml's nested values: the method's and
    model's blocks, lists of selectors) as written in the composed yaml or its override, the
    references kept as ``!ref <key>`` and the tags as their names, comments and key order left out:
    what a run's plain values do not say (another optimiser class, a selector, ``lr: !ref <lr> *
    2`` inside the method's block), for its fingerprint. The references' targets are plain values
    counted by themselves, so a copy of a packaged yaml digests as the packaged one. An entry
    ``name: !ref <key>`` of a key in ``added`` (keys added to the packaged yamls later, whose
    plain value the fingerprint holds) is left out, so a block that gained one digests as it did
    before."""
    import hashlib
    import json
    rt = ruamel.yaml.YAML()
    with _errors(path):
        nodes = rt.load(compose(find(path))) or {}
        if isinstance(overrides, str):
            overrides = rt.load(overrides) if overrides.strip() else {}
    nodes = {**nodes, **(overrides or {})}
    return {k: hashlib.sha1(json.dumps(_canonical(nodes[k], frozenset(added)), sort_keys=True,
                                       default=str).encode()).hexdigest()[:12]
            for k in keys if k in nodes}


def _added_ref(key, node, added) -> bool:
    """``name: !ref <key>`` for a key in ``added`` (``convolutions: !ref <convolutions>``,
    ``test_size: !ref <reset_test_size>``)."""
    return (isinstance(node, ruamel.yaml.comments.TaggedScalar)
            and getattr(node.tag, "value", None) == "!ref"
            and str(node.value).startswith("<") and str(node.value)[1:-1] in added)


def _canonical(node, added=frozenset()):
    """A ruamel node as JSON-able values: ``{"!": tag, "=": value}`` where it is tagged; the
    entries ``k: !ref <k>`` of keys in ``added`` left out."""
    tag = getattr(getattr(node, "tag", None), "value", None)
    tag = tag if isinstance(tag, str) and tag.startswith("!") else None
    if isinstance(node, dict):
        body = {str(k): _canonical(v, added) for k, v in node.items()
                if not _added_ref(k, v, added)}
    elif isinstance(node, (list, tuple)):
        body = [_canonical(v, added) for v in node]
    elif isinstance(node, ruamel.yaml.comments.TaggedScalar):
        body = str(node.value)
    else:
        body = next((t(node) for t in (bool, int, float, str) if isinstance(node, t)), node)
    return {"!": tag, "=": body} if tag else body


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
        if not m or m.group(1).startswith("__") or m.group(1) == "include":
            continue            # (include: an included method yaml's own line, no key to set)
        if m.group(2).startswith("!"):
            if m.group(2) == "!PLACEHOLDER":
                out.append((m.group(1), "(required)", m.group(3) or ""))
            elif m.group(2).startswith("!ref "):     # a default computed from other keys
                out.append((m.group(1), m.group(2)[len("!ref "):], m.group(3) or ""))
            continue
        if m.group(2) == "":      # a mapping or list follows: not a scalar key
            continue
        out.append((m.group(1), m.group(2), m.group(3) or ""))
    return out


def check(path, values: Dict, device_here: bool = True) -> None:
    """:func:`tta_brain.hparams.rules.check` with the yaml's comments as the keys' meanings."""
    rules.check(path, values, lambda: {k: c for k, _, c in describe(path)}, device_here)


def _located(err, lines: List[Tuple[str, Path, int]]) -> str:
    """A yaml error on the composed text, one line, its places given as the ``file:line`` they
    come from (an included block's line is the block's)."""
    def where(m):
        n = int(m.group(1)) - 1
        _, file, line = lines[n] if 0 <= n < len(lines) else ("", None, 0)
        return f"{file}:{line}" if file is not None and line else "(the composed yaml)"
    text = re.sub(r"\(line: \d+\)|To suppress this check.*$", "", " ".join(str(err).split()))
    return " ".join(re.sub(r'in "<unicode string>", line (\d+), column \d+',
                           lambda m: f"at {where(m)}", text).split())


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
            unknown = re.fullmatch(r"Override '(.+)' not found in: \[(.*)\]", str(err.args[0]))
            if unknown:     # hyperpyyaml's list had the internal keys; the closest is enough
                raise HparamsError(_unknown_key(self.path, unknown.group(1),
                                                re.findall(r"'(\w+)'", unknown.group(2)))
                                   ) from err
            raise HparamsError(f"{where}: {err.args[0]} (check the spelling of the keys and of "
                               f"the --key=value overrides)") from err
        if isinstance(err, (yaml.YAMLError, ruamel.yaml.error.YAMLError)):
            msg = " ".join(str(err).replace("<unicode string>", where).split())
            raise HparamsError(f"{where}: yaml syntax error (in the file or a --key=value "
                               f"override): {msg}") from err
        raised = _raised_in_your_code(tb)
        if raised:              # a method of the user's own: where in it, not a yaml hint
            said = re.sub(r"^Invalid argument to callable [\w.]+: ", "", _describe(err))
            raise HparamsError(f"{where}: {said} ({type(err).__name__} raised at {raised}; "
                               f"TTA_DEBUG=1 prints the traceback)") from err
        if isinstance(err, TypeError):
            hint = ("a value of the wrong type among the arguments of a class in the yaml (text "
                    "where a number belongs?)" if "not supported between instances" in str(err)
                    else "check the spelling of the keys passed to that class in the yaml")
            raise HparamsError(f"{where}: {_describe(err)} ({hint})") from err
        if isinstance(err, ValueError):
            unset = re.fullmatch(r"'(\w+)' is a !PLACEHOLDER and must be replaced\.?", _describe(err))
            if unset:
                raise HparamsError(_required(self.path, unset.group(1))) from err
            dangling = re.fullmatch(r'The reference "(\w+)[^"]*" is not valid', _describe(err))
            if dangling:
                raise HparamsError(_dangling(self.path, dangling.group(1))) from err
        if isinstance(err, (ValueError, ImportError, AttributeError, RuntimeError, OSError)):
            raise HparamsError(f"{where}: {_describe(err)}") from err
        return False


#: Where this package and the standard library live: files elsewhere (and outside installed
#: packages) are the user's own code
_NOT_YOURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
              os.path.dirname(os.__file__) + os.sep)


def your_file(filename: str) -> bool:
    """Whether ``filename`` is the user's own code (a module a yaml imports, e.g. a method of
    one's own): not this package, the standard library or an installed package."""
    path = os.path.abspath(filename)
    return not (filename.startswith("<") or path.startswith(_NOT_YOURS)
                or f"{os.sep}site-packages{os.sep}" in path
                or f"{os.sep}dist-packages{os.sep}" in path)


def _raised_in_your_code(tb) -> Optional[str]:
    """``file:line in function`` of the innermost frame of ``tb`` in :func:`your_file` code;
    ``None`` when no frame is."""
    import traceback
    frames = traceback.extract_tb(tb) if tb is not None else []
    for f in reversed(frames):
        if your_file(f.filename):
            return f"{os.path.abspath(f.filename)}:{f.lineno} in {f.name}"
    return None


def imported_modules(values) -> List[str]:
    """The modules a resolved yaml's objects come from: ``!apply:importlib.import_module [m]``
    and the module part of every ``!new:`` / ``!name:`` / ``!apply:`` tag, anywhere in it, in
    order of appearance (each once)."""
    found: List[str] = []

    def walk(node):
        tag = str(getattr(getattr(node, "tag", None), "value", None) or "")
        m = re.match(r"!(?:new|name|apply):([\w.]+)$", tag)
        if m:
            target = m.group(1)
            if target == "importlib.import_module":
                arg = node.get("name") if isinstance(node, dict) else \
                    node[0] if isinstance(node, (list, tuple)) and node else None
                if isinstance(arg, str):
                    found.append(arg)
            elif "." in target:
                found.append(target.rsplit(".", 1)[0])
        children = node.values() if isinstance(node, dict) else \
            node if isinstance(node, (list, tuple)) else ()
        for child in children:
            walk(child)
    walk(values)
    return list(dict.fromkeys(found))


def _unknown_key(path, key: str, known: List[str]) -> str:
    """The one line for an override of a key the yaml lacks: the closest keys and where the
    whole list is."""
    import difflib
    options = [k for k in known if not k.startswith("__")]
    close = difflib.get_close_matches(key, options, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join('--' + c for c in close)}? " if close else ""
    name = Path(path).stem if Path(path).parent == HPARAMS_DIR else str(path)
    if "reset_policy" not in known and key in keys(HPARAMS_DIR / "reset.yaml"):   # episodic
        continual = [m for m in available() if "reset_policy" in keys(m)]
        hint = (f"this yaml has no reset block (include: [run, reset]): resets are for the "
                f"continual methods, {', '.join(continual)}; ")
    return (f"{path}: Override '{key}' not found: --{key} is no key of this yaml ({hint}python -m "
            f"tta_brain.decode {name} --help lists them)")


def _dangling(path, key: str) -> str:
    """The one line for a ``!ref <key>`` of a key the yaml lacks (a renamed or misspelt key):
    where the reference is and the closest keys."""
    import difflib
    try:
        lines = composed_lines(path)
    except (OSError, HparamsError):
        lines = []
    at = next((f"{file}:{n}" for text, file, n in lines
               if re.search(rf"<{key}\b", text.partition("#")[0]) and n), None)
    keys = [k for k, _ in _entries([t for t, _, _ in lines]) if k and not k.startswith("__")]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return (f"{path}: !ref <{key}>{' at ' + at if at else ''} names no key of this yaml (no "
            f"top-level '{key}:'{hint})")


def _required(path, key: str) -> str:
    """The one line for a ``!PLACEHOLDER`` key left unset: the option to pass and what it is
    (the key's comment in the yaml or the block that holds it)."""
    meaning = {k: c for k, _, c in describe(path)}.get(key, "")
    return (f"{path}: '{key}' is required: pass --{key}=..." + (f" ({meaning})" if meaning else ""))


def _describe(err) -> str:
    """hyperpyyaml wraps constructor errors as ``(context, message)`` tuples: join them. An
    ``OSError`` of a file is ``file: reason`` (its args hold only the errno and the reason)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    parts = [str(a) for a in err.args] or [type(err).__name__]
    return " ".join(": ".join(parts).split())
