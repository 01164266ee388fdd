"""Tiny fake corpora in the real directory layouts, built on the fly for tests.

- :func:`make_librispeech`: ``<root>/LibriSpeech/<split>/<spk>/<chapter>/*.flac`` + ``*.trans.txt``
- :func:`make_ms_snsd`: ``<root>/noise_test/<Name>.wav`` for the LS-C noise files
- :func:`write_stream`: a stream manifest of short utterances, two alternating domains
- :func:`make_chime3`: ``<root>/data/audio/16kHz/enhanced/et05_<split>/*.wav`` and
  ``<root>/data/transcriptions/et05_<split>/*.trn``

Speech is a sum of a few harmonics with a syllable-rate envelope; noises are coloured noise,
tones or clicks, kept short so that tiling is exercised. Everything is deterministic.
"""
import csv
from pathlib import Path

import numpy as np
import soundfile as sf

SR = 16000
WORDS = ("ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL")
LS_C_NOISE_FILES = ("AirConditioner_6", "AirportAnnouncements_2", "Babble_4", "CopyMachine_2",
                    "Munching_3", "Neighbor_6", "ShuttingDoor_6", "Typing_2", "VacuumCleaner_1")


def fake_speech(seconds, seed, sr=SR):
    """A speech-like signal: harmonics of a random pitch under a 4 Hz envelope, about -20 dBFS."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f0 = rng.uniform(100, 220)
    sig = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.28)) / k for k in range(1, 6))
    env = 0.5 * (1 + np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6.28)))
    sig = sig * env
    return (0.1 * sig / np.sqrt(np.mean(sig ** 2))).astype(np.float32)


def fake_noise(seconds, seed, kind=0, sr=SR):
    """Short noise of a few kinds: 0 white, 1 brown-ish, 2 tone + noise, 3 clicks."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    kind = kind % 4
    if kind == 0:
        sig = rng.standard_normal(n)
    elif kind == 1:
        sig = np.cumsum(rng.standard_normal(n))
        sig -= np.convolve(sig, np.ones(201) / 201, mode="same")
    elif kind == 2:
        sig = np.sin(2 * np.pi * 440 * np.arange(n) / sr) + 0.1 * rng.standard_normal(n)
    else:
        sig = 0.01 * rng.standard_normal(n)
        sig[rng.integers(0, n, size=max(1, n // 800))] = 1.0
    return (0.05 * sig / np.sqrt(np.mean(sig ** 2))).astype(np.float32)


def make_librispeech(root, split="test-other", speakers=(1688, 2609), chapters=(142285,),
                     utts=3, durations=(0.6, 1.2), seed=0):
    """Write a fake LibriSpeech split; returns ``{utterance id: (path, transcript)}``."""
    rng = np.random.default_rng(seed)
    out = {}
    for spk in speakers:
        for chap in chapters:
            folder = Path(root) / "LibriSpeech" / split / str(spk) / str(chap)
            folder.mkdir(parents=True, exist_ok=True)
            lines = []
            for i in range(utts):
                utt = f"{spk}-{chap}-{i:04d}"
                dur = float(rng.uniform(*durations))
                path = folder / f"{utt}.flac"
                sf.write(str(path), fake_speech(dur, seed=spk * 100 + i), SR,
                         subtype="PCM_16")
                text = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 6))))
                lines.append(f"{utt} {text}")
                out[utt] = (path, text)
            (folder / f"{spk}-{chap}.trans.txt").write_text("\n".join(lines) + "\n")
    return out


def make_ms_snsd(root, names=LS_C_NOISE_FILES, seconds=0.25, seed=1):
    """Write short noise files into ``<root>/noise_test``; returns the folder."""
    folder = Path(root) / "noise_test"
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        sf.write(str(folder / f"{name}.wav"), fake_noise(seconds, seed + i, kind=i), SR,
                 subtype="PCM_16")
    return folder


def make_chime3(root, splits=("bus_real", "bus_simu", "caf_real", "caf_simu", "ped_real",
                              "ped_simu", "str_real", "str_simu"), per_split=2, seed=2,
                transcripts="trn"):
    """Write a fake CHiME-3 et05 (enhanced audio + transcriptions); returns ``{ID: text}``.

    ``transcripts``: ``"trn"`` (per-utterance files) or ``"trn_all"`` (et05_real/simu.trn_all).
    Real and simulated splits share utterance names, as in the corpus. Simulated transcripts get
    a verbalised punctuation token (``.PERIOD``) that preparation removes.
    """
    rng = np.random.default_rng(seed)
    root = Path(root)
    out, pooled = {}, {"real": [], "simu": []}
    for split in splits:
        env, kind = split.split("_")
        audio = root / "data" / "audio" / "16kHz" / "enhanced" / f"et05_{split}"
        trans = root / "data" / "transcriptions" / f"et05_{split}"
        audio.mkdir(parents=True, exist_ok=True)
        for i in range(per_split):
            name = f"F0{5 + i % 2}_44{i}C020{i}_{env.upper()}"
            text = " ".join(rng.choice(WORDS, size=3))
            sf.write(str(audio / f"{name}.wav"), fake_speech(0.5, seed + i), SR, subtype="PCM_16")
            raw = f"{text} .PERIOD" if kind == "simu" else text
            if transcripts == "trn":
                trans.mkdir(parents=True, exist_ok=True)
                (trans / f"{name}.trn").write_text(f"{name} {raw}\n")
            else:
                pooled[kind].append(f"{name} {raw}")
            out[f"{name}_{kind.upper()}"] = text
    if transcripts == "trn_all":
        tdir = root / "data" / "transcriptions"
        tdir.mkdir(parents=True, exist_ok=True)
        for kind, lines in pooled.items():
            (tdir / f"et05_{kind}.trn_all").write_text("\n".join(lines) + "\n")
    return out


def estimate_snr_db(mixture, speech, noise):
    """SNR of a written mixture ``a * speech + b * noise``, with ``a, b`` fitted by least squares.

    Measures what is actually in the file (after scaling, clipping guard and 16-bit rounding)
    given the clean speech and the (tiled) noise that went into it.
    """
    mixture, speech, noise = (np.asarray(x, dtype=np.float64) for x in (mixture, speech, noise))
    basis = np.stack([speech, noise], axis=1)
    (a, b), *_ = np.linalg.lstsq(basis, mixture, rcond=None)
    return 10 * np.log10(np.sum((a * speech) ** 2) / np.sum((b * noise) ** 2))


def write_stream(root, n=20, block=7, seconds=(0.3, 0.5)):
    """``n`` short utterances in blocks of ``block`` alternating clean / noisy: ``root/wav/*.wav``
    and the stream manifest ``root/stream.csv`` (``$data_root`` = ``root``)."""
    root = Path(root)
    (root / "wav").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        seg = i // block
        sig = fake_speech(float(rng.uniform(*seconds)), seed=i)
        if seg % 2:
            sig = sig + 3 * fake_noise(len(sig) / 16000, seed=100 + i, kind=seg)
        sf.write(str(root / "wav" / f"u{i:03d}.wav"), sig, 16000, subtype="PCM_16")
        rows.append({"ID": f"u{i:03d}", "duration": f"{len(sig) / 16000:.3f}",
                     "wav": f"$data_root/wav/u{i:03d}.wav", "spk_id": "s",
                     "wrd": " ".join(rng.choice(WORDS[:5], size=2)), "domain": f"d{seg % 2}",
                     "segment": seg, "position": i})
    with open(root / "stream.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return root
