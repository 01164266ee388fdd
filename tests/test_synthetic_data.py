"""Tests of the synthetic benchmark data: espeak-ng TTS, LibriSpeech-layout corpus, noises."""

import glob
import json
import os

import numpy as np
import pytest
import soundfile as sf

from tta_brain.data.prep import synthetic
from tta_brain.data.prep.tts import EspeakTTS

SR = 16000


@pytest.fixture(scope="module")
def tts():
    return EspeakTTS()


def test_tts_renders_speech_whose_length_follows_the_text(tts):
    short = tts.synthesize("the cat slept", voice="en-us+m3", rate=170, pitch=50, pitch_range=50)
    long = tts.synthesize("the old farmer carried a heavy basket across the wooden bridge today",
                          voice="en-us+m3", rate=170, pitch=50, pitch_range=50)
    assert short.dtype == np.float32 and short.ndim == 1
    assert 0.5 < len(short) / SR < 2.0
    assert 2.5 < len(long) / SR < 6.0
    assert len(long) > 2 * len(short)
    assert np.sqrt(np.mean(long ** 2)) > 0.02  # not silent
    assert np.abs(long).max() <= 1.1


def test_tts_rate_voice_and_errors(tts):
    text = "every happy child danced quietly"
    slow = tts.synthesize(text, voice="en+f2", rate=120)
    fast = tts.synthesize(text, voice="en+f2", rate=240)
    assert len(slow) > 1.4 * len(fast)
    other = tts.synthesize(text, voice="en-gb-scotland+m1", rate=120)
    assert not np.array_equal(slow[: len(other)], other[: len(slow)])
    with pytest.raises(RuntimeError, match="unknown espeak-ng voice"):
        tts.synthesize(text, voice="no-such-voice")


def test_sentences_are_disjoint_seeded_and_in_vocabulary():
    train, test = synthetic.make_sentence_sets(300, 50, seed=3)
    assert len(set(train)) == 300 and len(set(test)) == 50
    assert not set(train) & set(test)
    assert synthetic.make_sentence_sets(300, 50, seed=3) == (train, test)
    assert synthetic.make_sentence_sets(300, 50, seed=4)[1] != test
    # the recipe's sizes (3 candidates per utterance), where the grammar repeats itself
    train, test = synthetic.make_sentence_sets(30000, 1200, seed=1)
    assert len(set(train)) == 30000 and len(set(test)) == 1200 and not set(train) & set(test)
    vocab = set(synthetic.VOCABULARY)
    for s in train + test:
        words = s.split()
        assert 3 <= len(words) <= 12
        assert set(words) <= vocab


@pytest.mark.slow
def test_corpus_has_librispeech_layout(tmp_path):
    stamp = synthetic.make_corpus(str(tmp_path), n_train=8, n_test=4, seed=2,
                                  n_train_speakers=2, n_test_speakers=2, num_workers=1)
    base = tmp_path / "LibriSpeech"
    texts = {}
    for split, n in (("train-synth", 8), ("test-synth", 4)):
        trans = sorted(glob.glob(str(base / split / "*" / "*" / "*.trans.txt")))
        assert len(trans) == 2
        lines = [l.split(" ", 1) for t in trans for l in open(t).read().splitlines()]
        assert len(lines) == stamp["stats"][split]["n_utts"] >= n - 1
        for t in trans:
            spk, chapter = os.path.basename(t)[: -len(".trans.txt")].split("-")
            assert os.path.basename(os.path.dirname(t)) == chapter
            assert os.path.basename(os.path.dirname(os.path.dirname(t))) == spk
        for utt, text in lines:
            spk, chapter, idx = utt.split("-")
            assert len(idx) == 4 and text == text.upper() and text.strip() == text
            wav, sr = sf.read(str(base / split / spk / chapter / f"{utt}.flac"))
            assert sr == SR and wav.ndim == 1 and 1.0 <= len(wav) / SR <= 5.0
            assert np.abs(wav).max() > 0.05
        flacs = glob.glob(str(base / split / "*" / "*" / "*.flac"))
        assert len(flacs) == len(lines)
        texts[split] = {t for _, t in lines}
    assert not texts["train-synth"] & texts["test-synth"]
    # held-out voices: no test voice variant occurs in training
    variant = lambda p: p["voice"].split("+")[1]
    train_v = {variant(p) for p in stamp["stats"]["train-synth"]["speakers"].values()}
    test_v = {variant(p) for p in stamp["stats"]["test-synth"]["speakers"].values()}
    assert not train_v & test_v
    assert test_v <= set(synthetic.TEST_VARIANTS) and train_v <= set(synthetic.TRAIN_VARIANTS)
    assert not set(synthetic.TRAIN_VARIANTS) & set(synthetic.TEST_VARIANTS)
    # same options: skipped (files untouched); the stamp records the options
    mtime = os.path.getmtime(flacs[0])
    assert synthetic.make_corpus(str(tmp_path), n_train=8, n_test=4, seed=2, n_train_speakers=2,
                                 n_test_speakers=2, num_workers=1) == json.loads(
        json.dumps(stamp))
    assert os.path.getmtime(flacs[0]) == mtime
    # the recipe without --retrain asks for no training speech: both splits kept (the rendered
    # training speech was deleted, and the unchanged test split rendered again)
    train_flac = glob.glob(str(base / "train-synth" / "*" / "*" / "*.flac"))[0]
    mtimes = (os.path.getmtime(train_flac), mtime)
    again = synthetic.make_corpus(str(tmp_path), n_train=0, n_test=4, seed=2, n_train_speakers=2,
                                  n_test_speakers=2, num_workers=1)
    assert again == json.loads(json.dumps(stamp))              # it holds what was rendered
    assert (os.path.getmtime(train_flac), os.path.getmtime(flacs[0])) == mtimes
    # another number of training utterances: that split only (the test set does not depend on it)
    six = synthetic.make_corpus(str(tmp_path), n_train=6, n_test=4, seed=2, n_train_speakers=2,
                                n_test_speakers=2, num_workers=1)
    assert os.path.getmtime(flacs[0]) == mtime
    assert len(glob.glob(str(base / "train-synth" / "*" / "*" / "*.flac"))) == \
        six["stats"]["train-synth"]["n_utts"]          # none of the 8 left beside the new 6
    assert not os.path.exists(train_flac) or os.path.getmtime(train_flac) != mtimes[0]
    # a mistyped count (run.sh --n_test -3) is one line, and the rendered corpus stays
    with pytest.raises(SystemExit) as e:
        synthetic.main(["corpus", "--root", str(tmp_path), "--n_train", "8", "--n_test", "-3"])
    assert e.value.code == 2
    assert os.path.getmtime(flacs[0]) == mtime and len(glob.glob(os.path.join(
        str(tmp_path), "LibriSpeech", "test-synth", "*", "*", "*.flac"))) == stamp["stats"]["test-synth"]["n_utts"]


@pytest.mark.parametrize("argv,expected", [
    (["corpus", "--root", "r", "--n_test", "0"], "corpus --n_test 0: must be an integer >= 1"),
    (["corpus", "--root", "r", "--n_train", "-1"], "corpus --n_train -1: must be an integer >= 0"),
    (["long_test", "--root", "r", "--n_speakers", "0"], "long_test --n_speakers 0: must be"),
    (["noises", "--noise_dir", "n", "--seconds", "0"], "noises --seconds 0.0: must be > 0"),
    (["noises", "--noise_dir", "n", "--seed", "-1"], "noises --seed -1: must be an integer >= 0"),
])
def test_synthetic_counts_are_checked_before_anything_is_written(argv, expected, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        synthetic.main(argv)
    assert expected in capsys.readouterr().err and not os.listdir(tmp_path)


def test_a_negative_stream_or_noise_seed_is_one_line_before_anything_is_written(
        tmp_path, monkeypatch, capsys):
    """numpy's generators take no negative seed: ``prepare streams --seed -1`` ended in its bare
    'expected non-negative integer'."""
    from tta_brain.data.prep import prepare
    monkeypatch.chdir(tmp_path)
    for argv, why in ((["streams", "--manifest", "m.csv", "--out", "o", "--seed", "-1"],
                       "streams --seed -1: must be an integer >= 0"),
                      (["corrupt", "--manifest", "m.csv", "--out", "o", "--seed", "-1"],
                       "corrupt --seed -1: must be an integer >= 0"),
                      # every utterance left out: 'domain AC has 0 utterances'
                      (["streams", "--manifest", "m.csv", "--out", "o", "--max_duration", "-1"],
                       "streams --max_duration -1.0: must be a number of seconds >= 0"),
                      (["corrupt", "--manifest", "m.csv", "--out", "o", "--snrs", "5", "nan"],
                       "corrupt --snrs nan: must be a number of dB from -150 to 150")):
        with pytest.raises(SystemExit):
            prepare.main(argv)
        assert why in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def _band_profile(x):
    spec = np.abs(np.fft.rfft(x)) ** 2
    f = np.fft.rfftfreq(len(x), 1 / SR)
    edges = [0, 250, 500, 1000, 2000, 4000, 8001]
    e = np.array([spec[(f >= a) & (f < b)].sum() for a, b in zip(edges, edges[1:])])
    return 10 * np.log10(e / e.sum() + 1e-12)


@pytest.mark.slow
def test_noises_are_distinct_and_deterministic(tmp_path):
    a = synthetic.make_noises(str(tmp_path / "a"), seed=5, seconds=3)
    b = synthetic.make_noises(str(tmp_path / "b"), seed=5, seconds=3)
    c = synthetic.make_noises(str(tmp_path / "c"), seed=6, seconds=3)
    assert len(a) >= 8 and set(a) == set(synthetic.NOISE_FILES)
    profiles = {}
    for code in a:
        xa, sr = sf.read(a[code])
        xb, _ = sf.read(b[code])
        xc, _ = sf.read(c[code])
        assert sr == SR and len(xa) == 3 * SR and xa.ndim == 1
        assert np.array_equal(xa, xb), code
        assert not np.array_equal(xa, xc), code
        assert np.sqrt(np.mean(xa ** 2)) > 1e-3
        profiles[code] = _band_profile(xa)
    codes = sorted(profiles)
    for i, p in enumerate(codes):
        for q in codes[i + 1:]:
            # spectral shapes differ by several dB in at least one band, or the noise is
            # impulsive vs. stationary (door slams vs. air conditioner both live in the lows)
            assert np.abs(profiles[p] - profiles[q]).max() > 3.0, (p, q)


def test_noises_yaml_matches_the_generator():
    import yaml

    conf = os.path.join(os.path.dirname(__file__), "..", "recipes", "synthetic", "conf",
                        "noises.yaml")
    with open(conf) as f:
        mapping = yaml.safe_load(f)
    assert mapping == synthetic.NOISE_FILES
    assert all(len(code) == 2 and code.isupper() for code in mapping)
