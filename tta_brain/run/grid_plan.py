"""The runs of a grid, planned without running anything: every (stream, method token, seed, sweep
point) with its folder ``<exp_dir>/<stream>/<token>[_<tag>]/seed<seed>`` and its decode arguments.

The tag names the ``--decode_opts`` and ``--sweep`` values that make a run differ from the recipe
(ESPnet's inference_tag), so a sweep never collides. A run's overrides come from
``<conf_dir>/<method>.opts``, ``<conf_dir>/<method>_md.opts`` (streams in ``--md_streams``),
``<conf_dir>/<token>.opts``, ``--md_decode_opts``, ``--decode_opts`` and the sweep point, later
ones winning. One rule (:class:`OptionRule`) for a grid-wide option a method lacks.
"""
import hashlib
import itertools
import logging
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger("tta_brain.grid")

__all__ = ["Run", "plan_runs", "inference_tag", "sweep_points", "method_yaml", "OptionRule",
           "UNTAGGED"]

#: Decode options that say where or how visibly a run goes, not what it computes: not in tags.
UNTAGGED = ("noprogressbar", "device", "ckpt_every", "output_folder", "stream_csv", "data_root",
            "method_tag", "stream_name", "overwrite")

#: Decode options the grid sets for every run from its own options (where to give them): in an
#: option list a later value would replace the grid's (every seed folder the same seed, a run
#: written where the grid does not look).
GRID_SET = {"source": "--source", "stream_csv": "--streams", "output_folder": "--exp_dir",
            "seed": "--seeds", "data_root": "--data_root", "stream_name": "--streams NAME=CSV"}


@dataclass
class Run:
    name: str                       # <stream>/<tag>/seed<seed>, relative to exp_dir
    folder: Path
    argv: List[str]                 # tta_brain.decode arguments
    status: str = "queued"          # queued | running | done | failed | skipped
    message: str = ""
    logs: List[str] = field(default_factory=list)
    total: int = 0                  # rows of its stream
    seen: Optional[tuple] = None    # what the progress rate is measured from (rate_since)
    plan: object = None             # its decode.plan, once the grid has looked at its folder
    origins: Dict[str, str] = field(default_factory=dict)   # option key -> where it was set

    def said(self, message: str) -> str:
        """A refusal of this run's settings with where the option it names was set (a conf file's
        line, --decode_opts, the sweep): the yaml's own error names only the packaged yaml. A
        manifest's error (decode's ``(--stream_csv)``) names the grid's ``--streams`` item."""
        if message.endswith(" (--stream_csv)") and "stream_csv" in self.origins:
            message = f"{message[:-len(' (--stream_csv)')]} ({self.origins['stream_csv']})"
        m = (re.search(r"Override '(\w+)'", message) or re.search(r": (\w+) = ", message)
             or re.search(r"--(\w+)", message))
        key = m.group(1) if m else None
        return f"{message} (--{key} from {self.origins[key]})" if key in self.origins else message


def _options(source: str, text: str) -> List[str]:
    """Decode overrides written on one line, as ``--key=value`` items (``--lr 1e-4`` too); a line
    that is none (a stray word, an open quote) is one line naming ``source``."""
    from tta_brain.run.cli import key_value_form
    try:
        opts = key_value_form(shlex.split(text))
    except ValueError as e:                     # shlex's open quote, or a UsageError
        raise SystemExit(f"ERROR: {source}: {e}") from None
    _not_grid_set(source, opts)
    return opts


def _not_grid_set(source: str, opts: List[str]) -> None:
    for key in _keyvals(opts):
        if key in GRID_SET:
            raise SystemExit(f"ERROR: {source} --{key}: the grid sets it for every run (from "
                             f"{GRID_SET[key]}); give it there")


def _opts_lines(path: Path) -> List[Tuple[str, str]]:
    """``(path:line, option)`` of an ``.opts`` file's options (none when there is no file)."""
    if not path.is_file():
        return []
    return [(f"{path}:{n}", a) for n, line in enumerate(path.read_text().splitlines(), 1)
            if not line.strip().startswith("#") for a in _options(f"{path}:{n}", line)]


def _keyvals(opts: List[str]) -> Dict[str, str]:
    out = {}
    for a in opts:
        key, _, value = a[2:].partition("=") if a.startswith("--") else (a, "", "")
        out[key] = value
    return out


def inference_tag(opts: List[str]) -> str:
    """``lr1e-4_reset_K50`` from ``--lr=1e-4 --reset_K=50`` (run options left out)."""
    parts = [f"{k}{v}" for k, v in _keyvals(opts).items() if k not in UNTAGGED]
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", "_".join(parts))


#: The longest file name most file systems take (bytes): a run folder ``<token>_<tag>`` longer
#: than this could not be made (a path option in --decode_opts named it whole).
NAME_MAX = 255


def fit_tag(token: str, tag: str) -> str:
    """``tag`` as it is where ``<token>_<tag>`` fits in :data:`NAME_MAX` bytes (every folder a
    grid made is named so); else its head and a digest of the whole (such a run failed when it
    made its folder: ``--decode_opts="--source_stats=/a/long/path/s.pt"``)."""
    if len(f"{token}_{tag}".encode()) <= NAME_MAX:
        return tag
    digest = hashlib.sha1(tag.encode()).hexdigest()[:12]
    head = tag.encode()[: NAME_MAX - len(token.encode()) - 1 - 1 - len(digest)]
    return f"{head.decode(errors='ignore')}-{digest}"


def sweep_points(specs: List[str]) -> List[List[str]]:
    """``["lr=1e-4,3e-4", "steps=5,10"]`` -> the cartesian product as ``--key=value`` lists."""
    axes, keys = [], {}
    # one argument may hold several axes ("lr=1e-4,3e-4 steps=1,3", as a recipe's --sweep gives
    # them): split on whitespace, so no axis reads another's key as a value
    for spec in (token for arg in specs for token in arg.split()):
        key, _, values = spec.partition("=")
        if not key or not values or "" in values.split(","):
            raise SystemExit(f"ERROR: --sweep {spec!r}: use key=v1,v2,...")
        key = key.lstrip("-")
        if key in UNTAGGED and key not in GRID_SET:     # its points would share one folder
            raise SystemExit(f"ERROR: --sweep {spec!r}: {key} says where or how a run goes, not "
                             f"what it computes, so it does not name run folders and is no sweep "
                             f"axis (give it in --decode_opts; another device: another --exp_dir)")
        if key in keys:               # the product took the last value only: one run, not two
            raise SystemExit(f"ERROR: --sweep {keys[key]!r} {spec!r}: {key} given twice; list "
                             f"its values in one: {key}={keys[key].partition('=')[2]},{values}")
        keys[key] = spec
        seen = {}
        for v in values.split(","):        # two folders would decode one run twice
            if _number_or_text(v) in seen:
                raise SystemExit(f"ERROR: --sweep {spec!r}: {seen[_number_or_text(v)]} and {v} "
                                 f"are the same value (its runs would be one run decoded "
                                 f"twice); list it once")
            seen[_number_or_text(v)] = v
        tags = {}                 # one folder for two runs: the second would be lost (an
        for v in values.split(",") if key not in UNTAGGED else ():   # untagged key: refused below)
            tag = inference_tag([f"--{key}={v}"])
            if tag in tags:
                raise SystemExit(f"ERROR: --sweep {spec!r}: {tags[tag]} and {v} name the same run "
                                 f"folder ({tag}); give one of them otherwise")
            tags[tag] = v
        axes.append([f"--{key}={v}" for v in values.split(",")])
    return [list(p) for p in itertools.product(*axes)] or [[]]


def _number_or_text(value: str):
    try:
        return float(value)
    except ValueError:
        return value.strip()


def stream_spec(spec: str) -> Tuple[str, str]:
    """``--streams`` item -> (name, manifest): ``CSV`` (named by its file) or ``NAME=CSV``. A path
    may hold ``=`` (``snr=20/md_easy.csv``): a file of that path is taken whole, else the split
    that names a file, else (a dry run before the files exist) the first ``=``."""
    if "=" not in spec or Path(spec).is_file():
        return Path(spec).stem, spec
    splits = (spec.partition("="), spec.rpartition("="))
    name, _, csv = next((s for s in splits if Path(s[2]).is_file()), splits[0])
    return name or Path(csv).stem, csv


def method_yaml(token: str, hparams_dir: Optional[str]):
    """The yaml of a method token and the ``--reset`` it implies (``dsuta+dynamic``)."""
    base, _, reset = token.partition("+")
    if hparams_dir:
        for name in (token, base):
            if (Path(hparams_dir) / f"{name}.yaml").is_file():
                yaml = str(Path(hparams_dir) / f"{name}.yaml")
                return yaml, ([f"--reset={reset}"] if reset and name == base else [])
    from tta_brain import hparams
    if base not in hparams.available():
        where = f"no {Path(hparams_dir or '.') / (token + '.yaml')} and " if hparams_dir else ""
        raise SystemExit(f"ERROR: --methods {token}: {where}no packaged method '{base}' "
                         f"(packaged: {', '.join(hparams.available())})")
    return base, [f"--reset={reset}"] if reset else []


def _check_reset_tags(tokens: List[str], rule: "OptionRule") -> None:
    """A token's ``+<reset>`` (``dsuta+dynamic``) names a reset policy of a method that has one:
    a typo or a method without the reset block is one line before anything runs (each of its
    runs failed at its start)."""
    from tta_brain.hparams.rules import RULES
    policies = RULES["reset"][0]
    for token in tokens:
        base, plus, reset = token.partition("+")
        if not plus:
            continue
        if "reset" not in rule.keys[token]:
            raise SystemExit(f"ERROR: --methods {token}: {base} has no reset policy (no 'reset' "
                             f"key in its yaml), so '+{reset}' cannot be applied")
        if reset not in policies:
            raise SystemExit(f"ERROR: --methods {token}: '{reset}' is not a reset policy (one of "
                             f"{', '.join(policies)})")


class OptionRule:
    """One rule for an option a method does not have, for every grid-wide option list
    (``--decode_opts``, ``--md_decode_opts``, ``--sweep``): a key that no method of the grid has
    is a one-line error before anything runs (a typo); a key that some methods lack is not passed
    to those, and the log says so once per key and method."""

    def __init__(self, yamls: Dict[str, str]):
        from tta_brain import hparams
        from tta_brain.run.cli import FLAGS
        self.keys = {token: set(hparams.keys(y)) | set(FLAGS) for token, y in yamls.items()}
        self.defaults = {token: _plain_values(y) for token, y in yamls.items()}
        self.logged = set()
        self.read, self.unread = set(), {}     # keys some run reads; key -> why no run does

    def check(self, source: str, opts: List[str]) -> None:
        for key in _keyvals(opts):
            if not any(key in keys for keys in self.keys.values()):
                raise SystemExit(f"ERROR: {source} --{key}: no method of this grid has the key "
                                 f"'{key}' (methods: {', '.join(self.keys)}); check its spelling")

    def kept(self, token: str, source: str, opts: List[str]) -> List[str]:
        """``opts`` without the keys ``token``'s yaml lacks."""
        keys = self.keys[token]
        kept = [a for a in opts if _keyvals([a]) and next(iter(_keyvals([a]))) in keys]
        for a in opts:
            if a not in kept and (token, source, a) not in self.logged:
                self.logged.add((token, source, a))
                logger.info("%s: %s %s is not a key of its yaml, not passed", token, source, a)
        return kept

    def live(self, token: str, *lists: List[str]) -> List[List[str]]:
        """``lists`` (a run's options, in command-line order) without the options its run
        would not read (``rules.NEEDS``: ``--reset_every`` where its reset is not fixed; decode
        refuses them, and the run's identity leaves them out), the log saying so once."""
        from tta_brain.hparams import rules
        values = {**self.defaults[token], **_keyvals([a for opts in lists for a in opts])}
        dead = {k: rules.unused(k, values) for k in values}
        for key, why in dead.items():
            if why:
                self.unread.setdefault(key, why)
            else:
                self.read.add(key)
        out = [[a for a in opts if not dead.get(next(iter(_keyvals([a])), None))]
               for opts in lists]
        for a in (a for opts in lists for a in opts):
            key = next(iter(_keyvals([a])), None)
            if dead.get(key) and (token, a) not in self.logged:
                self.logged.add((token, a))
                logger.info("%s: %s is not read by its run (%s), not passed", token, a, dead[key])
        return out

    def check_read(self, *given: Tuple[str, List[str]]) -> None:
        """An option of the user's that no run of the grid reads (``--reset_every`` in a grid
        without a fixed reset): one line before anything runs, as a key no method has."""
        for source, opts in given:
            for key in _keyvals(opts):
                if key in self.unread and key not in self.read:
                    raise SystemExit(f"ERROR: {source} --{key}: no run of this grid reads it "
                                     f"({self.unread[key]})")


def _plain_values(yaml: str) -> Dict:
    """The plain top-level values of ``yaml`` (with its blocks) as the yaml reads them: a quoted
    ``reset: "fixed"`` is ``fixed`` and ``lm_path: null`` is None (``hparams.describe``'s text,
    ``'"fixed"'`` and ``'null'``, judged a fixed reset's period unread and an LM set: the grid
    refused ``--reset_every`` that decode takes, and passed ``--lm_weight`` that decode refuses);
    a computed value (``!ref``) is left out, so an option is judged on it only where the run's
    own options set it. Empty where the yaml cannot be read here (its runs say why)."""
    from tta_brain import hparams
    try:
        import ruamel.yaml
        nodes = ruamel.yaml.YAML().load(hparams.compose(hparams.find(yaml))) or {}
    except Exception:       # noqa: BLE001 - a broken yaml: its run says why where it starts
        return {}
    if not isinstance(nodes, dict):
        return {}
    return {str(k): (str(v) if isinstance(v, str) else v) for k, v in nodes.items()
            if v is None or isinstance(v, (str, bool, int, float))}


def _no_device_with_gpus(run: Run, args) -> None:
    """A run's own ``--device`` after the grid's ``--device=cuda`` won (a grid given ``--gpus``
    decoded on the CPU, its GPUs idle, without a word): one line naming where it was set."""
    device = _keyvals(run.argv).get("device", "cuda")          # the last one: what decode takes
    if not device.startswith("cuda"):
        asked = f"--gpus {args.gpus!r}" if args.gpus.split() else "Slurm GPUs (--slurm_conf)"
        raise SystemExit(f"ERROR: {run.origins.get('device', 'an option')} sets "
                         f"--device={device} and the grid has {asked}: {run.name} would decode "
                         f"on {device}; give one of them")


def plan_runs(args, cuda: bool = False) -> List[Run]:
    """Every run of the grid, in order (streams, methods, seeds, sweep points). Its runs decode
    on CUDA with local ``--gpus`` or ``cuda`` (Slurm jobs that ask for GPUs): ``--device=cuda``
    comes before the user's options, and a run whose options then set another device is refused
    (its GPU would be idle)."""
    conf = Path(args.conf_dir) if args.conf_dir else None
    md = set(args.md_streams.split())
    user = _options("--decode_opts", args.decode_opts)
    md_opts = _options("--md_decode_opts", args.md_decode_opts)
    md_recipe = _options("--md_recipe_opts", getattr(args, "md_recipe_opts", ""))   # no check
    points = sweep_points(args.sweep)
    _not_grid_set("--sweep", points[0])
    for source, opts in (("--decode_opts", user), ("--md_decode_opts", md_opts)):
        both = sorted(set(_keyvals(opts)) & set(_keyvals(points[0])))
        if both:                              # the sweep's values would replace it in every run
            raise SystemExit(f"ERROR: {source} sets --{both[0]} and --sweep sweeps it (every run "
                             f"would take the sweep's value); give it in one of them only")
    tokens = args.methods.split()
    if tokens == ["all"]:                  # every packaged method
        from tta_brain import hparams
        tokens = hparams.available()
    yamls = {token: method_yaml(token, args.hparams_dir) for token in tokens}
    rule = OptionRule({token: y for token, (y, _) in yamls.items()})
    _check_reset_tags([t for t in tokens if yamls[t][1]], rule)   # own <token>.yaml: no tag
    rule.check("--decode_opts", user)
    rule.check("--md_decode_opts", md_opts)
    rule.check("--sweep", points[0])
    # --gpus: each local run sees its one GPU (CUDA_VISIBLE_DEVICES) and decodes on it
    gpu = ["--device=cuda"] if cuda or (args.engine == "local" and args.gpus.split()) else []
    runs, named = [], {}
    for spec in args.streams:
        name, csv = stream_spec(spec)
        if named.setdefault(name, csv) != csv:       # one folder for two streams: one was lost
            raise SystemExit(f"ERROR: --streams: the name {name!r} is given to {named[name]} and "
                             f"{csv} (their runs would share {Path(args.exp_dir) / name}); name "
                             f"them apart: NAME=CSV")
        if Path(csv).is_dir():
            raise SystemExit(f"ERROR: --streams {spec}: {csv} is a folder, not a stream manifest "
                             f"(a CSV file)")
        if not Path(csv).is_file() and not (args.dry_run or getattr(args, "check", False)):
            raise SystemExit(f"ERROR: --streams {spec}: stream {csv} not found; run the earlier "
                             f"stages first")
        kind = "_md" if Path(name).name in md else ""
        total = _stream_rows(csv)
        logger.info("%s: %s", name, "multi-domain option set (<method>_md.opts, --md_decode_opts)"
                    if kind else "single-domain option set")
        for token in tokens:
            yaml, reset = yamls[token]
            base = token.partition("+")[0]
            files = [f"{base}.opts"] + ([f"{base}{kind}.opts"] if kind else []) \
                + ([f"{token}.opts"] if token != base else [])
            lines = [wa for f in files for wa in (_opts_lines(conf / f) if conf else [])]
            recipe = reset + [a for _, a in lines]
            md_lists = ((("--md_recipe_opts", rule.kept(token, "--md_recipe_opts", md_recipe)),
                         ("--md_decode_opts", rule.kept(token, "--md_decode_opts", md_opts)))
                        if kind else ())
            mine = rule.kept(token, "--decode_opts", user)
            _check_token_reset(token, reset, lines + [(w, a) for w, opts in md_lists for a in opts]
                               + [("--decode_opts", a) for a in mine]
                               + [("--sweep", a) for point in points for a in point])
            for _, opts in md_lists:
                recipe += opts
            for point in points:
                point = rule.kept(token, "--sweep", point)
                # (options its run would not read: reset_every with reset none, left out)
                recipe_p, mine_p, point = rule.live(token, recipe, mine, point)
                tag = fit_tag(token, inference_tag(mine_p + point))
                # a run with options of its own is named by its tag in reports, not pooled;
                # so is a yaml of one's own whose method_tag is not its token (a copy of
                # csuta.yaml as mycsuta.yaml says csuta: pooled with csuta's runs)
                label = rule.kept(token, "--method_tag", [f"--method_tag={token}_{tag}"] if tag
                                  else _token_label(token, yaml, reset, recipe_p + mine_p + point))
                for seed in args.seeds.split():
                    rel = f"{name}/{token}{'_' + tag if tag else ''}/seed{seed}"
                    folder = Path(args.exp_dir) / rel
                    argv = [yaml, f"--source={args.source}", f"--stream_csv={csv}",
                            f"--output_folder={folder}", f"--seed={seed}",
                            f"--data_root={args.data_root}", f"--stream_name={Path(name).name}",
                            *gpu, *recipe_p, *mine_p, *point, *label]
                    origins = {k: w for w, a in lines for k in _keyvals([a])}
                    origins["stream_csv"] = f"--streams {spec}"
                    for where, opts in (*md_lists, ("--decode_opts", mine), ("--sweep", point)):
                        origins.update((k, where) for k in _keyvals(opts))
                    runs.append(Run(rel, folder, argv, total=total, origins=origins))
                    if gpu:
                        _no_device_with_gpus(runs[-1], args)
    rule.check_read(("--decode_opts", user), ("--md_decode_opts", md_opts), ("--sweep", points[0]))
    return _unique(runs)


def _check_token_reset(token: str, reset: List[str], lines: List[Tuple[str, str]]) -> None:
    """A token's ``+<reset>`` is the reset its folder says: an option file (or md option set)
    giving another ``--reset`` came after it and won, so ``dsuta+dynamic/`` held fixed-reset runs
    (labelled ``dsuta+fixed``, pooled with the real ones); ``--decode_opts`` or ``--sweep`` giving
    another made ``dsuta+dynamic_resetfixed/`` runs of the fixed reset. One line before anything
    runs."""
    said = reset[0].partition("=")[2] if reset else None
    for where, a in lines:
        other = _keyvals([a]).get("reset")
        if said is not None and other is not None and other != said:
            raise SystemExit(f"ERROR: {where}: --reset={other}, but the token {token} names its "
                             f"reset ({said}) and its runs' folders say it; take --reset out of "
                             f"there, or use the token {token.partition('+')[0]}+{other}")


def _token_label(token: str, yaml: str, reset: List[str], argv: List[str]) -> List[str]:
    """``[--method_tag=...]`` for a run of a yaml whose label names another method than its
    token (``mycsuta``, a copy of csuta.yaml, says csuta): the token's name with the reset policy
    the run gets (the last ``--reset`` of its options, else the yaml's) where the yaml's label
    carries one; ``[]`` where the yaml names the run as its token does (every packaged yaml, with
    whatever reset its options give it), an option sets the label, or the label cannot be told
    without building the yaml."""
    from tta_brain.report.tags import method_tag
    parts = yaml_label(yaml)
    if parts is None or any(a.startswith("--method_tag=") for a in argv):
        return []
    name, default = parts
    base = token.partition("+")[0] if reset else token    # <base>.yaml + the token's '+reset'
    if name == base:
        return []
    if default is None:                 # a plain label: no reset in it
        return [f"--method_tag={token}"]
    said = [a.split("=", 1)[1] for a in argv if a.startswith("--reset=")]
    return [f"--method_tag={method_tag(base, said[-1] if said else default)}"]


def yaml_label(yaml: str) -> Optional[Tuple[str, Optional[str]]]:
    """``(name, default reset)`` of a yaml's ``method_tag``: a plain label (reset None), or the
    packaged form ``!apply:...method_tag [name, !ref <reset>]`` with the yaml's ``reset``; None
    when it is neither (the run keeps the label its yaml builds)."""
    from tta_brain import hparams
    try:
        import ruamel.yaml
        nodes = ruamel.yaml.YAML().load(hparams.compose(hparams.find(yaml))) or {}
    except Exception:       # noqa: BLE001 - a broken yaml: its run says why where it starts
        return None
    node = nodes.get("method_tag") if isinstance(nodes, dict) else None
    tag = str(getattr(getattr(node, "tag", None), "value", None) or "")
    if isinstance(node, str) and not tag.startswith("!"):
        return str(node), None
    if tag.endswith(".method_tag") and isinstance(node, list) and node:
        return str(node[0]), str(nodes.get("reset", "none"))
    return None


def _stream_rows(csv: str) -> int:
    """Rows of a stream manifest (0 when it is not there yet: a dry run)."""
    try:
        with open(csv, "rb") as f:
            return max(f.read().count(b"\n") - 1, 0)
    except OSError:
        return 0


def _unique(runs: List[Run]) -> List[Run]:
    """Sweep points that differ only in keys a method lacks give that method the same run once."""
    seen, out = set(), []
    for r in runs:
        if r.name not in seen:
            seen.add(r.name)
            out.append(r)
    return out
