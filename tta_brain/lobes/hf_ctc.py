"""Source-model lobe: any Hugging Face CTC checkpoint (wav2vec 2.0, HuBERT, data2vec-audio, ...).

``source`` is a local directory written by ``save_pretrained`` (fully offline) or a hub name
(needs the files in the local HF cache or network access). The processor's feature extractor
decides the input normalisation (zero mean / unit variance per utterance when ``do_normalize``)
and whether an attention mask is used; its tokenizer maps label ids back to text.
"""
import contextlib
import io
import logging
import os
import re
import sys
import warnings
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from tta_brain.asr.ctc import collapse
from tta_brain.data.cache import hub_snapshot, hub_unreachable
from tta_brain.lobes.families import FEATURE_MODELS, base_model as base_of
from tta_brain.lobes.gemm_conv import CONVOLUTIONS, gemm_convolutions
from tta_brain.lobes.partial import PartialForward, padding_blocker
from tta_brain.lobes.runtime import Runtime, check_default_dtype
from tta_brain.lobes.weight_norm import cache_frozen_weight_norms

logger = logging.getLogger(__name__)

__all__ = ["HFCTCLobe", "module_draws", "freeze_batch_norm_statistics", "W2V2_CHAR_VOCAB",
           "save_char_processor", "normalize_waveforms"]

# The character vocabulary of facebook/wav2vec2-base-960h (blank = <pad> = 0, word delimiter "|").
W2V2_CHAR_VOCAB = ("<pad>", "<s>", "</s>", "<unk>", "|", "E", "T", "A", "O", "N", "I", "H", "S",
                   "R", "D", "L", "U", "M", "W", "C", "F", "G", "Y", "P", "B", "V", "K", "'", "X",
                   "J", "Q", "Z")


def save_char_processor(out_dir: str, vocab: Sequence[str] = W2V2_CHAR_VOCAB,
                        sample_rate: int = 16000, attention_mask: bool = False):
    """Write a character-level ``Wav2Vec2Processor`` (vocab.json, tokenizer and feature-extractor
    files) into ``out_dir``, beside a model saved there with ``save_pretrained``; return it."""
    import json

    from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2Processor

    os.makedirs(out_dir, exist_ok=True)
    vocab_file = os.path.join(out_dir, "vocab.json")
    with open(vocab_file, "w") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f)
    tok = Wav2Vec2CTCTokenizer(vocab_file, unk_token="<unk>", pad_token="<pad>",
                               word_delimiter_token="|")
    fe = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=sample_rate, padding_value=0.0,
                                  do_normalize=True, return_attention_mask=attention_mask)
    processor = Wav2Vec2Processor(feature_extractor=fe, tokenizer=tok)
    processor.save_pretrained(out_dir)
    return processor


def normalize_waveforms(wavs: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Zero mean, unit variance per utterance over its valid samples (``[B, T]`` or ``[T]``; with
    ``lengths`` the padding is left at zero), as ``Wav2Vec2FeatureExtractor(do_normalize=True)``."""
    if lengths is None:
        mean = wavs.mean(dim=-1, keepdim=True)
        var = wavs.var(dim=-1, unbiased=False, keepdim=True)
        return (wavs - mean) / torch.sqrt(var + 1e-7)
    mask = torch.arange(wavs.shape[-1], device=wavs.device)[None] < lengths[:, None]
    n = lengths[:, None].to(wavs.dtype)
    mean = (wavs * mask).sum(-1, keepdim=True) / n
    var = (((wavs - mean) * mask) ** 2).sum(-1, keepdim=True) / n
    return ((wavs - mean) / torch.sqrt(var + 1e-7)) * mask


def _not_found(source: str) -> str:
    return (f"source model directory not found: {source} (a local directory written by "
            f"save_pretrained; a hub model is given by its name, e.g. "
            f"facebook/wav2vec2-base-960h, and must be in the local HF cache without network)")


def _not_cached(source: str, why: str) -> str:
    return (f"it is not in the local Hugging Face cache and {why}.\n`source` must be a local "
            f"directory written by save_pretrained or a hub name already in the HF cache "
            f"(`huggingface-cli download {source}` on a machine with network, into HF_HOME)")


def source_problem(source: str) -> Optional[str]:
    """Why no run could load ``source``, found without loading it (None: it may load): a path
    that is not there, a folder without ``config.json``, a hub name neither cached nor
    reachable. A grid asks once, before its runs (each one would fail the same way)."""
    source = str(source)
    if os.path.isdir(source):
        return (None if os.path.isfile(os.path.join(source, "config.json")) else
                f"{source} holds no config.json: not a model folder written by save_pretrained")
    if _looks_like_a_path(source):
        return _not_found(source)
    why = not hub_snapshot(source, None) and hub_unreachable()
    return " ".join(_not_cached(source, why).split()) if why else None


def _looks_like_a_path(source: str) -> bool:
    """A local path rather than a hub name (``org/name``): absolute, relative with ``./`` or
    ``../``, ``~``, more than one ``/``, or an existing parent folder."""
    s = str(source)
    if s.startswith(("/", "./", "../", "~")) or s.count("/") > 1 or os.sep != "/" and os.sep in s:
        return True
    parent = os.path.dirname(s)
    return bool(parent) and os.path.isdir(parent)


def module_draws(module: nn.Module) -> List[str]:
    """What ``module``'s train mode does that its eval mode does not, module by module: its
    dropout modules with p > 0 (``name (p=...)``) and its batch norms (``name (batch norm)``:
    they normalise by the batch in train mode)."""
    return [f"{n} (p={m.p})" if isinstance(m, nn.modules.dropout._DropoutNd) else
            f"{n} (batch norm)" for n, m in module.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
            or isinstance(m, nn.modules.batchnorm._BatchNorm)]


def freeze_batch_norm_statistics(module: nn.Module) -> List[str]:
    """Keep the running statistics of ``module``'s batch norms as they are (momentum 0): a
    train-mode pass still normalises by the batch, and changes no buffer, so what a reset, an
    episodic method's next utterance or a resumed run starts from is the source model's
    statistics. Returns the batch norms' names."""
    names = []
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            m.momentum = 0.0
            names.append(name)
    return names


def _load_part(source: str, part: str, needs: Sequence[str], files: str, load):
    """``load()`` one part of a CTC checkpoint; any failure (a missing or malformed file, a
    truncated safetensors file, a tokenizer that wants a library this checkout lacks, no network)
    becomes one RuntimeError naming the source, the part, its files (``files``) and, for a local
    directory, which of the files the part ``needs`` are missing there."""
    try:
        return load()
    except Exception as e:   # transformers, huggingface_hub and safetensors raise many types
        local = os.path.isdir(source)
        missing = [f for f in needs if local and not os.path.exists(os.path.join(source, f))]
        hint = ("a local directory written by save_pretrained (config.json, model weights, "
                "preprocessor_config.json, vocab.json)")
        if not local:
            hint += " or a hub name already in the HF cache (no network here?)"
        why = " ".join(str(e).split()).rstrip(".") or type(e).__name__
        if len(why) > _WHY_CHARS:
            why = why[:_WHY_CHARS].rstrip() + " ..."
        # a missing file is the cause; what transformers made of it is noise (a list of 400
        # model types without config.json, "requires protobuf" without vocab.json)
        raise RuntimeError(
            f"Cannot load the CTC source model '{source}': its {part} ({files})"
            + (f": {', '.join(missing)} missing in {source}" if missing
               else f": {type(e).__name__}: {why}") + f".\n`source` must be {hint}.") from e


#: How much of a loading library's own message a source-model error keeps.
_WHY_CHARS = 300


def _id_ranges(ids: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``'3-5, 9'``."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return ", ".join(out)


def _weights_at_fault(source: str) -> str:
    """When a local checkpoint's model did not load: those of its weight files that cannot be
    read on their own, with their sizes (``'/m/model.safetensors (100000 bytes)'``: a download
    cut short); '' when they all read (the fault is elsewhere: the config, the classes)."""
    import torch

    if not os.path.isdir(source):
        return ""
    bad = []
    for name in sorted(os.listdir(source)):    # model.safetensors, pytorch_model.bin, shards
        path = os.path.join(source, name)      # (not training_args.bin: no weights)
        if not name.startswith(("model", "pytorch_model")):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors import safe_open
                with safe_open(path, framework="pt") as f:
                    f.keys()
            elif name.endswith(".bin"):
                torch.load(path, map_location="cpu", weights_only=True)
            else:
                continue
        except Exception:
            bad.append(f"{path} ({os.path.getsize(path)} bytes)")
    return ", ".join(bad)


class _HeldRecords(logging.Filter):
    """A logging filter that holds the records it sees (to be handled later, or dropped)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record):
        self.records.append(record)
        return False


def _vocab_languages(source: str) -> Optional[List[str]]:
    """The languages of a local checkpoint's vocab.json that holds one vocabulary per language
    (MMS: ``{"eng": {...}, "fra": {...}}``), sorted; None where it holds one vocabulary (or is
    not a local file)."""
    import json
    try:
        with open(os.path.join(source, "vocab.json"), encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError):
        return None
    nested = isinstance(vocab, dict) and vocab and all(isinstance(v, dict) for v in vocab.values())
    return sorted(vocab) if nested else None


def _adapter_languages(source: str) -> List[str]:
    """The languages of a local checkpoint's adapter files (``adapter.<lang>.safetensors`` or
    ``.bin``, as transformers' ``Wav2Vec2ForCTC.load_adapter`` reads them), sorted."""
    names = os.listdir(source) if os.path.isdir(source) else ()
    return sorted({m.group(1) for n in names
                   if (m := re.fullmatch(r"adapter\.(.+)\.(?:safetensors|bin)", n))})


def _some(names: Sequence[str], most: int = 20) -> str:
    """``names`` joined, at most ``most`` of them (then how many in all)."""
    shown = ", ".join(names[:most]) or "none"
    return shown + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _check_language(source: str, target_lang: Optional[str]):
    """A ``target_lang`` that a local checkpoint's vocab.json has no vocabulary for, or a
    checkpoint of one vocabulary per language without a language (in ``target_lang`` or
    tokenizer_config.json), is one ValueError naming ``target_lang``."""
    import json
    languages = _vocab_languages(source)
    if not target_lang:
        try:
            with open(os.path.join(source, "tokenizer_config.json"), encoding="utf-8") as f:
                default = json.load(f).get("target_lang")
        except (OSError, ValueError, AttributeError):
            default = None
        if languages and not default:
            raise ValueError(f"target_lang: {source}'s vocab.json holds one vocabulary per "
                             f"language ({_some(languages)}) and tokenizer_config.json names "
                             f"none: set target_lang")
        return
    if languages is not None and target_lang not in languages:
        raise ValueError(f"target_lang: {target_lang!r} is not a language of {source}'s "
                         f"vocab.json ({_some(languages)})")


def _hub_folder(name: str, kwargs: dict) -> str:
    """The folder of hub model ``name``'s vocab.json, fetched as its tokenizer would be
    (``from_pretrained``'s ``kwargs``), for :func:`_check_language` to read; ``name`` where it
    cannot be had (then nothing is checked: the loading says what failed)."""
    try:
        from transformers.utils.hub import cached_file
        path = cached_file(name, "vocab.json", _raise_exceptions_for_missing_entries=False,
                           **kwargs)
    except Exception:        # no network, no such repository: the model's loading says so
        return name
    return os.path.dirname(path) if path else name


def _load_checkpoint(source: str, kwargs: dict, target_lang: Optional[str] = None,
                     listed: bool = True):
    """The model, feature extractor and tokenizer of a CTC checkpoint (``from_pretrained(source,
    **kwargs)``); a failure is one RuntimeError (:func:`_load_part`). ``target_lang``: the
    language of a checkpoint with language adapters (MMS): its adapter (transformers'
    ``load_adapter``: the attention adapters and the CTC head, sized to its vocabulary) and its
    vocabulary; a language it has none for is one ValueError (:func:`_check_language`; a missing
    adapter file too where the folder holds all of the checkpoint's files, ``listed``: not a
    cached hub snapshot, which holds those fetched so far)."""
    from transformers import AutoFeatureExtractor, AutoModelForCTC, AutoTokenizer

    def model():
        held = _HeldRecords()        # transformers' own warnings, said unless we refuse the model
        loading = logging.getLogger("transformers.modeling_utils")
        loading.addFilter(held)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                loaded, info = AutoModelForCTC.from_pretrained(source, output_loading_info=True,
                                                               **kwargs)
        except Exception as e:
            weights = _weights_at_fault(source)
            if weights:    # e.g. a truncated model.safetensors: say which file
                why = " ".join(str(e).split()).rstrip(".") or type(e).__name__
                raise ValueError(f"cannot read the weights in {weights} "
                                 f"({type(e).__name__}: {why})") from e
            raise
        finally:
            loading.removeFilter(held)
            # transformers 4.57 prints "Config not found for parakeet" (its docstring generator)
            # three times when it first imports Parakeet's modelling code: not ours to show
            for line in printed.getvalue().splitlines(keepends=True):
                if not line.startswith("\U0001f6a8 Config not found for"):
                    sys.stdout.write(line)
        head = sorted(k for k in info.get("missing_keys") or () if k.startswith("lm_head."))
        if head:       # transformers only warns, and the run decodes with a random output layer
            raise ValueError(
                f"the checkpoint has no CTC output layer ({', '.join(head)} would be random): a "
                f"pretrained-only model (e.g. facebook/wav2vec2-base) is no recogniser; use a "
                f"CTC fine-tuned one (e.g. facebook/wav2vec2-base-960h)")
        for record in held.records:
            loading.handle(record)
        return loaded

    _check_language(source if os.path.isdir(source) else _hub_folder(source, kwargs),
                    target_lang)
    loaded = _load_part(source, "model", ("config.json",), "config.json, the weights", model)
    if target_lang:
        if getattr(loaded.config, "adapter_attn_dim", None) is None:
            raise ValueError(f"target_lang: {source} has no language adapters (its config.json "
                             f"sets no adapter_attn_dim): leave target_lang out")
        adapters = _adapter_languages(source)
        if listed and os.path.isdir(source) and target_lang not in adapters:
            raise ValueError(f"target_lang: {source} has no adapter for {target_lang!r} "
                             f"(adapter.{target_lang}.safetensors; its adapters: "
                             f"{_some(adapters)})")
        _load_part(source, f"adapter of {target_lang!r}", (), f"adapter.{target_lang}.safetensors",
                   lambda: loaded.load_adapter(target_lang, **kwargs))
    # one vocabulary per language: the language's (a checkpoint of one vocabulary keeps it)
    language = ({"target_lang": target_lang} if target_lang and (
        _vocab_languages(source) or not os.path.isdir(source)) else {})
    return (loaded,
            _load_part(source, "feature extractor", ("preprocessor_config.json",),
                       "preprocessor_config.json",
                       lambda: AutoFeatureExtractor.from_pretrained(source, **kwargs)),
            _load_part(source, "tokenizer", ("vocab.json",), "vocab.json, tokenizer_config.json",
                       lambda: AutoTokenizer.from_pretrained(source, **kwargs, **language)))


class HFCTCLobe(nn.Module):
    """``transformers.AutoModelForCTC`` + its processor, with greedy CTC decoding to text.

    Arguments
    ---------
    source : str
        Local directory or hub name of a CTC checkpoint with processor files.
    savedir : str, optional
        HF cache directory (``cache_dir``).
    local_files_only : bool, optional
        Never touch the network. Defaults to True for an existing local directory. A hub model
        in the local HF cache is loaded from its cached snapshot without the network unless this
        is False (then the hub is asked for updates, as ``from_pretrained`` does).
    sample_rate : int, optional
        The input's sample rate: by default the processor's (16 kHz without one); a value that
        differs from the processor's is refused. Every reader of a stream resamples to it.
    device : str
        Where the model lives (``cpu``, ``cuda:0``); methods snapshot state on this device.
    runtime : Runtime, optional
        How the passes run (precision, compile, feature cache, CPU backward kernels); default
        ``Runtime()`` (fp32, eager, exact speed paths).
    target_lang : str, optional
        A checkpoint with language adapters and one vocabulary per language (MMS:
        facebook/mms-1b-all): the language (``fra``) whose adapter (``adapter.fra.safetensors``:
        the attention adapters and the CTC head) and vocabulary are loaded; None or "": the
        checkpoint's own (MMS: ``eng``). Refused for a checkpoint without adapters.
    """

    def __init__(self, source: str, savedir: Optional[str] = None,
                 local_files_only: Optional[bool] = None, sample_rate: Optional[int] = None,
                 device: str = "cpu", runtime: Optional[Runtime] = None,
                 target_lang: Optional[str] = None):
        super().__init__()
        target_lang = str(target_lang) if target_lang else None
        check_default_dtype(f"HFCTCLobe({source!r})")
        if not os.path.isdir(source) and _looks_like_a_path(source):
            raise FileNotFoundError(_not_found(source))
        snapshot = (hub_snapshot(source, savedir) if not os.path.isdir(source)
                    and local_files_only is not False else None)
        parts = None
        if snapshot:          # a cached hub model: no network (a cluster node may have none)
            try:
                parts = _load_checkpoint(snapshot, dict(local_files_only=True), target_lang,
                                         listed=False)
                logger.info("%s: loaded from the local Hugging Face cache (commit %s) without "
                            "the network; `huggingface-cli download %s` updates it", source,
                            os.path.basename(snapshot), source)
            except RuntimeError as e:
                logger.warning("%s: the cached snapshot %s is incomplete or unreadable, asking "
                               "the hub: %s", source, snapshot, " ".join(str(e).split()))
        if parts is None:
            if local_files_only is None:
                local_files_only = os.path.isdir(source)
            why = not local_files_only and not snapshot and hub_unreachable()
            if why:                # else minutes of retries before every run of a grid
                raise RuntimeError(f"Cannot load the CTC source model '{source}': "
                                   + _not_cached(source, why))
            parts = _load_checkpoint(source, dict(cache_dir=savedir,
                                                  local_files_only=local_files_only), target_lang)
        self.model, self.feature_extractor, self.tokenizer = parts
        #: the language whose adapter and vocabulary are loaded (a checkpoint with language
        #: adapters, MMS; the tokenizer's default where none was asked for); None: no adapters
        self.target_lang = ((target_lang or getattr(self.tokenizer, "target_lang", None))
                            if getattr(self.model.config, "adapter_attn_dim", None) else None)
        sr = getattr(self.feature_extractor, "sampling_rate", None) or sample_rate or 16000
        if sample_rate is not None and sr != sample_rate:
            raise ValueError(f"{source}: the processor expects {sr} Hz audio, not {sample_rate} "
                             f"(sample_rate: leave it out to take the processor's)")
        self.sample_rate = int(sr)    # (an 8 kHz checkpoint: its streams are resampled to 8 kHz)
        #: the model's input: ``input_values`` (the waveform: the wav2vec 2.0 family) or the
        #: processor's filterbank features (``input_features``; tested: Wav2Vec2-BERT)
        self.input_name = str(getattr(self.model, "main_input_name", "input_values"))
        self.filterbank = self.input_name != "input_values"
        self._fbank_frames = {}
        #: Parakeet's extractor: its centred STFT has 1 + n // hop frames of n samples and its mask
        #: ``(n + 2 (n_fft // 2) - n_fft) // hop`` valid ones, the last frame masked for an even
        #: n_fft (its only setting: 512); an odd one depends on n, which the features do not hold
        self.masked_tail = 0
        if type(self.feature_extractor).__name__ == "ParakeetFeatureExtractor":
            n_fft = int(self.feature_extractor.n_fft)
            if n_fft % 2:
                raise ValueError(f"{source}: a Parakeet feature extractor with an odd n_fft "
                                 f"({n_fft}) masks frames by the audio's length, not its frames")
            self.masked_tail = 1
        self.do_normalize = bool(getattr(self.feature_extractor, "do_normalize", True))
        self.use_attention_mask = bool(getattr(self.feature_extractor, "return_attention_mask", False))
        self.blank_id = int(self.model.config.pad_token_id if self.model.config.pad_token_id is not None
                            else self.tokenizer.pad_token_id)
        tok_pad = self.tokenizer.pad_token_id
        if tok_pad is not None and int(tok_pad) != self.blank_id:
            # transformers' CTC loss trained the model with config.json's blank, and its
            # processor's batch_decode takes the tokenizer's pad token for it: one of the two
            # transcripts drops a real character (e.g. every word delimiter) as blank
            logger.warning(
                "%s: config.json's pad_token_id %d (%r), the CTC blank used here, is not the "
                "tokenizer's pad token %r (id %d): the processor's batch_decode would take that "
                "for the blank; check which one the model was fine-tuned with", source,
                self.blank_id, self.tokenizer.convert_ids_to_tokens(self.blank_id),
                self.tokenizer.pad_token, int(tok_pad))
        self.vocab_size = int(self.model.config.vocab_size)
        self.word_delimiter = getattr(self.tokenizer, "word_delimiter_token", "|")
        vocab = self.tokenizer.get_vocab()
        self.id_to_token = {i: t for t, i in vocab.items()}
        unnamed = [i for i in range(self.vocab_size) if i not in self.id_to_token]
        if unnamed:        # their frames would vanish from every transcript
            raise ValueError(
                f"{source}: the model outputs {self.vocab_size} classes but its tokenizer names "
                f"only {self.vocab_size - len(unnamed)} of them (no token for id"
                f"{'s' if len(unnamed) > 1 else ''} {_id_ranges(unnamed)}): vocab.json does "
                f"not belong to this model")
        self.word_delimiter_id = vocab.get(self.word_delimiter)
        #: word pieces (SentencePiece's, Parakeet CTC's) rather than characters and a delimiter;
        #: a character CTC tokenizer (``Wav2Vec2CTCTokenizer``: it has a word delimiter) whose
        #: vocabulary lacks its delimiter (a script without spaces, or a vocabulary whose space
        #: is ``" "`` and not the tokenizer's ``"|"``) still spells characters: its
        #: ``convert_tokens_to_string`` groups repeats and returns a dict
        self.word_pieces = (self.word_delimiter_id is None
                            and not hasattr(self.tokenizer, "word_delimiter_token"))
        self.special_ids = set(self.tokenizer.all_special_ids) - {self.blank_id}
        self.model.eval()
        # frozen weight norms (the positional convolution's) computed once, not on every pass
        self.cached_weight_norms = cache_frozen_weight_norms(self.model)
        self.to(device)
        self.runtime = runtime or Runtime()
        #: the CNN's convolutions run as matrix products (``convolutions: gemm``), how many
        if self.runtime.convolutions not in CONVOLUTIONS:   # (yaml runs: checked by the rules)
            raise ValueError(f"convolutions: {self.runtime.convolutions!r} is not one of "
                             f"{', '.join(CONVOLUTIONS)}")
        self.gemm_convs = (gemm_convolutions(self.model) if self.runtime.convolutions == "gemm"
                           else 0)
        if self.gemm_convs:
            logger.info("convolutions: gemm: %d CNN convolutions run as matrix products",
                        self.gemm_convs)
        if self.runtime.compile:
            self.compile_forward()

    # ------------------------------------------------------------------ input
    def normalize(self, wavs: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The processor's input normalisation (:func:`normalize_waveforms` when ``do_normalize``)."""
        return normalize_waveforms(wavs, lengths) if self.do_normalize else wavs

    def prepare(self, wav: torch.Tensor) -> torch.Tensor:
        """A 1-D waveform (or ``[B, T]`` of equal lengths) -> the model input on the model's
        device: the normalised waveform ``[1, T]``, or for a filterbank model
        (:attr:`filterbank`) the processor's features ``[1, F, D]`` (:meth:`filterbank_features`)."""
        if wav.dim() == 1:
            wav = wav[None]
        if self.filterbank:
            return self.filterbank_features(wav).to(self.device)
        wav = wav.to(device=self.device, dtype=torch.float32)
        return self.normalize(wav)

    def filterbank_features(self, wavs: torch.Tensor) -> torch.Tensor:
        """The processor's features of the waveforms ``[B, T]`` (equal lengths), float32, on the
        host: exactly what the processor gives the model, with its padding (SeamlessM4T's
        extractor pads an odd frame count by one frame of ``padding_value`` before stacking
        pairs; :meth:`feature_mask` finds that frame again)."""
        out = self.feature_extractor([w.detach().float().cpu().numpy() for w in wavs],
                                     sampling_rate=self.sample_rate, return_tensors="pt")
        return out[self.input_name].float()

    def feature_mask(self, inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """The attention mask the processor gives with filterbank ``inputs [B, F, D]`` (None for
        an extractor that stacks no frames): every frame but a last one whose stacked second half
        is the extractor's padding (every value ``padding_value``, which no normalised filterbank
        frame is), as the processor's own mask (the model's adapter and attention read it). No
        host read and no branch on the values, so it runs under ``vmap``. Parakeet's extractor
        (:attr:`masked_tail`): every frame but the last, the centred STFT's frame past the
        audio, which its mask leaves out (and its features zero) for an utterance of any length."""
        if self.masked_tail and inputs.dim() == 3 and inputs.shape[1] > 0:
            mask = torch.ones(inputs.shape[0], inputs.shape[1], dtype=torch.long,
                              device=inputs.device)
            mask[:, -self.masked_tail:] = 0
            return mask
        stride = int(getattr(self.feature_extractor, "stride", 1) or 1)
        if stride < 2 or inputs.dim() != 3 or inputs.shape[1] == 0 or inputs.shape[-1] % stride:
            return None
        pad = float(getattr(self.feature_extractor, "padding_value", 0.0))
        tail = inputs[:, -1:, inputs.shape[-1] // stride * (stride - 1):]
        real = ~(tail == pad).all(-1)
        ones = torch.ones(inputs.shape[0], inputs.shape[1] - 1, dtype=torch.long,
                          device=inputs.device)
        return torch.cat([ones, real.long()], 1)

    def prepare_each(self, wavs: torch.Tensor) -> torch.Tensor:
        """Waveforms ``[R, T]`` (equal lengths) -> ``[R, 1, ...]``: each row prepared as its own
        utterance (:meth:`prepare`), for a pass that maps over the rows."""
        if self.filterbank:
            return self.filterbank_features(wavs)[:, None].to(self.device)
        return self.normalize(wavs.to(device=self.device, dtype=torch.float32))[:, None]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ----------------------------------------------------------------- forward
    def forward(self, inputs: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor] = None,
                features: Optional[torch.Tensor] = None,
                samples: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Normalised input ``[B, T]`` -> logits ``[B, F, V]``.

        ``features``: the CNN feature encoder's output for ``inputs`` (:meth:`features`); the
        forward then starts after the CNN (same operations as the model's own forward, so the
        logits are identical). Only without an attention mask. ``samples``: the valid samples of
        zero-padded ``inputs`` (or ``features``): a padded pass (:meth:`padded_logits`).
        """
        if samples is not None:
            partial = self.__dict__.get("_partial")
            if partial is None:
                partial = self.__dict__["_partial"] = PartialForward(self)
            return partial.padded(inputs, samples, features)[0]
        if features is not None:
            return self._from_features(features)
        if self.filterbank:
            return self._model(inputs, attention_mask=self.feature_mask(inputs)).logits
        if attention_mask is not None and self.use_attention_mask:
            return self._model(inputs, attention_mask=attention_mask).logits
        return self._model(inputs).logits

    def logits(self, inputs: torch.Tensor, params: Optional[dict] = None,
               features: Optional[torch.Tensor] = None,
               samples: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Float32 logits of normalised ``inputs`` under the runtime's precision.

        ``params`` ({name: tensor}, names as in ``lobe.named_parameters()``, i.e. ``model.<...>``)
        replace those parameters for this call only (``torch.func.functional_call``); the live
        model is untouched. ``features``, ``samples``: see :meth:`forward`.
        """
        kwargs = {} if features is None else {"features": features}
        if samples is not None:
            kwargs["samples"] = samples
        with self.runtime.autocast(self.device.type):
            if params is None:
                logits = self(inputs, **kwargs)
            else:
                logits = functional_call(self, params, (inputs,), kwargs)
        return logits if self.runtime.dtype is None else logits.float()

    def _pointwise_head(self) -> Optional[nn.Conv1d]:
        """Parakeet CTC's head: a kernel-1 ``Conv1d`` (``ctc_head``) on its encoder's output."""
        head = getattr(self.model, "ctc_head", None)
        return head if isinstance(head, nn.Conv1d) and tuple(head.kernel_size) == (1,) else None

    def head_weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The CTC head as a linear map of the last hidden state: (weight ``[V, H]``, bias
        ``[V]``), detached: ``lm_head``'s, or Parakeet's kernel-1 convolution's."""
        head = self._pointwise_head()
        if head is not None:
            return head.weight.detach()[:, :, 0], head.bias.detach()
        self._linear_head()
        return self.model.lm_head.weight.detach(), self.model.lm_head.bias.detach()

    def _linear_head(self):
        if not isinstance(getattr(self.model, "lm_head", None), nn.Linear):
            raise ValueError(f"{type(self.model).__name__}: its CTC head is not a linear lm_head "
                             f"on the base model's last hidden state")

    def head_input(self, inputs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """A full pass of model ``inputs`` (:meth:`prepare`) -> (float32 logits ``[B, F, V]``, the
        last hidden state ``[B, F, H]`` that the CTC head reads): ``lm_head(dropout(base_model(
        inputs)[0]))``, the head of every ``*ForCTC`` of transformers with an ``lm_head``
        (the wav2vec 2.0 family, SEW(-D), the Conformer, Wav2Vec2-BERT: after its adapter);
        Parakeet CTC: its ``ctc_head`` (a kernel-1 convolution) on its encoder's output."""
        mask = self.feature_mask(inputs) if self.filterbank else None
        extra = {} if mask is None else {"attention_mask": mask}
        head = self._pointwise_head()
        if head is not None:
            hidden = self.model.encoder(inputs, **extra)[0]
            return head(hidden.transpose(1, 2)).transpose(1, 2).float(), hidden
        self._linear_head()
        hidden = self.base_model(inputs, **extra)[0]
        return self.model.lm_head(self.model.dropout(hidden)).float(), hidden

    @property
    def base_model(self) -> nn.Module:
        """The CTC model's base model, the network below its head (``families.base_model``:
        SEW-D's, which transformers' ``base_model`` misses)."""
        return base_of(self.model)

    def feature_cache_blocker(self, params, train_mode: bool = False) -> Optional[str]:
        """Why the CNN features of an utterance cannot be computed once for every pass of it
        while ``params`` adapt (None: they can)."""
        if not params:
            return "no adapted parameters (one pass per utterance)"
        if not self.supports_features:
            return "the model has no separable feature encoder"
        encoder = self.model.base_model.feature_extractor
        if train_mode and (draws := module_draws(encoder)):
            # (a feature encoder that draws nothing gives its eval-mode features in train mode)
            return f"train_mode (the feature encoder draws in train mode: {', '.join(draws)})"
        fe = {id(p) for p in encoder.parameters()}
        if any(id(p) in fe for p in params):
            return "feature-encoder parameters are adapted"
        return None

    def train_draws(self) -> List[str]:
        """What makes this model's train mode compute other than its eval mode: its dropout,
        LayerDrop and SpecAugment settings above zero (``name=value``), any dropout module with
        p > 0 these do not name, and batch norms (they normalise by the batch in train mode).
        Empty: a train-mode pass is the eval-mode pass (LayerDrop 0 still draws a number per
        layer from torch's generator, and decides nothing with it)."""
        cfg = self.model.config.to_dict()
        # (a nested config's too: Parakeet's dropout is its encoder_config's)
        items = [(f"{k}.{n}", w) for k, v in cfg.items() if isinstance(v, dict)
                 for n, w in v.items()] + list(cfg.items())
        draws = [f"{k}={v}" for k, v in sorted(items)
                 if ("dropout" in k or k.endswith("layerdrop")) and type(v) in (int, float)
                 and v > 0]
        if cfg.get("apply_spec_augment", True):
            draws += [f"{k}={cfg[k]}" for k in ("mask_time_prob", "mask_feature_prob")
                      if (cfg.get(k) or 0) > 0]
        modules = module_draws(self.model)
        if not draws:
            draws += [d for d in modules if "(p=" in d][:1]
        return draws + [d for d in modules if d.endswith("(batch norm)")][:1]

    # The wav2vec 2.0 family (Wav2Vec2, HuBERT, data2vec-audio, WavLM, UniSpeech) runs
    # feature_extractor -> transpose -> feature_projection -> _mask_hidden_states -> encoder
    # (-> adapter) in the base model, then dropout -> lm_head in the CTC head.
    @property
    def supports_features(self) -> bool:
        """Whether :meth:`features` / ``forward(features=...)`` apply to this architecture: a base
        model of :data:`FEATURE_MODELS`, whose forward after the CNN is the one
        :meth:`_logits_from_features` runs (SEW's has the same parts and is not: it pools and
        upsamples around its encoder, and the cached-features pass gave other logits)."""
        base = getattr(self.model, "base_model", None)
        return (base is not None and base is not self.model
                and type(base).__name__ in FEATURE_MODELS
                and all(hasattr(base, a) for a in ("feature_extractor", "feature_projection", "encoder"))
                and hasattr(self.model, "lm_head") and hasattr(self.model, "dropout"))

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """The CNN feature encoder's output ``[B, C, F]`` for normalised input ``[B, T]``."""
        return self.model.base_model.feature_extractor(inputs)

    def _logits_from_features(self, features: torch.Tensor) -> torch.Tensor:
        base = self.model.base_model
        out = base.feature_projection(features.transpose(1, 2))
        hidden = out[0] if isinstance(out, tuple) else out
        if hasattr(base, "_mask_hidden_states"):
            hidden = base._mask_hidden_states(hidden)
        hidden = base.encoder(hidden, return_dict=False)[0]
        if getattr(base, "adapter", None) is not None:
            hidden = base.adapter(hidden)
        return self.model.lm_head(self.model.dropout(hidden))

    @property
    def _model(self):
        compiled = self.__dict__.get("_compiled_model")
        return self.model if compiled is None else compiled

    @property
    def _from_features(self):
        compiled = self.__dict__.get("_compiled_from_features")
        return self._logits_from_features if compiled is None else compiled

    def compile_forward(self, **kwargs):
        """``torch.compile`` the forward (both entry points), dynamic shapes by default.

        The parameters stay those of ``self.model`` (``functional_call`` on the lobe still
        substitutes them). Meant for GPUs; the first utterances pay the compilation.
        """
        kwargs.setdefault("dynamic", True)
        # kept out of the module tree (no duplicate parameters in state_dict / named_parameters)
        self.__dict__["_compiled_model"] = torch.compile(self.model, **kwargs)
        self.__dict__["_compiled_from_features"] = torch.compile(self._logits_from_features, **kwargs)
        return self

    # ------------------------------------------------------------- padded passes
    def padding_blocker(self) -> Optional[str]:
        """Why a padded pass (:meth:`padded_logits`) would not give this model's logits (None:
        it does; ``tta_brain.lobes.partial``)."""
        return padding_blocker(self)

    def padded_logits(self, inputs: Optional[torch.Tensor], samples: torch.Tensor,
                      features: Optional[torch.Tensor] = None, params: Optional[dict] = None):
        """Float32 logits of a zero-padded utterance and its valid frames, ``(logits [B, F, V],
        frames [B])``: the normalised input ``inputs [B, T]`` with ``samples [B]`` valid samples
        (a long tensor on the device), or the zero-padded CNN features of the unpadded input;
        ``params`` as in :meth:`logits`. Exact (to rounding) where :meth:`padding_blocker` is
        None; no host read."""
        return (self.logits(inputs, params, features, samples),
                self.output_lengths(samples))

    @property
    def frame_stride(self) -> int:
        """Input samples per logit frame (the product of the CNN's strides)."""
        stride = 1
        for s in getattr(self.model.config, "conv_stride", (1,)):
            stride *= int(s)
        return stride

    def output_lengths(self, input_lengths: torch.Tensor) -> torch.Tensor:
        """Number of logit frames for each input length in samples."""
        if not self.filterbank:
            return self.model._get_feat_extract_output_lengths(input_lengths)
        lengths = torch.as_tensor(input_lengths)
        frames = torch.tensor([self.feature_frames(int(n)) for n in lengths.reshape(-1).tolist()],
                              dtype=torch.long).reshape(lengths.shape)
        of_frames = (getattr(self.model, "_get_feat_extract_output_lengths", None)
                     or getattr(self.model, "_get_subsampling_output_length", None))
        return frames if of_frames is None else torch.as_tensor(of_frames(frames)).long()

    def feature_frames(self, samples: int) -> int:
        """Filterbank frames the processor makes of ``samples`` samples (a filterbank model);
        0 where it makes none, or none that is finite (SeamlessM4T normalises each bin by its
        sample std, which one frame does not have)."""
        if samples not in self._fbank_frames:
            try:
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    feats = self.filterbank_features(torch.ones(1, samples))
                n = int(feats.shape[1]) if bool(torch.isfinite(feats).all()) else 0
            except Exception:                 # shorter than one window: the fbank refuses
                n = 0
            if len(self._fbank_frames) > 4096:
                self._fbank_frames.clear()
            self._fbank_frames[samples] = n
        return self._fbank_frames[samples]

    # ------------------------------------------------------------------ decode
    def labels_to_text(self, labels: Sequence[int]) -> str:
        """Collapsed label ids -> text (special tokens dropped). A character vocabulary: the
        word delimiter becomes a space. A vocabulary of word pieces (no word delimiter among its
        tokens, e.g. SentencePiece's ``▁word`` of Parakeet CTC): the tokenizer's own
        decoder joins the pieces, without the CTC grouping its ``decode`` applies (the labels are
        collapsed already: a repeated piece here was two pieces)."""
        toks = [self.id_to_token.get(int(i), "") for i in labels
                if int(i) not in self.special_ids and int(i) != self.blank_id]
        if self.word_pieces:
            text = self.tokenizer.convert_tokens_to_string(toks) if toks else ""
        else:
            text = "".join(toks).replace(self.word_delimiter, " ")
        return " ".join(text.split())

    def alphabet(self) -> Optional[set]:
        """The characters this model can write, as the scoring normalises them
        (:func:`~tta_brain.asr.metrics.normalize_text`: upper case, letters, digits, ``'``): those
        of its tokens but the blank and the special ones. None (any character: no check) for a
        vocabulary with byte-fallback pieces (SentencePiece's ``<0xC3>``): it spells any
        character in bytes."""
        from tta_brain.asr.metrics import normalize_text
        chars = set()
        for i, tok in self.id_to_token.items():
            if re.fullmatch(r"<0x[0-9A-F]{2}>", tok, re.I):
                return None
            if i not in self.special_ids and i != self.blank_id:
                chars |= set(normalize_text(tok))
        return chars - {" "}

    def decode(self, logits: torch.Tensor) -> List[str]:
        """Greedy CTC decoding of ``[B, F, V]`` (or ``[F, V]``) logits to strings."""
        if logits.dim() == 2:
            logits = logits[None]
        return self.decode_labels(logits.argmax(-1).cpu())

    def decode_labels(self, labels: torch.Tensor) -> List[str]:
        """Greedy CTC decoding of frame labels ``[B, F]`` (or ``[F]``) already on the host (the
        argmax of the logits; the device path copies them with its step counters)."""
        if labels.dim() == 1:
            labels = labels[None]
        return [self.labels_to_text(collapse(p, self.blank_id)) for p in labels]

    def text_to_labels(self, text: str) -> List[int]:
        """Text -> label ids of the tokenizer (for pseudo-label checks and tests), in the case of
        the vocabulary's letters: upper, lower for one of mostly lower-case letters (MMS's)."""
        letters = [t for t in self.id_to_token.values() if len(t) == 1 and t.isalpha()]
        lower = sum(t.islower() for t in letters) > len(letters) / 2
        cased = text if self.word_pieces else text.lower() if lower else text.upper()
        return self.tokenizer(cased).input_ids
