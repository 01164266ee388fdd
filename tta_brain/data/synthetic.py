"""A self-contained synthetic benchmark: espeak-ng speech in LibriSpeech's layout + noises.

Three parts, all deterministic given a seed:

1. A text generator: a closed English vocabulary (no homophone pairs, so spelling is
   predictable from sound) and a small grammar producing sentences of 3-12 words.
   Train and test sentences are disjoint.
2. :func:`make_corpus` renders speech with :class:`~tta_brain.data.tts.EspeakTTS` into
   ``root/LibriSpeech/<split>/<spk>/<chapter>/<spk>-<chapter>-<idx:04d>.flac`` with
   ``<spk>-<chapter>.trans.txt`` files, exactly as LibriSpeech does. A "speaker" is a
   (voice, base pitch, base rate) combination; the test split uses held-out voice variants.
3. :func:`make_noises` writes synthetic background noises (wav, 16 kHz) into an MS-SNSD-like
   folder; ``recipes/synthetic/conf/noises.yaml`` maps 2-letter domain codes to file names.

Command line (used by ``recipes/synthetic/run.sh`` stage 0)::

    python -m tta_brain.data.synthetic corpus --root /data/synth --n_train 10000 --n_test 400
    python -m tta_brain.data.synthetic noises --noise_dir /data/synth/noises
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
from typing import Dict, List, Sequence, Tuple

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16000
STAMP_NAME = ".synthetic_stamp.json"
CORPUS_VERSION = 1
NOISES_VERSION = 1

# --------------------------------------------------------------------------------------------
# 1. Text
# --------------------------------------------------------------------------------------------
# Words are chosen so that no two words in the list sound alike (no to/two, sea/see, ...).
DETERMINERS = "the a this that every some my your his her our one no".split()
NAMES = """
anna peter maria john david sarah thomas emma james lucy oliver sophie daniel grace henry alice
martin laura simon helen robert julia george clara frank nina oscar ella victor rosa walter
linda arthur molly edward diana felix hannah
""".split()
NOUNS = """
man woman child boy girl teacher doctor farmer driver baker painter singer soldier student
king queen captain friend father mother brother sister uncle family neighbor stranger dog cat
horse bird fish rabbit mouse lion tiger monkey sheep goat duck chicken snake spider bear wolf
house garden kitchen window table chair bottle glass plate basket box bag letter book paper pencil
picture clock lamp mirror carpet blanket pillow bed door wall floor roof bridge river lake
mountain forest field village city street market shop school office church castle tower island
beach valley hill stone rock tree apple orange lemon banana bread cheese butter cake soup
coffee milk water sugar salt rice potato tomato carrot onion egg candle hammer knife spoon cup
ship boat train bus car truck bicycle engine wheel ticket money coin ring necklace hat coat
jacket shirt shoe glove umbrella camera radio phone computer guitar piano drum song story
secret message question answer problem idea dream plan game party dinner lunch breakfast
holiday winter summer autumn spring morning evening weather storm cloud wind snow moon star
planet ocean desert jungle farm barn fence gate path ladder rope bucket shovel garage
""".split()
ADJECTIVES = """
big small little tall short long old young happy sad angry quiet loud bright dark warm cold
hot cool soft hard heavy light fast slow clean dirty empty full rich poor strong gentle brave
clever kind friendly lazy busy careful famous strange simple beautiful ugly green yellow
purple orange white black brown golden silver wooden broken tiny huge wet dry fresh sweet
bitter sharp smooth rough narrow wide deep funny lucky hungry thirsty sleepy lonely proud
nervous calm wild
""".split()
VERBS_T = """
found lost took bought sold saw watched painted cleaned opened closed carried pushed pulled
dropped kicked threw caught fixed built broke cooked washed filled emptied moved hid liked
loved wanted needed visited called followed helped finished started remembered forgot
showed brought sent gave kept held touched dragged lifted wrapped packed counted checked
borrowed picked chose ordered answered
""".split()
VERBS_I = """
laughed smiled slept waited arrived left jumped danced sang shouted whispered listened
walked ran swam climbed fell stopped started worked played rested travelled cried returned
disappeared
""".split()
ADVERBS = """
quickly slowly quietly loudly happily sadly carefully suddenly early again today yesterday
tonight outside inside together alone always often never soon finally
""".split()
PREPOSITIONS = "in on under behind near beside across along inside over into from with without around".split()
NUMBERS = "three five six seven nine ten eleven twelve twenty hundred".split()
PLURALS = """
apples books cats dogs birds chairs cups letters boxes flowers stones trees cars boats
coins shoes tickets candles stories songs horses children friends windows bottles eggs
""".split()

VOCABULARY = sorted(
    set(DETERMINERS + NAMES + NOUNS + ADJECTIVES + VERBS_T + VERBS_I + ADVERBS + PREPOSITIONS
        + NUMBERS + PLURALS + "was very and said that".split())
)


class SentenceGenerator:
    """Seeded random sentences of 3-12 words from a small grammar over :data:`VOCABULARY`."""

    def __init__(self, seed: int = 0, min_words: int = 3, max_words: int = 12):
        self.rng = random.Random(seed)
        self.min_words, self.max_words = min_words, max_words

    def _np(self) -> List[str]:
        r = self.rng
        if r.random() < 0.25:
            return [r.choice(NAMES)]
        if r.random() < 0.12:
            return [r.choice(NUMBERS)] + ([r.choice(ADJECTIVES)] if r.random() < 0.3 else []) + [
                r.choice(PLURALS)
            ]
        words = [r.choice(DETERMINERS)]
        if r.random() < 0.45:
            words.append(r.choice(ADJECTIVES))
        return words + [r.choice(NOUNS)]

    def _pp(self) -> List[str]:
        return [self.rng.choice(PREPOSITIONS)] + self._np()

    def _clause(self) -> List[str]:
        r = self.rng
        kind = r.random()
        if kind < 0.5:  # subject transitive-verb object [pp] [adverb]
            words = self._np() + [r.choice(VERBS_T)] + self._np()
            if r.random() < 0.35:
                words += self._pp()
        elif kind < 0.8:  # subject intransitive-verb [adverb] [pp]
            words = self._np() + [r.choice(VERBS_I)]
            if r.random() < 0.5:
                words += self._pp()
        else:  # subject was [very] adjective
            words = self._np() + ["was"] + (["very"] if r.random() < 0.3 else []) + [
                r.choice(ADJECTIVES)
            ]
        if r.random() < 0.3:
            words.append(r.choice(ADVERBS))
        return words

    def sentence(self) -> str:
        """One sentence, lower case, words separated by single spaces."""
        r = self.rng
        while True:
            words = self._clause()
            roll = r.random()
            if roll < 0.12:
                words = [r.choice(NAMES), "said", "that"] + words
            elif roll < 0.24:
                words = words + ["and"] + self._clause()
            if self.min_words <= len(words) <= self.max_words:
                return " ".join(words)


def make_sentence_sets(n_train: int, n_test: int, seed: int) -> Tuple[List[str], List[str]]:
    """Disjoint lists of unique sentences (test first, so its set does not depend on n_train)."""
    gen = SentenceGenerator(seed)
    seen, test, train = set(), [], []
    for target, size in ((test, n_test), (train, n_train)):
        tries = 0
        while len(target) < size:
            s = gen.sentence()
            tries += 1
            if tries > 50 * size + 1000:
                raise RuntimeError("the grammar cannot produce enough distinct sentences")
            if s not in seen:
                seen.add(s)
                target.append(s)
    return train, test


# --------------------------------------------------------------------------------------------
# 2. Speakers and corpus
# --------------------------------------------------------------------------------------------
ACCENTS = ["en-us", "en", "en-gb-scotland", "en-gb-x-rp", "en-us-nyc", "en-gb-x-gbclan",
           "en-gb-x-gbcwmd", "en-029"]
TRAIN_VARIANTS = """
m1 m2 m4 m5 m6 m8 f1 f3 f5 klatt klatt2 klatt4 adam aunty benjamin boris david ed edward
grandpa ian john linda max michel norbert paul rob robert steph travis victor zac quincy
shelby Alex Annie Denis Lee Michael
""".split()
TEST_VARIANTS = "m3 m7 f2 f4 klatt3 Andy anika Gene iven mike2".split()


def make_speakers(variants: Sequence[str], n_speakers: int, seed: int, first_id: int) -> List[Dict]:
    """Speakers = (accent+variant voice, base pitch, base rate), drawn without repeating voices
    until every voice has been used once."""
    rng = random.Random(seed)
    voices = [f"{a}+{v}" for a in ACCENTS for v in variants]
    rng.shuffle(voices)
    speakers = []
    for i in range(n_speakers):
        speakers.append(
            dict(
                spk=first_id + i,
                chapter=100 + (first_id + i) * 7 % 900,
                voice=voices[i % len(voices)],
                pitch=rng.randint(25, 75),
                rate=rng.randint(135, 200),
                pitch_range=rng.randint(30, 80),
            )
        )
    return speakers


_TTS = None


def _worker_init():
    global _TTS
    import torch

    torch.set_num_threads(1)  # one process per core: avoid oversubscription in resampling
    from .tts import EspeakTTS

    _TTS = EspeakTTS(SAMPLE_RATE)


def _in_fresh_processes(fn, tasks: list) -> list:
    """Run ``fn`` on each task, each in a newly spawned process.

    espeak-ng keeps state from one utterance to the next (the output changes by a few samples),
    so audio is only reproducible when every process renders the same sequence of utterances
    from a fresh start: one spawned process per task, never a worker reused across tasks.
    """
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(tasks), maxtasksperchild=1) as pool:
        return pool.map(fn, tasks, chunksize=1)


def _render_many(jobs: List[Dict]) -> List[Dict]:
    from tta_brain.progress import progress
    _worker_init()
    worker = jobs[0]["worker"] if jobs else 0
    return [_render(j) for j in progress(jobs, desc=f"synthesis (worker {worker})",
                                        position=worker, leave=False)]


def _render(job: Dict) -> Dict:
    """Render one utterance: try candidate sentences until the audio is 1-5 s long."""
    rng = np.random.default_rng(job["seed"])
    spk = job["speaker"]
    for text in job["candidates"]:
        audio = _TTS.synthesize(
            text,
            voice=spk["voice"],
            rate=int(spk["rate"] + rng.integers(-10, 11)),
            pitch=int(np.clip(spk["pitch"] + rng.integers(-5, 6), 0, 100)),
            pitch_range=spk["pitch_range"],
            seed=job["seed"],
        )
        idx = np.nonzero(np.abs(audio) > 0.01)[0]
        if idx.size == 0:
            continue
        audio = audio[max(idx[0] - 160, 0): idx[-1] + 160]
        pad = rng.uniform(0.05, 0.3, size=2)
        audio = np.concatenate(
            [np.zeros(int(pad[0] * SAMPLE_RATE), np.float32), audio,
             np.zeros(int(pad[1] * SAMPLE_RATE), np.float32)]
        )
        if not 1.0 <= len(audio) / SAMPLE_RATE <= 5.0:
            continue
        audio = audio / (np.abs(audio).max() + 1e-9) * 0.9 * 10 ** (rng.uniform(-6, 0) / 20)
        audio = audio + rng.normal(0, 3e-4, size=audio.shape)  # dither: no digital silence
        os.makedirs(os.path.dirname(job["path"]), exist_ok=True)
        sf.write(job["path"], np.clip(audio, -1, 1).astype(np.float32), SAMPLE_RATE,
                 format="FLAC", subtype="PCM_16")
        return dict(utt=job["utt"], text=text, duration=len(audio) / SAMPLE_RATE)
    return dict(utt=job["utt"], text=None, duration=0.0)


def _render_split(split_dir: str, speakers: List[Dict], sentences: List[str], n_utts: int,
                  seed: int, num_workers: int) -> Dict:
    jobs, pos = [], 0
    n_spk = len(speakers)
    for i in range(n_utts):
        spk = speakers[i % n_spk]
        idx = i // n_spk
        cands = sentences[pos: pos + 3]  # consecutive sentences: each used at most once
        pos += 3
        utt = f"{spk['spk']}-{spk['chapter']}-{idx:04d}"
        path = os.path.join(split_dir, str(spk["spk"]), str(spk["chapter"]), utt + ".flac")
        jobs.append(dict(utt=utt, path=path, speaker=spk, candidates=cands, seed=seed * 1000003 + i))
    n_proc = max(1, min(num_workers, len(jobs)))
    for k, job in enumerate(jobs):
        job["worker"] = k % n_proc
    parts = _in_fresh_processes(_render_many, [jobs[k::n_proc] for k in range(n_proc)])
    results = [None] * len(jobs)
    for k, part in enumerate(parts):
        results[k::n_proc] = part
    by_chapter: Dict[str, List[str]] = {}
    n_ok, total = 0, 0.0
    for job, res in zip(jobs, results):
        if res["text"] is None:
            continue
        n_ok += 1
        total += res["duration"]
        spk = job["speaker"]
        key = os.path.join(split_dir, str(spk["spk"]), str(spk["chapter"]),
                           f"{spk['spk']}-{spk['chapter']}.trans.txt")
        by_chapter.setdefault(key, []).append(f"{res['utt']} {res['text'].upper()}")
    for key, lines in by_chapter.items():
        with open(key, "w") as f:
            f.write("\n".join(sorted(lines)) + "\n")
    return dict(n_utts=n_ok, hours=total / 3600.0)


def make_corpus(root: str, n_train: int = 10000, n_test: int = 400, seed: int = 1,
                n_train_speakers: int = 250, n_test_speakers: int = 20,
                num_workers: int = 2, train_split: str = "train-synth",
                test_split: str = "test-synth") -> Dict:
    """Render the synthetic corpus under ``root/LibriSpeech/{train_split,test_split}``.

    Deterministic given the options (``num_workers`` included: it fixes which process renders
    which utterances). Skips all work when the stamp file exists with the same options.
    Returns the stamp dict (options plus per-split statistics and speakers). Utterances whose
    3 candidate sentences all fall outside 1-5 s are dropped (rare), so counts can be slightly
    below the request.
    """
    options = dict(version=CORPUS_VERSION, n_train=n_train, n_test=n_test, seed=seed,
                   n_train_speakers=n_train_speakers, n_test_speakers=n_test_speakers,
                   train_split=train_split, test_split=test_split, num_workers=num_workers)
    base = os.path.join(root, "LibriSpeech")
    stamp_path = os.path.join(base, STAMP_NAME)
    if os.path.isfile(stamp_path):
        with open(stamp_path) as f:
            stamp = json.load(f)
        if stamp.get("options") == options:
            return stamp
    train_sent, test_sent = make_sentence_sets(3 * n_train, 3 * n_test, seed)
    train_spk = make_speakers(TRAIN_VARIANTS, n_train_speakers, seed, first_id=1000)
    test_spk = make_speakers(TEST_VARIANTS, n_test_speakers, seed + 1, first_id=9000)
    stats = {}
    for split, spks, sents, n, s in ((train_split, train_spk, train_sent, n_train, seed),
                                     (test_split, test_spk, test_sent, n_test, seed + 7919)):
        split_dir = os.path.join(base, split)
        if os.path.isdir(split_dir):
            import shutil

            shutil.rmtree(split_dir)  # options changed: never mix two corpora
        if n == 0:  # e.g. test speech only, for a recipe that uses the committed model
            continue
        stats[split] = _render_split(split_dir, spks, sents, n, s, num_workers)
        stats[split]["speakers"] = {str(p["spk"]): p for p in spks}
    stamp = dict(options=options, stats=stats)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=1)
    return stamp


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
    tracks = _in_fresh_processes(_babble_talkers, [(int(rng.integers(1 << 30)), n, sr)])[0]
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
    if os.path.isfile(stamp_path) and all(os.path.isfile(p) for p in paths.values()):
        with open(stamp_path) as f:
            if json.load(f).get("options") == options:
                return paths
    for i, (code, maker) in enumerate(_NOISE_MAKERS.items()):
        rng = np.random.default_rng([seed, i])
        sf.write(paths[code], _normalise(maker(rng, n, sample_rate)), sample_rate,
                 subtype="PCM_16")
    with open(stamp_path, "w") as f:
        json.dump(dict(options=options), f, indent=1)
    return paths


# --------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tta_brain.data.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="render LibriSpeech-layout speech with espeak-ng")
    c.add_argument("--root", required=True)
    c.add_argument("--n_train", type=int, default=10000)
    c.add_argument("--n_test", type=int, default=400)
    c.add_argument("--n_train_speakers", type=int, default=250)
    c.add_argument("--n_test_speakers", type=int, default=20)
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--num_workers", type=int, default=2)
    nz = sub.add_parser("noises", help="write the synthetic background noises")
    nz.add_argument("--noise_dir", required=True)
    nz.add_argument("--seed", type=int, default=1)
    nz.add_argument("--seconds", type=float, default=60.0)
    nz.add_argument("--sample_rate", type=int, default=SAMPLE_RATE)
    p.add_argument("--noprogressbar", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    if args.noprogressbar:
        from tta_brain.progress import disable_progressbars
        disable_progressbars()
    if args.cmd == "corpus":
        stamp = make_corpus(args.root, args.n_train, args.n_test, args.seed,
                            args.n_train_speakers, args.n_test_speakers, args.num_workers)
        for split, st in stamp["stats"].items():
            print(f"{split}: {st['n_utts']} utterances, {st['hours']:.2f} h, "
                  f"{len(st['speakers'])} speakers")
    else:
        for code, path in make_noises(args.noise_dir, args.seed, args.sample_rate,
                                      args.seconds).items():
            print(f"{code}: {path}")


if __name__ == "__main__":
    main()
