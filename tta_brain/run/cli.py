"""The decode command line: run options that mean what they say, yaml overrides, ``--help``.

Run options (SpeechBrain's names): ``--device`` (cpu, cuda, cuda:N), ``--precision``
(fp32 | bf16 | fp16), ``--compile`` (``--compile`` or ``--compile=true|false``),
``--deterministic`` (the same), ``--noprogressbar``. ``--device``, ``--precision``, ``--compile``
and ``--deterministic`` set the yaml keys of the same name (the run block), so they reach the
model and are recorded with the run. SpeechBrain's training options (``--debug``,
``--data_parallel_backend``, ``--grad_accumulation_factor``, ...) do nothing here and are refused. Every other ``--key=value`` (or ``--key value``) overrides the
yaml key ``key``; a later one wins over an earlier one (recipes append ``.opts`` files).
"""
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import ruamel.yaml
import ruamel.yaml.error

from tta_brain import hparams as hp_files

__all__ = ["UsageError", "Arguments", "parse_arguments", "key_value_form", "help_text",
           "record_hparams", "RUN_OPTIONS"]

USAGE = ("usage: python -m tta_brain.decode <method or yaml> --source=<model> --stream_csv=<csv> "
         "--output_folder=<dir> [--data_root=<dir>] [run options] [--key=value ...]\n"
         "       python -m tta_brain.decode <method or yaml> --help")
#: Run options honoured, with their help line. Flags take no value (or =true / =false).
RUN_OPTIONS = {
    "device": "cpu, cuda or cuda:N: where the model runs (sets the yaml key `device`)",
    "precision": "fp32 | bf16 | fp16: autocast of the model forward (sets `precision`)",
    "compile": "torch.compile the model forward (flag; sets `compile`)",
    "deterministic": "CUDA: deterministic kernels (flag, or =true|false; sets `deterministic`)",
    "noprogressbar": "no progress bar (flag)",
    "overwrite": "delete the records of a finished or started run with other settings in "
                 "--output_folder and start over (flag)",
}
FLAGS = ("compile", "deterministic", "noprogressbar", "overwrite")
#: SpeechBrain training options that decoding does not use: refused, not ignored.
SB_TRAINING_OPTIONS = (
    "test_only", "debug", "debug_batches", "debug_epochs", "debug_persistently",
    "data_parallel_backend", "data_parallel_count", "distributed_backend", "distributed_launch",
    "find_unused_parameters", "jit", "jit_module_keys", "compile_module_keys", "compile_mode",
    "compile_using_fullgraph", "compile_using_dynamic_shape_tracing", "eval_precision",
    "auto_mix_prec", "bfloat16_mix_prec", "max_grad_norm", "skip_nonfinite_grads",
    "nonfinite_patience", "ckpt_interval_minutes", "ckpt_interval_steps",
    "grad_accumulation_factor", "optimizer_step_limit", "tqdm_colored_bar", "tqdm_barcolor",
    "remove_vector_weight_decay", "profile_training", "profile_warmup", "profile_steps",
    "log_config", "param_file")


class UsageError(ValueError):
    """A command line that cannot be run; the message is one line (+ the usage)."""


@dataclass
class Arguments:
    method: Optional[str] = None
    help: bool = False
    overwrite: bool = False
    run_opts: Dict = field(default_factory=dict)
    overrides: str = ""                     # yaml text, one `key: value` per line


#: The keys whose value is a file or folder: ``~/...`` is the home folder's (``--key=~/x``).
PATH_KEYS = ("output_folder", "stream_csv", "data_root", "source", "source_stats", "lm_path",
             "lm_unigrams")


def _bool(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise UsageError(f"--{key} takes true or false, not {value!r}")


def key_value_form(opts: List[str]) -> List[str]:
    """Options as decode reads them, each one ``--key=value`` (or a bare flag): ``--lr 1e-4`` ->
    ``--lr=1e-4``. For lists of overrides written for decode and read by others (the grid names
    its runs by their keys); a token that is no option's value is a UsageError."""
    out = []
    for a in opts:
        if a.startswith("--"):
            out.append(a)
        elif out and "=" not in out[-1] and out[-1][2:] not in FLAGS:
            out[-1] += "=" + a
        else:
            raise UsageError(f"{a!r} is no option's value (overrides are --key=value)")
    return out


def parse_arguments(argv: List[str]) -> Arguments:
    """Split ``argv`` into the method, the run options and the yaml overrides."""
    args = Arguments()
    pairs = []
    i = 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a in ("-h", "--help"):
            args.help = True
            continue
        if not a.startswith("--"):
            if args.method is None:
                args.method = a
                continue
            raise UsageError(f"unexpected argument {a!r} (overrides are --key=value)\n{USAGE}")
        key, eq, value = a[2:].partition("=")
        if not key:
            raise UsageError(f"bad argument {a!r}\n{USAGE}")
        if key in SB_TRAINING_OPTIONS:
            raise UsageError(f"--{key} is a SpeechBrain training option; decoding does not use "
                             f"it (run options: {', '.join('--' + k for k in RUN_OPTIONS)})")
        if not eq and key not in FLAGS:
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            else:
                raise UsageError(f"--{key} needs a value (--{key}=<value>)")
        pairs.append((key, value, bool(eq)))
    if args.method is None and not args.help:
        raise UsageError(USAGE)
    overrides: Dict[str, str] = {}
    for key, value, has_value in pairs:
        if key in ("noprogressbar", "overwrite"):
            flag = _bool(key, value) if has_value else True
            if key == "noprogressbar":
                args.run_opts["noprogressbar"] = flag
            else:
                args.overwrite = flag
            continue
        if key in ("compile", "deterministic"):
            value = str(_bool(key, value) if has_value else True).lower()
        if key == "device":
            args.run_opts["device"] = value
        if key in PATH_KEYS and value.startswith("~/"):   # the shell leaves --key=~/x as it is
            value = os.path.expanduser(value)             # (it was a folder named ~ here)
        overrides[key] = value               # a later one wins
    lines = []
    for key, value in overrides.items():
        line = f"{key}: {_yaml_value(key, value)}"
        try:
            ruamel.yaml.YAML().load(line)
        except ruamel.yaml.error.YAMLError as e:
            raise UsageError(f"bad value for --{key}: {value!r} ({' '.join(str(e).split())})")
        lines.append(line)
    args.overrides = "\n".join(lines) + ("\n" if lines else "")
    return args


#: Values of a text key that mean "none" in yaml, kept as yaml reads them (``--lm_path=``).
_NONE = ("", "null", "Null", "NULL", "~")


def _yaml_value(key: str, value: str) -> str:
    """``value`` as the yaml text of an override that reads back as what was typed: a text key's
    value (a path, a stream name) quoted, so ``run #1`` keeps its `` #1`` (yaml: a comment) and a
    stream named ``2020`` stays a name (yaml: a number); any other value with `` #`` quoted too
    (then its key's rule says it is no number). A value the user quoted, a yaml tag (``!ref``)
    and a text key's "none" are left as typed."""
    from tta_brain.hparams.rules import BOOL, RULES, TEXT
    if value[:1] in ("'", '"', "!") or (value.strip() in _NONE):
        return value
    if RULES.get(key, (None,))[0] == BOOL:      # as the run options' flags read them (--compile=no)
        try:
            return "true" if _bool(key, value) else "false"
        except UsageError:
            return value                        # the key's rule says what it takes
    if RULES.get(key, (None,))[0] == TEXT or " #" in value or value.startswith("#"):
        return json.dumps(value, ensure_ascii=False)    # a yaml double-quoted scalar
    return value


def help_text(method: Optional[str]) -> str:
    """Usage, the run options and (with a method) its keys with defaults and one line each."""
    out = [USAGE, "", "Run options:"]
    out += [f"  --{k:<18} {v}" for k, v in RUN_OPTIONS.items()]
    if method is None:
        out += ["", f"Packaged methods: {', '.join(hp_files.available())} "
                    f"(tta_brain/hparams/<method>.yaml); `<method> --help` lists its keys."]
        return "\n".join(out)
    path = hp_files.find(method)
    out += ["", f"Keys of {path} (--key=value; default, then what it is):"]
    for key, default, comment in hp_files.describe(path):
        out.append(f"  --{key:<22} {default:<12} {comment}")
    return "\n".join(out)


def record_hparams(resolved: Dict) -> Dict:
    """The run's plain top-level values (numbers, strings, lists of them) for its summary."""
    def plain(v):
        if isinstance(v, (str, int, float, bool)) or v is None:
            return not hasattr(v, "tag") or not getattr(v.tag, "value", None)
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return False
    return {k: ([_builtin(x) for x in v] if isinstance(v, (list, tuple)) else _builtin(v))
            for k, v in resolved.items() if not k.startswith("__") and plain(v)}


def _builtin(v):
    """ruamel's scalar subclasses as plain Python values (JSON-safe)."""
    for t in (bool, int, float, str):
        if isinstance(v, t):
            return t(v)
    return v
