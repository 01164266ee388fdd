"""A self-contained synthetic benchmark: espeak-ng speech in LibriSpeech's layout + noises.

Three parts, all deterministic given a seed:

1. A text generator: a closed English vocabulary (no homophone pairs, so spelling is
   predictable from sound) and a small grammar producing sentences of 3-12 words.
   Train and test sentences are disjoint.
2. :func:`make_corpus` renders speech with :class:`~tta_brain.data.prep.tts.EspeakTTS` into
   ``root/LibriSpeech/<split>/<spk>/<chapter>/<spk>-<chapter>-<idx:04d>.flac`` with
   ``<spk>-<chapter>.trans.txt`` files, exactly as LibriSpeech does. A "speaker" is a
   (voice, base pitch, base rate) combination; the test split uses held-out voice variants.
3. :func:`make_noises` writes synthetic background noises (wav, 16 kHz) into an MS-SNSD-like
   folder; ``recipes/synthetic/conf/noises.yaml`` maps 2-letter domain codes to file names.

Command line (used by ``recipes/synthetic/run.sh`` stage 0)::

    python -m tta_brain.data.prep.synthetic corpus --root /data/synth --n_train 10000 --n_test 400
    python -m tta_brain.data.prep.synthetic noises --noise_dir /data/synth/noises
    python -m tta_brain.data.prep.synthetic long_test --root /data/synth/long --n_test 1000

``long_test`` renders the larger held-out split of the long streams (``test-synth-long``):
sentences disjoint from the training *and* the quick-start test sentences, new test speakers
(held-out voice variants, other pitches and rates).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List, Sequence

import numpy as np
import soundfile as sf

from .synthetic_noise import NOISE_FILES, make_noises, read_stamp  # noqa: F401  (re-exported)
from .synthetic_text import (VOCABULARY, SentenceGenerator, held_out_sentences,  # noqa: F401
                             make_sentence_sets)
from .tts import in_fresh_processes

SAMPLE_RATE = 16000
STAMP_NAME = ".synthetic_stamp.json"
CORPUS_VERSION = 1

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


def _render_many(jobs: List[Dict]) -> List[Dict]:
    from tta_brain.data.prep.progress import progress
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
    parts = in_fresh_processes(_render_many, [jobs[k::n_proc] for k in range(n_proc)])
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
    which utterances). Skips all work when the stamp file exists with the same options; else
    keeps each split whose own options (:func:`_split_options`) are unchanged, and a rendered
    training split when ``n_train`` is 0 (the recipe without ``--retrain``: test speech only;
    it deleted the training speech a later ``--retrain`` needs).
    Returns the stamp dict (options plus per-split statistics and speakers). Utterances whose
    3 candidate sentences all fall outside 1-5 s are dropped (rare), so counts can be slightly
    below the request.
    """
    options = dict(version=CORPUS_VERSION, n_train=n_train, n_test=n_test, seed=seed,
                   n_train_speakers=n_train_speakers, n_test_speakers=n_test_speakers,
                   train_split=train_split, test_split=test_split, num_workers=num_workers)
    base = os.path.join(root, "LibriSpeech")
    stamp_path = os.path.join(base, STAMP_NAME)
    old = read_stamp(stamp_path)
    if old.get("options") == options:
        return old
    old_options, old_stats = old.get("options") or {}, old.get("stats") or {}
    if n_train == 0 and train_split in old_stats and \
            _split_options({**old_options, "n_train": 0})[train_split] == \
            _split_options(options)[train_split]:
        options["n_train"] = n_train = old_options["n_train"]     # kept, not rendered again
    kept = {split for split, o in _split_options(options).items()
            if o == _split_options(old_options).get(split) and split in old_stats
            and os.path.isdir(os.path.join(base, split))}
    train_sent, test_sent = make_sentence_sets(3 * n_train, 3 * n_test, seed)
    train_spk = make_speakers(TRAIN_VARIANTS, n_train_speakers, seed, first_id=1000)
    test_spk = make_speakers(TEST_VARIANTS, n_test_speakers, seed + 1, first_id=9000)
    stats = {}
    for split, spks, sents, n, s in ((train_split, train_spk, train_sent, n_train, seed),
                                     (test_split, test_spk, test_sent, n_test, seed + 7919)):
        split_dir = os.path.join(base, split)
        if split in kept:
            print(f"{split_dir}: rendered with these options, kept")
            stats[split] = old_stats[split]
            continue
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


def _split_options(options: Dict) -> Dict[str, Dict]:
    """split -> the options its audio depends on: the test split's (sentences drawn first) not on
    ``n_train``, the training split's on ``n_test`` too."""
    common = ("version", "seed", "num_workers")
    test = {k: options.get(k) for k in common + ("n_test", "n_test_speakers")}
    train = {k: options.get(k) for k in common + ("n_train", "n_test", "n_train_speakers")}
    return {options.get("train_split"): train, options.get("test_split"): test}


def make_long_test(root: str, n_test: int = 1000, seed: int = 1, n_speakers: int = 40,
                   n_train_ref: int = 10000, n_test_ref: int = 400, num_workers: int = 2,
                   split: str = "test-synth-long") -> Dict:
    """Render the long streams' test split under ``root/LibriSpeech/<split>``.

    Held out like the quick-start test split: test voice variants only (speaker ids from 9500,
    pitches and rates drawn with another seed) and sentences that are in neither set of
    ``make_corpus(n_train=n_train_ref, n_test=n_test_ref, seed=seed)`` (the committed source
    model's training sentences and the quick-start test sentences). Skips all work when its stamp
    (``.<split>_stamp.json``) holds the same options; returns the stamp.
    """
    options = dict(version=CORPUS_VERSION, n_test=n_test, seed=seed, n_speakers=n_speakers,
                   n_train_ref=n_train_ref, n_test_ref=n_test_ref, split=split,
                   num_workers=num_workers)
    base = os.path.join(root, "LibriSpeech")
    stamp_path = os.path.join(base, f".{split}_stamp.json")
    stamp = read_stamp(stamp_path)
    if stamp.get("options") == options:
        return stamp
    split_dir = os.path.join(base, split)
    if os.path.isdir(split_dir):
        import shutil

        shutil.rmtree(split_dir)  # options changed: never mix two splits
    sentences = held_out_sentences(3 * n_test, seed, 3 * n_train_ref, 3 * n_test_ref)
    speakers = make_speakers(TEST_VARIANTS, n_speakers, seed + 2, first_id=9500)
    stats = _render_split(split_dir, speakers, sentences, n_test, seed + 104729, num_workers)
    stats["speakers"] = {str(p["spk"]): p for p in speakers}
    stamp = dict(options=options, stats={split: stats})
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=1)
    return stamp


# --------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tta_brain.data.prep.synthetic", description=__doc__,
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
    lt = sub.add_parser("long_test", help="render the long streams' held-out test split")
    lt.add_argument("--root", required=True)
    lt.add_argument("--n_test", type=int, default=1000)
    lt.add_argument("--n_speakers", type=int, default=40)
    lt.add_argument("--seed", type=int, default=1)
    lt.add_argument("--n_train_ref", type=int, default=10000,
                    help="training utterances of the source model (their sentences are excluded)")
    lt.add_argument("--n_test_ref", type=int, default=400,
                    help="quick-start test utterances (their sentences are excluded)")
    lt.add_argument("--num_workers", type=int, default=2)
    nz = sub.add_parser("noises", help="write the synthetic background noises")
    nz.add_argument("--noise_dir", required=True)
    nz.add_argument("--seed", type=int, default=1)
    nz.add_argument("--seconds", type=float, default=60.0)
    nz.add_argument("--sample_rate", type=int, default=SAMPLE_RATE)
    p.add_argument("--noprogressbar", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    lows = {"corpus": (("n_train", 0), ("n_test", 1), ("n_train_speakers", 1),
                       ("n_test_speakers", 1), ("num_workers", 1)),
            "long_test": (("n_test", 1), ("n_speakers", 1), ("n_train_ref", 0),
                          ("n_test_ref", 0), ("num_workers", 1)),
            "noises": (("sample_rate", 1), ("seed", 0))}[args.cmd]
    for name, low in lows:     # before anything is deleted: a new corpus replaces the old one
        if getattr(args, name) < low:
            p.error(f"{args.cmd} --{name} {getattr(args, name)}: must be an integer >= {low}")
    if args.cmd == "noises" and not args.seconds > 0:
        p.error(f"noises --seconds {args.seconds}: must be > 0")
    if args.noprogressbar:
        from tta_brain.data.prep.progress import disable_progressbars
        disable_progressbars()
    if args.cmd in ("corpus", "long_test"):
        if args.cmd == "corpus":
            stamp = make_corpus(args.root, args.n_train, args.n_test, args.seed,
                                args.n_train_speakers, args.n_test_speakers, args.num_workers)
        else:
            stamp = make_long_test(args.root, args.n_test, args.seed, args.n_speakers,
                                   args.n_train_ref, args.n_test_ref, args.num_workers)
        for split, st in stamp["stats"].items():
            print(f"{split}: {st['n_utts']} utterances, {st['hours']:.2f} h, "
                  f"{len(st['speakers'])} speakers")
    else:
        for code, path in make_noises(args.noise_dir, args.seed, args.sample_rate,
                                      args.seconds).items():
            print(f"{code}: {path}")


if __name__ == "__main__":
    main()

