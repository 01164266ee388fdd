"""Source statistics: what some methods need to know about the source model on clean speech
(EATA's Fisher information; FOA / E-BATS activation statistics, ``activation_stats``), computed
once from a clean manifest the user names and kept in ONE file with its provenance.

The file (``torch.save`` of a plain dict, read back with ``weights_only=True``)::

    {"format": "tta_brain.source_stats", "version": 1,
     "provenance": {"manifest": <path as given>, "manifest_sha1": <content sha1>,
                    "model": <source identity: sha1 of a local model dir, or hub:<name>>,
                    "model_params_sha1": <sha1 of the model's parameter names and values>,
                    "n_utts": <utterances used>, "audio_sha1": <sha1 of their audio files'
                    paths and sizes>, "kinds": [...], "options": {...},
                    "created": <date>, "tta_brain": <version>},
     "stats": {<kind>: {<name>: tensor, ...}, ...}}

:class:`SourceStats` is that record, :func:`save` / :func:`load` the only writer and reader (one-line
:class:`SourceStatsError` naming the file), :func:`compute` what ``python -m tta_brain.stats`` runs.

**Kinds** are a table ``KINDS = {name: function}``. A kind is a function
``fn(lobe, inputs, options) -> {name: tensor}``: ``lobe`` an ``HFCTCLobe`` (source weights, eval
mode), ``inputs`` the list of normalised ``[1, T]`` inputs of the clean utterances (on the lobe's
device; iterate it as often as you need), ``options`` the command's ``--key=value`` extras
(strings). A new kind is one line in any module imported with ``tta_brain.methods`` (every method
file is)::

    @register_kind("hidden")
    def hidden_stats(lobe, inputs, options): ...

(``register_kind("fisher", options=("params",))``: the ``--key=value`` keys a kind reads; a key
no requested kind reads is refused in one line, not silently ignored.)

and a method reads it with ``load(path).kind("hidden", path)``.
"""
import hashlib
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F

from tta_brain.data.cache import file_sha1, save_torch, source_identity

__all__ = ["SourceStats", "SourceStatsError", "KINDS", "KIND_OPTIONS", "register_kind", "save",
           "load", "compute", "params_sha1", "make_command", "FORMAT", "VERSION"]

FORMAT, VERSION = "tta_brain.source_stats", 1
KINDS: Dict[str, Callable] = {}
#: The ``--key=value`` options each kind reads.
KIND_OPTIONS: Dict[str, tuple] = {}


class SourceStatsError(ValueError):
    """A statistics file that cannot be used; the message is one line naming the file."""


#: The kinds computed through ``lobes.partial`` (wav2vec 2.0-style models only: FOA, E-BATS).
PARTIAL_KINDS = set()


def register_kind(name: str, options: Sequence[str] = (), partial_forward: bool = False):
    """Decorator: make ``fn(lobe, inputs, options) -> {name: tensor}`` the statistics kind ``name``;
    ``options``: the ``--key=value`` keys it reads (any other key is refused, not ignored);
    ``partial_forward``: it runs the model through ``lobes.partial`` (not every model can)."""
    def deco(fn):
        old = KINDS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"statistics kind '{name}' is taken by {old.__module__}.{old.__qualname__}")
        KINDS[name] = fn
        KIND_OPTIONS[name] = tuple(options)
        if partial_forward:
            PARTIAL_KINDS.add(name)
        return fn
    return deco


def make_command(out="<file>", kinds="fisher") -> str:
    return (f"python -m tta_brain.stats --source <model> --manifest <clean csv> --kinds {kinds} "
            f"--out {out}")


@dataclass
class SourceStats:
    stats: Dict[str, Dict[str, torch.Tensor]]
    manifest: str
    manifest_sha1: str
    model: str
    model_params_sha1: str
    n_utts: int
    options: Dict[str, str] = field(default_factory=dict)
    created: str = ""
    tta_brain: str = ""
    audio_sha1: str = ""        # which audio files (:func:`audio_sha1`); "" in older files
    target_lang: str = ""       # an MMS checkpoint's language (``--target_lang``); "": its own

    @property
    def kinds(self) -> List[str]:
        return sorted(self.stats)

    def kind(self, name: str, path="source statistics") -> Dict[str, torch.Tensor]:
        """The tensors of kind ``name``; a one-line error naming ``path`` when it is not there."""
        if name not in self.stats:
            raise SourceStatsError(f"{path}: no '{name}' statistics (it has: "
                                   f"{', '.join(self.kinds) or 'none'}); make them with "
                                   f"{make_command(path, name)}")
        return self.stats[name]

    def check_model(self, model: torch.nn.Module, path="source statistics") -> None:
        """The statistics were computed on this model's (source) weights, else a one-line error."""
        digest = params_sha1(model)
        if digest != self.model_params_sha1:
            lang = getattr(model, "target_lang", None)      # an MMS adapter's (load_adapter's)
            raise SourceStatsError(f"{path}: computed on another model ({self.model}, parameters "
                                   f"sha1 {self.model_params_sha1[:12]} != {digest[:12]} of this "
                                   f"run's source); make them again with {make_command(path)}"
                                   + (f" --target_lang {lang}" if lang else ""))


def params_sha1(model: torch.nn.Module) -> str:
    """sha1 of a model's parameter names, shapes and float32 values (a path-free model identity)."""
    h = hashlib.sha1()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------- the file
def save(record: SourceStats, path) -> None:
    """Write ``record`` to ``path`` (atomically: a temporary file, then a rename)."""
    path = str(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    d = asdict(record)
    stats = {k: {n: t.detach().cpu().contiguous() for n, t in v.items()} for k, v in d.pop("stats").items()}
    save_torch({"format": FORMAT, "version": VERSION, "provenance": d, "stats": stats}, path)


def load(path) -> SourceStats:
    """Read a statistics file; a missing or foreign file is a one-line error naming it and the
    command that makes one."""
    path = str(path)
    if not path:
        raise SourceStatsError(f"no source statistics file given (--source_stats); make one with "
                               f"{make_command()}")
    if not os.path.isfile(path):
        raise SourceStatsError(f"source statistics file not found: {path} (--source_stats); make "
                               f"it with {make_command(path)}")
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:      # pickle / zip errors of every kind: one line
        raise SourceStatsError(f"{path}: not a source statistics file ({type(e).__name__}: "
                               f"{' '.join(str(e).split())[:160]})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise SourceStatsError(f"{path}: not a source statistics file (no format '{FORMAT}')")
    if d.get("version") != VERSION:
        raise SourceStatsError(f"{path}: statistics format version {d.get('version')}, this "
                               f"tta_brain reads {VERSION}; make it again with {make_command(path)}")
    return SourceStats(stats=d["stats"], **d["provenance"])


# ---------------------------------------------------------------------------- computing
def clean_rows(manifest: str, data_root: str = "", max_utts: int = 0,
               max_duration: float = 20.0) -> List[Dict]:
    """The manifest rows :func:`compute` uses: the first ``max_utts`` (0: all) not longer than
    ``max_duration`` seconds, in manifest order, their ``$data_root`` replaced. A manifest
    without a ``wav`` column is a :class:`ManifestError` naming it (it was a KeyError)."""
    from tta_brain.data.manifest import read_with_columns
    rows, _ = read_with_columns(manifest, ("wav",), replacements={"data_root": data_root or ""})
    rows = [r for r in rows if float(r.get("duration") or 0) <= max_duration]
    return rows[:max_utts] if max_utts else rows


def audio_sha1(rows: Sequence[Dict]) -> str:
    """sha1 of the rows' audio files as they are found (absolute path and size, in order): another
    ``--data_root``, ``--max_duration`` or ``--max_utts`` selects other audio, so another digest."""
    h = hashlib.sha1()
    for r in rows:
        path = os.path.abspath(r["wav"])
        size = os.path.getsize(path) if os.path.isfile(path) else -1
        h.update(f"{path}\0{size}\n".encode())
    return h.hexdigest()


def compute(source: str, manifest: str, kinds: Sequence[str], data_root: str = "",
            max_utts: int = 0, device: str = "cpu", max_duration: float = 20.0,
            options: Dict[str, str] = None, target_lang: str = "") -> SourceStats:
    """The statistics ``kinds`` of model ``source`` (``target_lang``: the language of a
    checkpoint with language adapters, MMS) on the first ``max_utts`` (0: all) utterances of
    ``manifest`` not longer than ``max_duration`` seconds, in manifest order."""
    import tta_brain
    import tta_brain.methods  # noqa: F401  (every method module registers its kinds)
    from tta_brain.data.audio import AudioError, load_audio
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise SourceStatsError(f"unknown statistics kind(s) {', '.join(unknown) or '(none given)'} "
                               f"(--kinds); known: {', '.join(sorted(KINDS))}")
    known = sorted({o for k in kinds for o in KIND_OPTIONS.get(k, ())})
    stray = sorted(set(options or {}) - set(known))
    if stray:
        raise SourceStatsError(
            f"{', '.join('--' + o for o in stray)}: not an option of the kind(s) "
            f"{', '.join(kinds)} (--kinds); they take " + (", ".join(f"--{o}=..." for o in known)
                                                         if known else "no options"))
    if max_utts < 0:
        raise SourceStatsError(f"--max_utts {max_utts}: must be >= 0 (0: all utterances)")
    rows = clean_rows(manifest, data_root, max_utts, max_duration)
    if not rows:
        raise SourceStatsError(f"{manifest}: no utterance of at most {max_duration} s (--manifest)")
    lobe = HFCTCLobe(source, device=device, target_lang=target_lang or None)
    inputs = []
    for r in rows:
        try:
            wav = load_audio(r["wav"], lobe.sample_rate)
        except AudioError as e:                 # which row of which manifest, not only the file
            raise SourceStatsError(f"{manifest}: utterance {r['ID']}: {e} (--manifest)") from None
        if int(lobe.output_lengths(torch.tensor(wav.numel()))) < 1:    # was conv1d's own error
            raise SourceStatsError(f"{manifest}: utterance {r['ID']}: {r['wav']}: too short for "
                                   f"the model ({wav.numel()} samples give no output frame) "
                                   f"(--manifest)")
        inputs.append(lobe.prepare(wav))
    options = dict(options or {})
    partial = [k for k in kinds if k in PARTIAL_KINDS]
    if partial:                 # said before any kind is computed, with the kinds it can give
        from tta_brain.lobes.partial import PartialForward
        try:
            PartialForward(lobe)
        except ValueError as e:
            others = [k for k in kinds if k not in PARTIAL_KINDS]
            hint = f"; --kinds {','.join(others)} alone can be computed for it" if others else ""
            raise SourceStatsError(f"--kinds {','.join(partial)}: {e}{hint}") from None
    stats = {}
    for k in kinds:
        try:
            stats[k] = KINDS[k](lobe, inputs, options)
        except ValueError as e:               # which kind said it
            raise SourceStatsError(f"--kinds {k}: {' '.join(str(e).split())}") from e
    return SourceStats(stats=stats, manifest=str(manifest), manifest_sha1=file_sha1(manifest),
                       model=source_identity(str(source)), model_params_sha1=params_sha1(lobe.model),
                       n_utts=len(inputs), options=options, created=time.strftime("%Y-%m-%d %H:%M:%S"),
                       tta_brain=tta_brain.__version__, audio_sha1=audio_sha1(rows),
                       target_lang=target_lang or "")


@register_kind("fisher", options=("params",))
def fisher_information(lobe, inputs, options) -> Dict[str, torch.Tensor]:
    """EATA's diagonal Fisher information: per utterance, the squared gradient of the mean frame
    cross-entropy against the model's own argmax labels, averaged over utterances (the reference
    code's estimate). Over the parameters selected by ``options['params']`` (comma-separated
    selectors of ``tta_brain.methods.params``; default ``layernorm``, EATA's adapted set)."""
    from tta_brain.methods.params import select_parameters
    groups = [{"select": s.strip()} for s in options.get("params", "layernorm").split(",") if s.strip()]
    selected = select_parameters(lobe.model, groups)
    lobe.model.eval()
    lobe.model.requires_grad_(False)
    for _, p, _ in selected:
        p.requires_grad_(True)
    fisher = {n: torch.zeros_like(p) for n, p, _ in selected}
    with torch.enable_grad():
        for x in inputs:
            logits = lobe.logits(x)
            flat = logits.reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(flat, flat.argmax(-1).detach())
            grads = torch.autograd.grad(loss, [p for _, p, _ in selected])
            for (n, _, _), g in zip(selected, grads):
                fisher[n] += g.detach() ** 2
    return {n: f / len(inputs) for n, f in fisher.items()}
