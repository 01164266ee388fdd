"""Audio input/output with explicit, early failures.

``load_audio`` always returns a mono float32 tensor at the requested sample rate. Files that need a
conversion (several channels, another rate) are converted, and the conversion is logged once per
reason (once a process, or once a caller's ``warned`` set: a run's stream loader has its own, so
that every run's log says it) so that a corpus in an unexpected format is noticed without
flooding the log. Files that cannot serve as input (missing, unreadable, empty, non-finite
samples) raise :class:`AudioError`, which names the file and the reason, so that callers can skip
and record them.
"""
import logging
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from .cache import replaced_when_written

logger = logging.getLogger(__name__)

#: Subtype written for every file: 16-bit PCM, like the corpora this toolkit reads.
PCM_SUBTYPE = "PCM_16"
_FORMATS = {".wav": "WAV", ".flac": "FLAC"}
_warned = set()


class AudioError(ValueError):
    """An audio file that cannot be used as input; the message names the file and the reason."""


def _warn_once(reason, message, warned=None):
    """Log ``message`` as a warning the first time ``reason`` is seen in ``warned`` (a set; by
    default this process's)."""
    warned = _warned if warned is None else warned
    if reason not in warned:
        warned.add(reason)
        logger.warning("%s (reported once)", message)


def load_audio(path, sample_rate=16000, warned=None):
    """Read a wav/flac file as a 1-D float32 tensor ``[T]`` at ``sample_rate``.

    Several channels are averaged to mono; another sample rate is converted with
    ``torchaudio.functional.resample``. Raises :class:`AudioError` for a missing, unreadable or
    empty file and for NaN/inf samples. A conversion is logged once per reason in ``warned`` (a
    set of the caller's; by default once a process).
    """
    path = Path(path)
    if not path.exists():
        raise AudioError(f"{path}: file not found")
    if not path.is_file():
        raise AudioError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise AudioError(f"{path}: empty file (0 bytes)")
    try:
        data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as err:  # libsndfile raises LibsndfileError/RuntimeError subclasses
        raise AudioError(f"{path}: unreadable or corrupt audio file ({err})") from err
    if data.shape[0] == 0:
        raise AudioError(f"{path}: empty audio (0 samples)")
    if not np.isfinite(data).all():
        raise AudioError(f"{path}: audio contains NaN or infinite samples")
    if data.shape[1] > 1:
        _warn_once(("downmix", data.shape[1]),
                   f"{path}: {data.shape[1]} channels averaged to mono", warned)
        data = data.mean(axis=1, keepdims=True)
    wav = torch.from_numpy(np.ascontiguousarray(data[:, 0]))
    if file_rate != sample_rate:
        import torchaudio  # imported only when needed: it is slow to import

        _warn_once(("resample", file_rate, sample_rate),
                   f"{path}: resampled from {file_rate} Hz to {sample_rate} Hz", warned)
        wav = torchaudio.functional.resample(wav, file_rate, sample_rate)
    return wav.contiguous()


def write_audio(path, wav, sample_rate=16000):
    """Write a 1-D float signal (tensor or array, nominal range [-1, 1]) as 16-bit PCM.

    The container follows the extension (``.wav`` or ``.flac``); parent folders are created.
    Samples outside [-1, 1] are clipped (with a warning) instead of wrapping around in the
    integer conversion. The file is written under a temporary name and renamed, so an interrupted
    run never leaves a truncated file behind.
    """
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: unsupported audio extension (use one of {sorted(_FORMATS)})")
    if isinstance(wav, torch.Tensor):
        wav = wav.detach().cpu().numpy()
    data = np.asarray(wav, dtype=np.float32)
    if data.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D signal, got shape {data.shape}")
    if not np.isfinite(data).all():
        raise ValueError(f"{path}: refusing to write NaN or infinite samples")
    peak = float(np.abs(data).max()) if data.size else 0.0
    if peak > 1.0:
        _warn_once(("clip", str(path.parent)),
                   f"{path}: peak {peak:.3f} > 1, samples clipped to [-1, 1]")
        data = np.clip(data, -1.0, 1.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replaced_when_written(path, path.with_name(f".{path.stem}.tmp{path.suffix}")) as tmp:
        sf.write(str(tmp), data, sample_rate, subtype=PCM_SUBTYPE, format=fmt)

