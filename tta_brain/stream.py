"""TTAStream: test-time adaptation inside your own loop (a live stream, a server, a notebook).

    from tta_brain.stream import TTAStream
    tta = TTAStream.from_hparams("dsuta", source="recipes/synthetic/source_model",
                                 overrides={"reset": "dynamic", "steps": 5})
    for wav in my_audio_chunks():            # one utterance each: float or int16 PCM, mono or [T, C]
        print(tta.transcribe(wav, sample_rate=16000))
    print(tta.resets)                        # stream positions where the model was reset

The method keeps its state across calls, so the slow meta-parameters, the reset detector and the
optimiser moments carry over from one utterance to the next exactly as in a recipe run.

One stream is one sequence: calls from several threads are taken one at a time (a lock), in the
order they get it. As ``tta_brain.decode`` does, :meth:`TTAStream.from_hparams` seeds the
process's random number generators (torch, numpy, ``random``) with the yaml's ``seed``, and
:meth:`TTAStream.load` sets them to the saved ones; an application that draws its own numbers
seeds them after those calls. A method that draws from them (AWMC's dropout, SpecAugment) shares
them with the application and with any other stream of the process: two such streams fed in turn
give other transcripts than each alone (run them in processes of their own).
"""
import array
import logging
import os
import re
import sys
import threading
from collections import deque
from typing import Dict, List, Optional, Union

import numpy as np
import torch

from tta_brain import hparams as hp_files
from tta_brain.data.loader import too_short
from tta_brain.methods.base import TTAMethod, UttInfo
from tta_brain.lobes.runtime import bound_kernel_caches, process_settings

logger = logging.getLogger(__name__)

#: What :meth:`TTAStream.save` writes (``format``, ``version``); files saved before had neither.
STATE_FORMAT, STATE_VERSION = "tta_brain.stream_state", 1
#: the latest LII values a stream keeps by default (about 1 MiB of memory and 230 kB of state)
LII_HISTORY = 10000
#: Resolved yaml keys that say where things are, not what the adapted state means.
_NOT_SETTINGS = ("stream_csv", "output_folder", "data_root", "ckpt_every", "method_tag",
                 "stream_name", "device", "source")


class StreamStateError(ValueError):
    """A state file that this stream cannot take (or write); the message names the file and
    why."""


class TTAStream:
    """Feed utterances one at a time; get transcripts back, adapting as you go."""

    def __init__(self, method: TTAMethod, sample_rate: Optional[int] = None,
                 source: Optional[str] = None, settings: Optional[Dict] = None,
                 lii_history: Optional[int] = LII_HISTORY):
        """``sample_rate``: the model's (its processor's; 16 kHz for every packaged recipe),
        which :meth:`transcribe` resamples other rates to; another is a ValueError (8 kHz here
        fed resampled 8 kHz audio to a 16 kHz model). ``source`` (the model's directory or hub
        name) and ``settings`` (scalar hparams) are what :meth:`save` records and :meth:`load`
        checks; :meth:`from_hparams` passes both. ``lii_history``: how many of the latest LII
        values :attr:`lii` keeps (and :meth:`save` writes; None: all): a live stream runs for
        ever, and every value kept was memory and a longer save, each time (the detector keeps
        what it needs itself)."""
        model_rate = getattr(getattr(method, "lobe", None), "sample_rate", 16000)
        if sample_rate is not None and sample_rate != model_rate:
            raise ValueError(f"TTAStream: sample_rate={sample_rate!r}, but the model takes "
                             f"{model_rate} Hz audio (leave it out: transcribe resamples what "
                             f"it is given, transcribe(..., sample_rate=8000))")
        bound_kernel_caches()      # a live stream is long: every length is new (runtime.py)
        self.method = method
        self.sample_rate = model_rate
        self.source = source
        self.settings = dict(settings or {})
        self.position = 0
        self.resets: List[int] = []
        if lii_history is not None and (isinstance(lii_history, bool)
                                        or not isinstance(lii_history, int) or lii_history < 0):
            raise ValueError(f"TTAStream: lii_history must be a whole number >= 0 or None, got "
                             f"{lii_history!r}")
        self._lii = deque(maxlen=lii_history)
        self._lock = threading.RLock()      # one utterance at a time: the state is one sequence
        # a local model directory's identity is that of the files the model was loaded from: a
        # directory moved, or its files replaced by another checkpoint while the stream runs on
        # the loaded weights, made save record (and load check) what was there at that time
        self._loaded_source = None
        if source and os.path.isdir(source):
            from tta_brain.data.cache import source_identity
            self._loaded_source = (source, source_identity(source))

    # _NORMAL_TENSORS: building, loading and resetting under the caller's torch.inference_mode()
    # made the weights, optimiser moments or loaded state inference tensors, which the next
    # adaptation step (outside it) may not update in place or save for backward: each of them
    # leaves inference mode, as transcribe does.

    @classmethod
    def from_hparams(cls, hparams: str = "dsuta", source: Optional[str] = None,
                     overrides: Optional[Dict] = None, device: str = "cpu",
                     lii_history: Optional[int] = LII_HISTORY) -> "TTAStream":
        """Build from a method yaml: a packaged method name (``tta_brain/hparams``) or a path.
        The run block's process-wide CUDA settings (``deterministic``, ``tf32``) are applied as
        ``tta_brain.decode`` applies them.

        Raises :class:`tta_brain.hparams.HparamsError` (one line naming the file and key, in
        the words of this call: ``overrides['lr']``, not decode's ``--lr``)."""
        ov = {"stream_csv": "", "output_folder": "", "device": str(device)}   # torch.device too
        if source is not None:
            ov["source"] = str(source)
        ov.update(overrides or {})
        try:
            resolved = hp_files.resolve(hparams, ov)
            with torch.inference_mode(False):    # see _NORMAL_TENSORS
                hp = resolved.build()
        except hp_files.HparamsError as e:
            raise hp_files.HparamsError(api_words(str(e))) from None
        process_settings(ov["device"], hp.get("deterministic", True), hp.get("tf32", "torch"))
        settings = {k: v for k, v in resolved.values.items() if k not in _NOT_SETTINGS
                    and not k.startswith("__") and isinstance(v, (str, int, float, bool, type(None)))}
        return cls(hp["method"], source=str(hp.get("source") or "") or None, settings=settings,
                   lii_history=lii_history)

    def transcribe(self, waveform: Union[torch.Tensor, np.ndarray], sample_rate: Optional[int] = None,
                   domain: str = "", segment: Optional[int] = None, utt_id: str = "") -> str:
        """Adapt on one utterance and return its transcript.

        ``segment`` (an integer domain-block label) is needed by the oracle reset policy only (a
        ValueError without it).
        Floating-point samples are taken as they are (nominal range [-1, 1]); integer PCM (int16
        from a sound card, int32, uint8) is scaled as ``soundfile`` scales it when it reads a file.
        Several channels, ``[C, T]`` or ``[T, C]`` (``soundfile.read``'s layout; the channels are
        the shorter side), are averaged; other sample rates are resampled. A waveform that cannot
        be used (empty, NaN/inf, too short for the model, longer than the yaml's
        ``max_duration``, which a recipe run skips too) is a one-line ``ValueError`` and leaves
        the state and the stream position unchanged. It adapts under the caller's
        ``torch.no_grad()`` or ``torch.inference_mode()`` as well.
        """
        # the caller's inference mode would make the samples (and every pass) inference tensors,
        # which autograd refuses half-way through a step
        with self._lock, torch.inference_mode(False):
            return self._transcribe(waveform, sample_rate, domain, segment, utt_id)

    def _transcribe(self, waveform, sample_rate, domain, segment, utt_id) -> str:
        policy = getattr(self.method, "reset_policy", None)
        if segment is None and getattr(policy, "name", None) == "oracle":   # it never fired
            raise ValueError("transcribe: the oracle reset policy needs segment= (the domain "
                             "block of this utterance: it resets where the label changes)")
        if segment is not None and (isinstance(segment, bool)
                                    or not isinstance(segment, (int, np.integer))):
            raise ValueError(f"transcribe: segment must be an integer (the domain block's "
                             f"label), got {segment!r}")     # "0" and 0 were two blocks
        wav = as_mono_float(waveform)
        if not torch.isfinite(wav).all():
            raise ValueError("transcribe: the waveform contains NaN or inf")
        sr = self.sample_rate if sample_rate is None else sample_rate
        if isinstance(sr, (bool, str)) or not isinstance(sr, (int, float, np.number)) \
                or not float(sr).is_integer() or sr < 1:     # 0 was taken as the default rate
            raise ValueError(f"transcribe: sample_rate must be a positive whole number of Hz, "
                             f"got {sample_rate!r}")
        sr = int(sr)
        if sr != self.sample_rate:
            import torchaudio
            wav = torchaudio.functional.resample(wav, sr, self.sample_rate)
        limit = float(self.settings.get("max_duration") or 0)
        if limit and wav.numel() / self.sample_rate > limit:
            raise ValueError(f"transcribe: {wav.numel() / self.sample_rate:g} s is longer than "
                             f"max_duration ({limit:g} s), which a recipe run skips too; split "
                             f"the audio, or build the stream with overrides={{'max_duration': 0}} "
                             f"(no limit)")
        check = too_short(self.method)
        why = check(wav.numel()) if check is not None else None
        if why:
            raise ValueError(f"transcribe: {wav.numel()} samples at {self.sample_rate} Hz are too "
                             f"short for the model ({why})")
        info = UttInfo(id=utt_id or str(self.position), position=self.position, domain=domain,
                       segment=int(segment or 0))
        hyp = self.method.process(wav, info)
        for ev in self.method.events:
            if ev.kind == "reset":
                self.resets.append(ev.position)
            elif ev.kind == "lii":
                self._lii.append((ev.position, ev.value, ev.reason))
        self.method.events.clear()
        self.position += 1
        return hyp

    @property
    def lii(self) -> List[tuple]:
        """``(position, LII, stage)`` of the latest ``lii_history`` LII values, oldest first."""
        return list(self._lii)

    @lii.setter
    def lii(self, values):
        self._lii.clear()
        self._lii.extend(values)

    @property
    def counts(self) -> Dict[str, int]:
        """Forward / backward passes so far (adaptation, inference, auxiliary)."""
        with self._lock:                    # whole utterances, not one half counted
            return dict(self.method.counts)

    def reset(self):
        """Back to the source model (the detector and meta-parameters too)."""
        with self._lock, torch.inference_mode(False):     # see _NORMAL_TENSORS
            self._reset()

    def _reset(self):
        m = self.method
        if not m.episodic:
            m.reset_meta(m.t, self.position, "user")
            done = [ev.position for ev in m.events if ev.kind == "reset"]   # as a policy's
            m.events.clear()
        else:
            m.reset()
            done = [self.position]                  # listed as a continual method's is
        for at in done:         # a second reset at one position is the same reset: listed once
            if not self.resets or self.resets[-1] != at:
                self.resets.append(at)

    def identity(self) -> Dict:
        """What a saved state must match to be loaded here: the method, its reset policy (the
        dynamic one's schedule too: its construction stage, K utterances, fits the Gaussian at
        one position; a state saved before that position with a larger K, loaded with a smaller
        one, had passed it and never tested again), the source model (by content, ``None`` when
        unknown; a local directory's as the stream loaded it), its language (``target_lang``:
        the adapter and vocabulary of an MMS checkpoint; ``None`` for a model without language
        adapters) and the adapted tensors' shapes."""
        from tta_brain.data.cache import source_identity
        policy = getattr(self.method, "reset_policy", None)
        schedule = (f"K {policy.K}, lii_count {policy.lii_count}"
                    if getattr(policy, "name", None) == "dynamic" else None)
        return {"method": getattr(self.method, "name", type(self.method).__name__),
                "reset": getattr(policy, "name", "none") if policy is not None else "none",
                "reset_schedule": schedule,
                "source": (self._loaded_source[1] if self._loaded_source is not None
                           and self._loaded_source[0] == self.source
                           else source_identity(self.source) if self.source else None),
                "target_lang": getattr(getattr(self.method, "lobe", None), "target_lang", None),
                "adapted": [list(p.shape) for p in getattr(self.method, "params", None) or []]}

    def save(self, path: Union[str, os.PathLike]):
        """The stream's state (method, position, resets, LII values, and the random number
        generators a method draws from: AWMC's dropout, SpecAugment's masks) with
        :meth:`identity` and the settings, written atomically (a temporary file, then a
        rename)."""
        from tta_brain.data.cache import save_torch
        from tta_brain.run.checkpoint import get_rng_state
        if not str(path).strip():
            raise StreamStateError("TTAStream.save: the path is empty")
        with self._lock:
            self._save(path, save_torch, get_rng_state)

    def _save(self, path, save_torch, get_rng_state):
        try:
            save_torch({"format": STATE_FORMAT, "version": STATE_VERSION,
                        "identity": self.identity(), "settings": self.settings,
                        "method": self.method.state_dict(), "position": self.position,
                        "resets": self.resets, "lii": list(self._lii), "rng": get_rng_state()},
                       path)
        except OSError as e:             # a folder, no parent, not writable, a full disk
            raise StreamStateError(f"{path}: cannot write the state file: {e.strerror} "
                                   f"(TTAStream.save)") from None

    def load(self, path: Union[str, os.PathLike]):
        """Continue from a state :meth:`save` wrote. Another method, reset policy, source model or
        set of adapted tensors is a :class:`StreamStateError` (one line naming the file and what
        differs), and the stream is left as it was; other settings that differ (``lr``,
        ``steps``, ...) are taken as this stream's and logged: the optimisers keep this stream's
        hyperparameters (the file's moments and step counts are loaded, not its ``lr``). The
        random number generators continue from the file's (a state saved before they were
        recorded: from where they are)."""
        with self._lock, torch.inference_mode(False):     # see _NORMAL_TENSORS
            self._load(str(path))

    def _load(self, path: str):
        if os.path.isdir(path):
            raise StreamStateError(f"{path}: a folder, not a state file (TTAStream.load)")
        if not os.path.isfile(path):
            raise StreamStateError(f"{path}: no such state file (TTAStream.load)")
        from tta_brain.data.cache import damaged_zip
        why = damaged_zip(path)
        if why:
            raise StreamStateError(f"{path}: damaged state file ({why})")
        try:
            sd = torch.load(path, map_location=self.method.lobe.device, weights_only=False)
        except Exception as e:      # pickle / zip errors of every kind: one line
            import zipfile
            with open(path, "rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"
            what = ("cannot be read: cut short or damaged" if zipped and not zipfile.is_zipfile(path)
                    else "not a TTAStream state file")    # torch.save's archive without its end
            said = " ".join(str(e).split())
            raise StreamStateError(f"{path}: {what} ({type(e).__name__}: "
                                   f"{said if len(said) <= 160 else said[:157] + '...'})") from None
        if (not isinstance(sd, dict) or "method" not in sd or "position" not in sd
                or ("format" in sd and not isinstance(sd.get("identity"), dict))):
            raise StreamStateError(f"{path}: not a TTAStream state file (written by TTAStream.save)")
        if "format" not in sd:          # saved before states carried their identity
            logger.warning("%s: a state saved by an older tta_brain: its method and model are "
                           "not recorded, so not checked", path)
        elif sd.get("format") != STATE_FORMAT or sd.get("version") != STATE_VERSION:
            raise StreamStateError(f"{path}: state format {sd.get('format')!r} version "
                                   f"{sd.get('version')!r}; this tta_brain reads {STATE_FORMAT!r} "
                                   f"version {STATE_VERSION}")
        else:
            from tta_brain.data.cache import same_source
            mine, theirs = self.identity(), sd["identity"]
            diffs = [f"{k} {_short(theirs.get(k))} (file) != {_short(mine[k])} (this stream)"
                     for k in mine if mine[k] is not None and theirs.get(k) is not None
                     and theirs.get(k) != mine[k]
                     and not (k == "source" and same_source(theirs[k], mine[k]))]
            if diffs:
                raise StreamStateError(f"{path}: saved by another stream: {'; '.join(diffs)}")
        bad = _bad_fields(sd)
        if bad:
            raise StreamStateError(f"{path}: not a TTAStream state file ({bad}); the stream is "
                                   f"left as it was")
        saved = sd.get("settings") or {}
        other = sorted(k for k in set(self.settings) | set(saved)
                       if "format" in sd and self.settings.get(k) != saved.get(k))
        before = self.method.state_dict()
        kept = _hyperparameters(self.method)
        try:
            self.method.load_state_dict(sd["method"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:   # an unchecked older file
            self.method.load_state_dict(before)
            raise StreamStateError(f"{path}: does not fit this stream's {self.identity()['method']}"
                                   f" ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
                                   f"the stream is left as it was") from None
        for optimizer, groups in kept:              # load_state_dict made new group dicts
            for group, values in zip(optimizer.param_groups, groups):
                group.update(values)
        if other:                  # said once the state fits (a refused one was said as taken)
            logger.warning("%s: saved with other settings, continuing with this stream's: %s",
                           path, ", ".join(f"{k} {saved.get(k)!r} -> {self.settings.get(k)!r}"
                                           for k in other))
        self.position, self.resets = sd["position"], list(sd["resets"])
        self.lii = list(sd.get("lii", []))
        if sd.get("rng") is not None:
            from tta_brain.run.checkpoint import set_rng_state
            set_rng_state(sd["rng"])


def api_words(message: str) -> str:
    """A yaml error, said for decode's command line (``--lr=abc``), in the words of a
    :meth:`TTAStream.from_hparams` call: ``overrides['lr']=abc`` (``device=`` its argument); a
    command it suggests (``python -m tta_brain.stats --source ...``) stays as it is."""
    said, command, rest = message.partition("python -m ")
    said = re.sub(r"(?<![\w-])--(device|source)(?:=|(?![\w-]))", r"\1=", said)  # own arguments
    return re.sub(r"(?<![\w-])--([A-Za-z_]\w*)", r"overrides['\1']", said) + command + rest


def _bad_fields(sd: Dict) -> str:
    """What is wrong with a state's own fields ("" when nothing): checked before any of it is
    applied (a file with a bad ``resets`` had loaded the method's state, then failed)."""
    pos = sd.get("position")
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0:
        return f"position {pos!r} is not a count of utterances"
    resets = sd.get("resets")
    if not isinstance(resets, (list, tuple)) or not all(
            isinstance(r, int) and not isinstance(r, bool) for r in resets):
        shown = repr(resets)
        return f"resets {shown if len(shown) <= 60 else shown[:57] + '...'} is not a list of " \
               f"positions"
    if not isinstance(sd.get("lii", []), (list, tuple)):
        return f"lii {type(sd.get('lii')).__name__} is not a list"
    if "format" in sd and not isinstance(sd.get("settings"), dict):
        return "no settings recorded"
    return ""


#: An optimiser group's settings (not its state): a loaded stream keeps its own.
_HYPER = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov")


def _hyperparameters(method) -> List[tuple]:
    """(optimiser, its groups' hyperparameters) of every optimiser of ``method``
    (``optimizer``, DSUTA's ``slow_optimizer``, CEA's ``optimizer2``, ...), to put back after a
    load: ``Optimizer.load_state_dict`` takes the saved groups' ``lr`` too."""
    return [(value, [{k: g[k] for k in _HYPER if k in g} for g in value.param_groups])
            for value in vars(method).values() if isinstance(value, torch.optim.Optimizer)]


def _short(value) -> str:
    """An identity value for a one-line message (the adapted shapes as counts)."""
    if isinstance(value, list):
        return f"{len(value)} tensors of {sum(int(np.prod(s)) for s in value)} values"
    return repr(value)


#: Integer PCM -> float in [-1, 1): the divisor and offset ``soundfile`` (libsndfile) uses.
_PCM = {torch.int16: (2.0 ** 15, 0.0), torch.int32: (2.0 ** 31, 0.0), torch.int8: (2.0 ** 7, 0.0),
        torch.uint8: (2.0 ** 7, 128.0)}


def as_mono_float(waveform) -> torch.Tensor:
    """One utterance as a 1-D float32 tensor: integer PCM scaled to [-1, 1), channels
    (``[C, T]`` or ``[T, C]``: the shorter side) averaged; anything else a one-line ValueError."""
    try:
        if isinstance(waveform, (bytes, bytearray)) or (
                isinstance(waveform, memoryview) and waveform.format == "B"
                and isinstance(waveform.obj, (bytes, bytearray))):
            raise TypeError("raw bytes (wave's readframes, pyaudio's read; a memoryview of them "
                            "too): their sample width is unknown; give their samples, e.g. "
                            "memoryview(data).cast('h') or numpy.frombuffer(data, "
                            "dtype=numpy.int16)")
        if isinstance(waveform, (str, os.PathLike)):
            raise TypeError("a path? read it with tta_brain.data.audio.load_audio")
        if isinstance(waveform, torch.Tensor):  # a differentiable front end's output: samples
            wav = waveform.detach()
        elif isinstance(waveform, (array.array, memoryview)):   # buffers: their sample type,
            wav = torch.as_tensor(np.array(waveform))            # not int64 (a copy: writable)
        elif isinstance(waveform, np.ndarray) and not waveform.flags.writeable:
            wav = torch.as_tensor(waveform.copy())   # numpy.frombuffer's: torch warned of it
        else:
            wav = torch.as_tensor(waveform)
    except (TypeError, ValueError, RuntimeError) as e:     # a path, ragged lists, objects
        raise ValueError(f"transcribe: expected the samples (a numpy array, torch tensor or list "
                         f"of floats), got {type(waveform).__name__} ({e})") from None
    shape = tuple(wav.shape)
    if wav.device.type == "meta" or wav.is_complex():       # (no samples; not a signal)
        raise ValueError(f"transcribe: expected real samples, got a {wav.dtype} tensor on "
                         f"{wav.device}")
    if wav.dtype in _PCM:
        scale, offset = _PCM[wav.dtype]
        wav = (wav.to(torch.float64) - offset) / scale
    elif not wav.is_floating_point():           # int64: a list of integers, whose PCM width
        raise ValueError(f"transcribe: expected float samples or integer PCM (int8, uint8, "
                         f"int16, int32), got {wav.dtype} (integer samples: give their width, "
                         f"e.g. numpy.asarray(samples, dtype=numpy.int16))")   # is unknown
    wav = wav.to(torch.float32)
    if wav.dim() == 2 and wav.numel():
        wav = wav.mean(dim=0 if wav.shape[0] <= wav.shape[1] else 1)
    if wav.dim() != 1 or wav.numel() == 0:
        raise ValueError(f"transcribe: expected a non-empty 1-D waveform, got shape {shape}")
    return wav



def main(argv: Optional[List[str]] = None) -> int:
    """``python -m tta_brain.stream``: this module is a Python API, not a command. ``--help``
    prints how to use it; anything else says so in one line (exit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    print("tta_brain.stream is a Python API (TTAStream, in your own loop), not a command: "
          "`python -m tta_brain.stream --help` shows its use; to decode a stream's manifest, "
          "run `python -m tta_brain.decode`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
