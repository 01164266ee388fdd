"""Noise mixing at a given signal-to-noise ratio (pure numpy functions).

The LS-C recipe (after SGEM/SUTA, via MS-SNSD) mixes in two steps:

1. speech and noise are each scaled to an RMS level of -25 dBFS;
2. the noise is scaled so that ``10 * log10(P_speech / P_noise) == snr_db``, i.e. by the amplitude
   factor ``rms_speech / (rms_noise * 10 ** (snr_db / 20))``.

Difference from MS-SNSD's own ``audiolib.snr_mixer``: it takes the square root of the noise gain
(``noisescalar = sqrt(rms_clean / 10 ** (snr / 20) / rms_noise)``), so the achieved SNR in dB is
half of the requested one (5 dB asked, 2.5 dB obtained). The Dynamic-SUTA preprocessing uses the
gain without the square root, as here: the SNR measured on the written audio equals the requested
one.

Clipping guard: if the mixture's peak exceeds 1 (full scale), speech and noise are scaled
*together* by ``CLIP_HEADROOM / peak``. This changes the absolute level but keeps the SNR (the
models normalise each utterance, so the level itself does not matter). With -25 dBFS speech it
needs a noise of high crest factor at a low SNR, but two LS-C noises are such: Munching_3 and
CopyMachine_2 (peak/RMS about 35) exceed full scale at 5 dB in most utterances of MU and in some
of CM (a few samples each), and at 0 dB in most of both. The official preprocessing writes
``(x * 32767).astype(int16)`` without a guard, so there those samples wrap around (clicks).

Every function accepts array-likes (numpy arrays, CPU torch tensors, lists) and returns float32
numpy arrays; computations are done in float64.
"""
import zlib

import numpy as np

#: Target RMS level of speech and noise before the SNR scaling (MS-SNSD's convention).
TARGET_DBFS = -25.0
#: Peak level after the clipping guard.
CLIP_HEADROOM = 0.99


def _as_float64(x):
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D signal, got shape {arr.shape}")
    return arr


def rms(x):
    """Root mean square of a 1-D signal."""
    x = _as_float64(x)
    return float(np.sqrt(np.mean(x ** 2))) if x.size else 0.0


def rms_dbfs(x):
    """RMS level in dB relative to full scale (``20 * log10(rms)``); ``-inf`` for silence."""
    value = rms(x)
    return 20.0 * np.log10(value) if value > 0 else float("-inf")


def power_snr_db(speech, noise):
    """``10 * log10(P_speech / P_noise)`` of two aligned components (the SNR definition used)."""
    ps, pn = rms(speech) ** 2, rms(noise) ** 2
    if pn == 0:
        return float("inf")
    return 10.0 * np.log10(ps / pn)


def normalize_to_dbfs(x, target=TARGET_DBFS):
    """Scale ``x`` to an RMS level of ``target`` dBFS. Raises ``ValueError`` on a silent signal."""
    x = _as_float64(x)
    level = rms(x)
    if level == 0:
        raise ValueError("cannot normalise a silent (all-zero) signal")
    return (x * (10.0 ** (target / 20.0) / level)).astype(np.float32)


def tile_or_cut(noise, n):
    """Repeat ``noise`` from offset 0 as often as needed and cut it to exactly ``n`` samples."""
    noise = _as_float64(noise)
    if noise.size == 0:
        raise ValueError("cannot tile an empty noise signal")
    reps = -(-n // noise.size)  # ceil division
    return np.tile(noise, reps)[:n].astype(np.float32)


def gaussian_noise(n, seed):
    """``n`` samples of white Gaussian noise (unit variance) from a seeded generator."""
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def utterance_seed(seed, key):
    """A per-utterance seed from a base seed and a string key (stable across processes)."""
    return [int(seed), zlib.crc32(str(key).encode("utf-8"))]


def mix_at_snr(speech, noise, snr_db, target_dbfs=TARGET_DBFS, return_parts=False):
    """Add ``noise`` to ``speech`` at ``snr_db`` (true power ratio), see the module docstring.

    ``noise`` is tiled or cut to the speech length. Returns the mixture, or
    ``(mixture, speech_part, noise_part)`` with ``return_parts=True`` (the two scaled components
    whose sum is the mixture, after the clipping guard).
    """
    speech = normalize_to_dbfs(speech, target_dbfs).astype(np.float64)
    noise = normalize_to_dbfs(tile_or_cut(noise, speech.size), target_dbfs).astype(np.float64)
    noise *= rms(speech) / (rms(noise) * 10.0 ** (snr_db / 20.0))
    mixture = speech + noise
    peak = float(np.abs(mixture).max())
    if peak > 1.0:
        gain = CLIP_HEADROOM / peak
        speech, noise, mixture = speech * gain, noise * gain, mixture * gain
    if return_parts:
        return mixture.astype(np.float32), speech.astype(np.float32), noise.astype(np.float32)
    return mixture.astype(np.float32)
