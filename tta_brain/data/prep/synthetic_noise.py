"""The synthetic benchmark's background noises (wav, 16 kHz, MS-SNSD-like folder): white noise,
babble (espeak-ng voices never used in the corpus), air conditioner, typing, vacuum cleaner, door
slams, music and traffic. Deterministic given a seed; ``recipes/synthetic/conf/noises.yaml`` maps
2-letter domain codes to the file names."""

from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np
import soundfile as sf

from .synthetic_text import SentenceGenerator
from .tts import in_fresh_processes

SAMPLE_RATE = 16000
STAMP_NAME = ".synthetic_stamp.json"
NOISES_VERSION = 1

# --------------------------------------------------------------------------------------------
# 3. Noises
# --------------------------------------------------------------------------------------------
NOISE_FILES = {
    "GS": "white_gaussian.wav",
    "BA": "babble.wav",
    "AC": "air_conditioner.wav",
    "TP": "typing.wav",
    "VC": "vacuum_cleaner.wav",
    "SD": "door_slams.wav",
    "MU": "music.wav",
    "TR": "traffic.wav",
}


def _lowpass(x: np.ndarray, cutoff: float, sr: int) -> np.ndarray:
    """Zero-phase brick-wall-ish low-pass in the frequency domain."""
    spec = np.fft.rfft(x)
    f = np.fft.rfftfreq(len(x), 1.0 / sr)
    spec *= 1.0 / (1.0 + (f / cutoff) ** 4)
    return np.fft.irfft(spec, n=len(x))


def _bandpass(x: np.ndarray, lo: float, hi: float, sr: int) -> np.ndarray:
    spec = np.fft.rfft(x)
    f = np.fft.rfftfreq(len(x), 1.0 / sr)
    spec *= (1.0 / (1.0 + (f / hi) ** 4)) * (1.0 / (1.0 + (lo / np.maximum(f, 1e-3)) ** 4))
    return np.fft.irfft(spec, n=len(x))


def _normalise(x: np.ndarray, peak: float = 0.8) -> np.ndarray:
    x = x - x.mean()
    return (x / (np.abs(x).max() + 1e-9) * peak).astype(np.float32)


def _noise_white(rng, n, sr):
    return rng.normal(0, 1, n)


BABBLE_VOICES = ["en-us+Mario", "en+Hugo", "en-us+belinda", "en-gb-x-rp+caleb", "en+RicishayMax",
                 "en-us+kaukovalta"]  # voices never used in the corpus


def _babble_talkers(args) -> List[np.ndarray]:
    """One track per babble voice: random sentences separated by short pauses."""
    seed, n, sr = args
    from .tts import EspeakTTS

    tts = EspeakTTS(sr)
    rng = np.random.default_rng(seed)
    gen = SentenceGenerator(seed)
    tracks = []
    for v in BABBLE_VOICES:
        length, chunks = 0, []
        while length < n:
            a = tts.synthesize(gen.sentence(), v, int(rng.integers(140, 200)),
                               int(rng.integers(20, 80)), 60, seed=int(rng.integers(1 << 30)))
            a = a / (np.sqrt(np.mean(a ** 2)) + 1e-9)
            gap = np.zeros(int(rng.uniform(0.05, 0.4) * sr), np.float32)
            chunks += [a, gap]
            length += len(a) + len(gap)
        tracks.append(np.concatenate(chunks))
    return tracks


def _noise_babble(rng, n, sr):
    """Six talkers (TTS voices not used in the corpus) reading random sentences."""
    tracks = in_fresh_processes(_babble_talkers, [(int(rng.integers(1 << 30)), n, sr)])[0]
    out = np.zeros(n)
    for talker in tracks:
        start = int(rng.integers(0, len(talker) - n + 1))
        out += talker[start: start + n] * rng.uniform(0.6, 1.0)
    return out


def _noise_air_conditioner(rng, n, sr):
    """Mains hum (fundamental + harmonics) plus low-passed broadband fan noise."""
    t = np.arange(n) / sr
    f0 = 50.0 * rng.uniform(0.98, 1.02)
    hum = sum((0.5 / k) * np.sin(2 * np.pi * k * f0 * t + rng.uniform(0, 6.28)) for k in range(1, 8))
    fan = _lowpass(rng.normal(0, 1, n), 600.0, sr)
    fan /= np.std(fan) + 1e-9
    return 0.6 * hum / np.std(hum) + fan * (1 + 0.05 * np.sin(2 * np.pi * 0.3 * t))


def _noise_typing(rng, n, sr):
    """Keyboard clicks: short decaying high-frequency bursts at irregular intervals."""
    out = rng.normal(0, 0.01, n)
    pos = 0
    while True:
        pos += int(rng.exponential(0.12) * sr) + int(0.04 * sr)
        if pos >= n:
            break
        length = int(0.012 * sr)
        click = rng.normal(0, 1, length) * np.exp(-np.arange(length) / (0.002 * sr))
        click = _bandpass(np.pad(click, (0, 64)), 1500.0, 6000.0, sr)[:length]
        if rng.random() < 0.1:  # space bar: louder, duller
            click = _lowpass(np.pad(click, (0, 64)), 1500.0, sr)[:length] * 3
        end = min(n, pos + length)
        out[pos:end] += click[: end - pos] * rng.uniform(0.5, 1.5)
    return out


def _noise_vacuum(rng, n, sr):
    """Motor whine (high tone with slow wobble and harmonics) over strong airflow noise."""
    t = np.arange(n) / sr
    f = 900.0 * (1 + 0.01 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(f) / sr
    whine = sum((0.6 / k) * np.sin(k * phase) for k in range(1, 5))
    air = _bandpass(rng.normal(0, 1, n), 300.0, 5000.0, sr)
    air /= np.std(air) + 1e-9
    return 0.5 * whine / np.std(whine) + air


def _noise_door_slams(rng, n, sr):
    """Impulsive low thumps with a short room reverb tail, every 1.5-5 s, over faint room tone."""
    out = _lowpass(rng.normal(0, 0.02, n), 400.0, sr)
    pos = int(rng.uniform(0.2, 1.0) * sr)
    while pos < n:
        length = int(0.6 * sr)
        k = np.arange(length)
        thump = rng.normal(0, 1, length) * np.exp(-k / (0.08 * sr))
        thump = _lowpass(thump, 300.0 + 400.0 * rng.random(), sr)
        thump += 0.5 * np.sin(2 * np.pi * rng.uniform(60, 120) * k / sr) * np.exp(-k / (0.05 * sr))
        thump *= rng.uniform(0.5, 1.0) / (np.abs(thump).max() + 1e-9)
        end = min(n, pos + length)
        out[pos:end] += thump[: end - pos]
        pos += int(rng.uniform(1.5, 5.0) * sr)
    return out


def _noise_music(rng, n, sr):
    """Chord progression of harmonic tones with note envelopes, plus a bass line."""
    t_beat = 0.5
    roots = [0, 5, 7, 3, 8, 10]
    out = np.zeros(n)
    beat_len = int(t_beat * sr)
    k = np.arange(beat_len * 2)
    env = np.minimum(1, k / (0.01 * sr)) * np.exp(-k / (0.4 * sr))
    pos = 0
    while pos < n:
        root = 220.0 * 2 ** (roots[int(rng.integers(len(roots)))] / 12)
        chord = [root, root * 2 ** (4 / 12), root * 2 ** (7 / 12), root / 2]
        for _ in range(4):  # 4 beats per chord
            note = np.zeros(len(k))
            for i, f in enumerate(chord):
                for h in range(1, 4):
                    note += (0.5 ** h) * np.sin(2 * np.pi * f * h * k / sr + rng.uniform(0, 6.28))
            note *= env
            end = min(n, pos + len(k))
            out[pos:end] += note[: end - pos]
            pos += beat_len
            if pos >= n:
                break
    return out


def _noise_traffic(rng, n, sr):
    """Low-passed brown rumble plus passing vehicles (swelling, Doppler-ish band noise)."""
    brown = np.cumsum(rng.normal(0, 1, n))
    brown = _lowpass(brown - np.linspace(brown[0], brown[-1], n), 200.0, sr)
    brown /= np.std(brown) + 1e-9
    out = brown
    t = np.arange(n) / sr
    centre = rng.uniform(0, n / sr)
    while centre < n / sr + 5:
        width = rng.uniform(1.5, 4.0)
        swell = np.exp(-0.5 * ((t - centre) / (width / 2.5)) ** 2)
        car = _bandpass(rng.normal(0, 1, n), 80.0, rng.uniform(800.0, 2000.0), sr)
        out = out + 2.0 * rng.uniform(0.5, 1.5) * swell * car / (np.std(car) + 1e-9)
        centre += rng.uniform(2.0, 7.0)
    return out


_NOISE_MAKERS = {
    "GS": _noise_white,
    "BA": _noise_babble,
    "AC": _noise_air_conditioner,
    "TP": _noise_typing,
    "VC": _noise_vacuum,
    "SD": _noise_door_slams,
    "MU": _noise_music,
    "TR": _noise_traffic,
}


def read_stamp(path: str) -> Dict:
    """The stamp (a JSON object) at ``path``; ``{}`` where there is none or it cannot be read
    (cut short by a run killed while writing it: every rerun was a JSONDecodeError traceback,
    naming no file), so that the work it stamps is done again."""
    try:
        with open(path, encoding="utf-8") as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def make_noises(noise_dir: str, seed: int = 1, sample_rate: int = SAMPLE_RATE,
                seconds: float = 60.0) -> Dict[str, str]:
    """Write the synthetic noises as ``noise_dir/<file>.wav`` (float, mono) and return
    ``{domain_code: path}``. Deterministic given ``seed``; skipped when the stamp matches."""
    os.makedirs(noise_dir, exist_ok=True)
    n = int(seconds * sample_rate)
    options = dict(version=NOISES_VERSION, seed=seed, sample_rate=sample_rate, seconds=seconds,
                   files=NOISE_FILES)
    paths = {code: os.path.join(noise_dir, name) for code, name in NOISE_FILES.items()}
    stamp_path = os.path.join(noise_dir, STAMP_NAME)
    if all(os.path.isfile(p) for p in paths.values()) and \
            read_stamp(stamp_path).get("options") == options:
        return paths
    for i, (code, maker) in enumerate(_NOISE_MAKERS.items()):
        rng = np.random.default_rng([seed, i])
        sf.write(paths[code], _normalise(maker(rng, n, sample_rate)), sample_rate,
                 subtype="PCM_16")
    with open(stamp_path, "w") as f:
        json.dump(dict(options=options), f, indent=1)
    return paths


