"""The one validation source of the yamls' values: every key's type and range (:data:`RULES`), the
keys that constrain each other (the dynamic reset's K), and the device. Checked by
:func:`tta_brain.hparams.resolve` before anything is built, so a bad value is one line naming the
file, the key, what it must be and what the key means; the constructors do not check again
(``build_method`` and ``Runtime``, built from Python without a yaml, check theirs here)."""
import math
import re
from typing import Callable, Dict, Optional

__all__ = ["RULES", "HparamsError", "check", "check_device"]


class HparamsError(ValueError):
    """A yaml or an override that cannot be used; the message is one line naming file and key."""


#: Types and ranges of the packaged yamls' keys: (kind, test, what a valid value is). A value
#: that fails is an error naming the key before anything is built.
_INT, _FLOAT, _BOOL, _TEXT = "an integer", "a number", "true or false", "a string"
TEXT = _TEXT        # the kind of the keys whose values are text (paths, names): run.cli quotes them
BOOL = _BOOL        # the kind of the true/false keys: run.cli reads yes/no/on/off/1/0 as the flags do
_AUTO_INT, _AUTO_FLOAT = "auto or an integer", "auto or a number"
RULES = {
    # the run block (run.yaml): what is decoded, where, how
    "seed": (_INT, "seed"), "ckpt_every": (_INT, ">=0"), "max_duration": (_FLOAT, ">=0"),
    "source": (_TEXT, None), "target_lang": (_TEXT, None),
    "stream_csv": (_TEXT, None), "output_folder": (_TEXT, None),
    "data_root": (_TEXT, None), "stream_name": (_TEXT, None), "device": (_TEXT, None),
    "method_tag": (_TEXT, None), "precision": (("fp32", "bf16", "fp16"), None),
    "compile": (_BOOL, None), "cache_features": (("auto", "on", "off"), None),
    "cpu_native_backward": (_BOOL, None), "deterministic": (_BOOL, None),
    "tf32": (("torch", "off", "on"), None),
    "cuda_graphs": (("auto", "on", "off"), None), "cuda_device_steps": (_BOOL, None),
    "cuda_graph_cache": (_AUTO_INT, ">=1"), "cuda_graph_warmup": (_INT, ">=0"),
    "cuda_graph_buckets": (_AUTO_FLOAT, ">=0"), "convolutions": (("native", "gemm"), None),
    # the reset block (reset.yaml)
    "reset": (("none", "fixed", "oracle", "dynamic"), None), "reset_every": (_INT, ">=1"),
    "reset_K": (_INT, ">=4"), "reset_patience": (_INT, ">=1"), "reset_threshold": (_FLOAT, None),
    "reset_lii_count": (("paper", "official"), None), "reset_test_size": (_INT, ">=0"),
    # the gradient methods
    "steps": (_INT, ">=0"), "lr": (_FLOAT, ">0"), "em_coef": (_FLOAT, "0..1"),
    "temperature": (_FLOAT, ">0"), "layernorm_lr_mult": (_FLOAT, ">=0"),
    "cnn_lr_mult": (_FLOAT, ">=0"), "train_mode": (_BOOL, None),
    "param_collection": (("clean", "official", "ebats"), None),
    "buffer_size": (_INT, ">=1"), "slow_lr": (_FLOAT, ">0?"), "fast_moments": (("slow", "zero"), None),
    "slow_grad": (("reuse", "recompute"), None), "ema_decay": (_FLOAT, "0..1"),
    "lr_min": (_FLOAT, ">=0"), "renyi_alpha": (_FLOAT, ">0"), "ns_coef": (_FLOAT, ">=0"),
    "ns_threshold": (_FLOAT, ">=0"), "beam_width": (_INT, ">=1"), "lm_path": (_TEXT, None),
    "lm_unigrams": (_TEXT, None), "lm_weight": (_FLOAT, None), "word_bonus": (_FLOAT, None),
    "eata_optimizer": (("adamw", "sgd"), None), "momentum": (_FLOAT, "0..1"),
    "e_margin_factor": (_FLOAT, ">=0"), "d_margin": (_FLOAT, ">=0"), "probs_ema": (_FLOAT, "0..1"),
    "fisher_alpha": (_FLOAT, ">=0"), "source_stats": (_TEXT, None),
    "rho": (_FLOAT, ">=0"), "loss_ema": (_FLOAT, "0..1"), "reset_constant": (_FLOAT, None),
    "ap_threshold": (_FLOAT, "0..1"), "n_augment": (_INT, ">=0"), "noise_min": (_FLOAT, ">=0"),
    "noise_max": (_FLOAT, ">=0"), "noise_p": (_FLOAT, "0..1"), "restore_prob": (_FLOAT, "0..1"),
    "restore_mask": (("fresh", "fixed"), None),
    "steps2": (_INT, ">=0"), "lr2": (_FLOAT, ">0"), "tc_coef": (_FLOAT, ">=0"),
    # the backprop-free methods
    "population_batch": (_INT, ">=0"), "shared_prefix": (_BOOL, None),
    "knn": (_INT, ">=1"), "bound_lambda": (_FLOAT, ">=0"), "max_steps": (_INT, ">=1"),
    "tol": (_FLOAT, ">=0"), "blank_threshold": (_FLOAT, "0..1"), "filter_K": (_INT, "-1|>=1"),
    "popsize": (_INT, ">=2"), "sigma": (_FLOAT, ">0"), "generations": (_INT, ">=1"),
    "early_stop_threshold": (_FLOAT, ">=0"), "patience": (_INT, ">=1"), "cma_seed": (_INT, "seed"),
    "entropy_coef": (_FLOAT, ">=0"), "stats_coef": (_FLOAT, ">=0"), "tokenwise": (_BOOL, None),
    "loss_max": (_FLOAT, ">0"), "cov_ratio": (_FLOAT, "0..1"), "n_prompts": (_INT, ">=1"),
    "fitness_coef": (_FLOAT, ">=0"), "disc_div": (_FLOAT, ">0"), "shift_coef": (_FLOAT, None),
    "hist_decay": (_FLOAT, "0..1"),
}
#: The ranges above, as a test and as words.
RANGES = {None: (lambda v: True, ""), ">=0": (lambda v: v >= 0, " >= 0"),
          ">0": (lambda v: v > 0, " > 0"), ">0?": (lambda v: v > 0, " > 0 (or null)"),
          ">=1": (lambda v: v >= 1, " >= 1"), ">=2": (lambda v: v >= 2, " >= 2"),
          ">=4": (lambda v: v >= 4, " >= 4"), "0..1": (lambda v: 0 <= v <= 1, " between 0 and 1"),
          "-1|>=1": (lambda v: v == -1 or v >= 1, " >= 1 (or -1: all)"),
          # numpy's seeds; SpeechBrain's seed_everything silently seeds 0 outside them
          "seed": (lambda v: 0 <= v < 2 ** 32, " between 0 and 4294967295 (2**32 - 1)")}


def valid_value(value, kind, rng) -> bool:
    """Whether ``value`` has the type ``kind`` and lies in the range ``rng`` (a :data:`RULES`
    entry)."""
    if kind == _TEXT:     # a path or a name; null where the yaml allows it; a yaml object (!apply)
        return value is None or isinstance(value, str) or bool(getattr(getattr(value, "tag", None),
                                                                          "value", None))
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(kind, tuple):
        return isinstance(value, str) and value in kind
    if kind in (_AUTO_INT, _AUTO_FLOAT):
        if value == "auto":
            return True
        kind = _INT if kind == _AUTO_INT else _FLOAT
    if rng == ">0?" and value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == _INT and not isinstance(value, int):
        return False
    # an int is finite (math.isfinite of one too big for a float raises OverflowError)
    return (isinstance(value, int) or math.isfinite(value)) and RANGES[rng][0](value)


def expected(kind, rng) -> str:
    """A :data:`RULES` entry in words."""
    if isinstance(kind, tuple):
        return "one of " + ", ".join(kind)
    return kind + RANGES[rng][1]


def check(path, values: Dict, meanings: Optional[Callable[[], Dict[str, str]]] = None,
          device_here: bool = True) -> None:
    """Every known key's value has its type and range, the dynamic reset's K fits, ``device``
    exists here (``device_here``; else only its form: the run decodes on another machine) and
    fp16 is asked for only on CUDA; else an :class:`HparamsError` naming the key, the value, what
    it must be and what the key means (``meanings()``: key -> the yaml's comment)."""
    for key, (kind, rng) in RULES.items():
        if key in values and not valid_value(values[key], kind, rng):
            meaning = meanings() if meanings is not None else {}
            what = f" ({meaning[key]})" if meaning.get(key) else ""
            raise HparamsError(f"{path}: {key} = {values[key]!r} is not valid: {key} must be "
                               f"{expected(kind, rng)}{what}")
    if values.get("reset") == "dynamic":
        check_dynamic_reset(path, values)
    _check_reset_taken(path, values)
    _check_lm(path, values)
    _check_order(path, values)
    for key in ("adapt_params", "stage2_params"):      # (stage2_params: CEA's second stage)
        if key in values:
            check_adapt_params(path, values[key], key)
    if "device" in values:
        check_device(values["device"], here=device_here)
    if values.get("precision") == "fp16" and str(values.get("device", "cpu")) == "cpu":
        raise HparamsError(f"{path}: precision = fp16 (--precision) needs a CUDA device "
                           f"(--device=cuda); on cpu use bf16 or fp32")


def check_dynamic_reset(path, values: Dict) -> None:
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


def _check_reset_taken(path, values: Dict) -> None:
    """A reset policy the yaml builds (``reset`` other than none) reaches the method: a method
    entry (``build_method``) without ``reset_policy`` ran as if ``reset`` were none, labelled
    with the policy (a yaml of one's own that includes the reset block and forgot the line)."""
    method, reset = values.get("method"), values.get("reset")
    tag = str(getattr(getattr(method, "tag", None), "value", None) or "")
    if reset in (None, "none") or not isinstance(method, dict) or not tag.endswith("build_method"):
        return
    if "reset_policy" not in method:
        raise HparamsError(f"{path}: reset = {reset!r} builds a reset policy the method never "
                           f"gets: its method: entry has no reset_policy: !ref <reset_policy> "
                           f"(add it, as csuta.yaml does, or leave reset at none)")


def _check_lm(path, values: Dict) -> None:
    """A word LM is only used by a beam search, and a word list only with an LM: either set
    alone decoded as if it were not there."""
    if values.get("lm_unigrams") and not values.get("lm_path"):
        raise HparamsError(f"{path}: lm_unigrams = {values['lm_unigrams']!r} without lm_path: "
                           f"the word list belongs to a KenLM binary given as lm_path")
    if values.get("lm_path") and "beam_width" in values and values["beam_width"] == 1:
        raise HparamsError(f"{path}: lm_path = {values['lm_path']!r} with beam_width = 1: a beam "
                           f"of 1 is the greedy path and the LM would not be used; use "
                           f"beam_width > 1 or no lm_path")


#: Pairs of keys that bound one range, (low, high): CoTTA's noise amplitude is drawn as
#: low + (high - low) * u, so a swapped pair drew from the same range under labels that said
#: otherwise (the E-BATS reference's AddGaussianNoise refuses min_amplitude > max_amplitude).
#: SGEM's lr is annealed towards lr_min: an lr below it (a sweep of lr under the default lr_min
#: 2e-5) raised the lr over the steps instead, under a label that said the lr asked for.
ORDERED = (("noise_min", "noise_max"), ("lr_min", "lr"))


def _check_order(path, values: Dict) -> None:
    """Each :data:`ORDERED` pair set in ``values`` is low <= high."""
    for low, high in ORDERED:
        a, b = values.get(low), values.get(high)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > b:
            raise HparamsError(f"{path}: {low} = {a!r} is above {high} = {b!r}: {low} is the "
                               f"lower end of the range, {high} the upper")


def check_adapt_params(path, groups, key: str = "adapt_params") -> None:
    """``adapt_params`` (or another list of selector groups, ``key``) as the methods read it
    (:func:`tta_brain.methods.params.group_specs`): an empty list adapted nothing and failed at
    the first step, a text was read letter by letter; now one line naming the key and entry."""
    from tta_brain.methods.params import group_specs
    try:
        group_specs(groups, key)
    except ValueError as e:
        said = str(e) if key in str(e) else f"{key}: {e}"     # (an unknown selector's name)
        raise HparamsError(f"{path}: {said}") from None


#: Keys that only matter with another one set (a key name), or set to one of some values
#: (``(key, values)``): an override of one without it decoded exactly as without the override
#: (a run that differed from the default in its name and fingerprint only). The reset block's
#: keys are read by their own policy only (``--reset_every=20`` without ``--reset=fixed`` was a
#: plain no-reset run labelled reset_every20).
NEEDS = {"lm_weight": "lm_path", "word_bonus": "lm_path",
         "momentum": ("eata_optimizer", ("sgd",)),
         "reset_every": ("reset", ("fixed",)),
         **{k: ("reset", ("dynamic",)) for k in ("reset_K", "reset_patience", "reset_threshold",
                                                 "reset_lii_count", "reset_test_size")}}


def unused(key: str, values: Dict) -> Optional[str]:
    """Why ``key`` changes nothing in a run of these ``values`` (:data:`NEEDS`; a value compared
    as text, so that a grid's command-line strings and a resolved yaml's values are judged
    alike), or None. The grid leaves such options out of a run; a run's identity leaves such
    keys out (a run's K under reset none is no part of what it is)."""
    need = NEEDS.get(key)
    if not need or key not in values:
        return None
    if isinstance(need, tuple):
        other, wanted = need
        if other in values and str(values[other]) not in wanted:
            return (f"with {other} = {values[other]!r}: it is only used with {other} = "
                    f"{' or '.join(wanted)}")
        return None
    return None if values.get(need) else f"without {need}: it is only used with {need} set"


def check_overrides(path, values: Dict, given) -> None:
    """The overridden keys (``given``) that would have no effect (:data:`NEEDS`)."""
    for key in given:
        why = unused(key, values)
        if why:
            raise HparamsError(f"{path}: {key} = {values[key]!r} (an override) {why}, and would "
                               f"not change the run")


def check_device(device, here: bool = True) -> None:
    """``cpu``, or a CUDA device that exists on this machine (``here=False``: only the form)."""
    name = str(device)
    if name == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", name):
        shown = "empty" if device is None or not name.strip() else repr(name)
        raise HparamsError(f"device = {shown} (--device) is not valid: use cpu, cuda or cuda:N")
    if not here:
        return
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
