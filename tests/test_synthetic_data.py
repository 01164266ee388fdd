"""Tests of the synthetic benchmark data: espeak-ng TTS, LibriSpeech-layout corpus, noises."""

import glob
import json
import os

import numpy as np
import pytest
import soundfile as sf

from tta_brain.data.prep import synthetic, synthetic_noise
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


def test_tts_audio_has_the_loud_and_quiet_frames_of_speech(tts):
    """espeak hands the audio over in ~60 ms chunks of one reused buffer, each copied when it
    arrives: kept as views, every chunk shows the last buffer and the 50 ms loudness is flat."""
    audio = tts.synthesize("the cat slept. the old farmer carried a heavy basket across the "
                           "wooden bridge today", voice="en-us+m3")
    frames = audio[: len(audio) // 800 * 800].reshape(-1, 800)
    rms = np.sqrt(np.mean(frames ** 2, axis=1))
    assert len(rms) > 40
    assert rms.max() > 0.1                      # stressed vowels
    assert np.min(rms[1:-1]) < 0.02             # the pauses and closures between words
    assert rms.max() > 8 * np.min(rms[1:-1])


def test_tts_rate_voice_and_errors(tts):
    text = "every happy child danced quietly"
    slow = tts.synthesize(text, voice="en+f2", rate=120)
    fast = tts.synthesize(text, voice="en+f2", rate=240)
    assert len(slow) > 1.4 * len(fast)
    other = tts.synthesize(text, voice="en-gb-scotland+m1", rate=120)
    assert not np.array_equal(slow[: len(other)], other[: len(slow)])
    with pytest.raises(RuntimeError, match="unknown espeak-ng voice"):
        tts.synthesize(text, voice="no-such-voice")


def _median_f0(x):
    """Median autocorrelation pitch (Hz) of the loud 64 ms frames."""
    f0 = []
    for s in range(0, len(x) - 1024, 512):
        w = x[s: s + 1024]
        if np.sqrt(np.mean(w ** 2)) < 0.05:
            continue
        ac = np.correlate(w, w, "full")[1023:]
        lo, hi = SR // 400, SR // 60
        f0.append(SR / (lo + np.argmax(ac[lo:hi])))
    return np.median(f0)


def test_tts_pitch_and_output_sample_rate(tts):
    text = "every happy child danced quietly"
    low = tts.synthesize(text, voice="en-us+m3", pitch=20, pitch_range=0)
    high = tts.synthesize(text, voice="en-us+m3", pitch=80, pitch_range=0)
    assert _median_f0(high) > 1.6 * _median_f0(low)      # pitch is the base pitch, not the range
    # espeak renders at 22,050 Hz: the 16 kHz output is resampled, not relabelled
    assert tts.native_sample_rate == 22050
    at16 = tts.synthesize(text, voice="en-us+m3")
    tts.output_sample_rate = tts.native_sample_rate
    try:
        native = tts.synthesize(text, voice="en-us+m3")
    finally:
        tts.output_sample_rate = SR
    assert abs(len(native) / len(at16) - 22050 / SR) < 0.01


def _render_seeded(seed):
    return EspeakTTS().synthesize("every happy child danced quietly", voice="en+f2", seed=seed)


def test_tts_audio_is_fixed_by_its_seed():
    """Each fresh process renders the same audio for the same seed, other audio for another."""
    from tta_brain.data.prep.tts import in_fresh_processes
    a, b, c = in_fresh_processes(_render_seeded, [1, 1, 2])
    assert np.array_equal(a, b)
    assert not np.array_equal(a[: len(c)], c[: len(a)])


def _fresh_engine(rate):
    from tta_brain.data.prep import tts as tts_module
    inherited = tts_module._ENGINE_PID
    audio = EspeakTTS(rate).synthesize("every happy child danced quietly", voice="en+f2")
    return inherited, os.getpid(), len(audio)


def test_fresh_processes_are_spawned_and_render_at_the_engines_rate(tts):
    """Each task starts in a new interpreter, its own process (a forked child inherited the
    parent's engine, which this module holds); ``EspeakTTS(rate)`` renders at that rate."""
    from tta_brain.data.prep import tts as tts_module
    from tta_brain.data.prep.tts import in_fresh_processes
    assert tts_module._ENGINE_PID == os.getpid()
    (inh16, pid16, n16), (inh22, pid22, n22) = in_fresh_processes(_fresh_engine, [16000, 22050])
    assert inh16 is None and inh22 is None and len({pid16, pid22, os.getpid()}) == 3
    assert abs(n22 / n16 - 22050 / SR) < 0.01


def test_sentences_are_disjoint_seeded_and_in_vocabulary():
    train, test = synthetic.make_sentence_sets(300, 50, seed=3)
    assert len(set(train)) == 300 and len(set(test)) == 50
    assert not set(train) & set(test)
    assert synthetic.make_sentence_sets(300, 50, seed=3) == (train, test)
    assert synthetic.make_sentence_sets(300, 50, seed=4)[1] != test
    assert synthetic.make_sentence_sets(100, 50, seed=3)[1] == test     # not a function of n_train
    # the recipe's sizes (3 candidates per utterance), where the grammar repeats itself
    train, test = synthetic.make_sentence_sets(30000, 1200, seed=1)
    assert len(set(train)) == 30000 and len(set(test)) == 1200 and not set(train) & set(test)
    vocab = set(synthetic.VOCABULARY)
    lengths, used = set(), set()
    for s in train + test:
        words = s.split()
        assert 3 <= len(words) <= 12
        assert set(words) <= vocab
        lengths.add(len(words))
        used |= set(words)
    assert lengths == set(range(3, 13)) and used == vocab      # the whole grammar is used


def test_speakers_have_distinct_voices_and_split_ids():
    train = synthetic.make_speakers(synthetic.TRAIN_VARIANTS, 30, seed=1, first_id=1000)
    test = synthetic.make_speakers(synthetic.TEST_VARIANTS, 30, seed=2, first_id=9000)
    for spks, first in ((train, 1000), (test, 9000)):
        assert [p["spk"] for p in spks] == list(range(first, first + 30))
        assert len({p["voice"] for p in spks}) == 30
        assert len({(p["pitch"], p["rate"]) for p in spks}) > 20
    assert synthetic.make_speakers(synthetic.TRAIN_VARIANTS, 30, seed=1, first_id=1000) == train
    assert synthetic.make_speakers(synthetic.TRAIN_VARIANTS, 30, seed=3, first_id=1000) != train


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
        assert len(texts[split]) == len(lines)                     # each sentence said once
    assert not texts["train-synth"] & texts["test-synth"]
    # held-out voices: no test voice variant occurs in training
    variant = lambda p: p["voice"].split("+")[1]
    train_v = {variant(p) for p in stamp["stats"]["train-synth"]["speakers"].values()}
    test_v = {variant(p) for p in stamp["stats"]["test-synth"]["speakers"].values()}
    assert not train_v & test_v
    assert not set(stamp["stats"]["train-synth"]["speakers"]) & set(
        stamp["stats"]["test-synth"]["speakers"])                  # speaker ids name one speaker
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
    # more test utterances draw more test sentences: the training split (drawn after them) too
    train_flac = glob.glob(str(base / "train-synth" / "*" / "*" / "*.flac"))[0]
    mtime6 = os.path.getmtime(train_flac)
    synthetic.make_corpus(str(tmp_path), n_train=6, n_test=5, seed=2, n_train_speakers=2,
                          n_test_speakers=2, num_workers=1)
    assert not os.path.exists(train_flac) or os.path.getmtime(train_flac) != mtime6
    said = {split: {l.split(" ", 1)[1] for t in glob.glob(str(base / split / "*" / "*" / "*.txt"))
                    for l in open(t).read().splitlines()} for split in ("train-synth", "test-synth")}
    assert len(said["test-synth"]) >= 4 and not said["train-synth"] & said["test-synth"]
    synthetic.make_corpus(str(tmp_path), n_train=8, n_test=4, seed=2, n_train_speakers=2,
                          n_test_speakers=2, num_workers=1)
    flacs = glob.glob(str(base / "test-synth" / "*" / "*" / "*.flac"))
    mtime = os.path.getmtime(flacs[0])
    # a mistyped count (run.sh --n_test -3) is one line, and the rendered corpus stays
    with pytest.raises(SystemExit) as e:
        synthetic.main(["corpus", "--root", str(tmp_path), "--n_train", "8", "--n_test", "-3"])
    assert e.value.code == 2
    assert os.path.getmtime(flacs[0]) == mtime and len(glob.glob(os.path.join(
        str(tmp_path), "LibriSpeech", "test-synth", "*", "*", "*.flac"))) == stamp["stats"]["test-synth"]["n_utts"]


def _render_in_a_worker(jobs):
    synthetic._worker_init()
    return [synthetic._render(job) for job in jobs]


def test_an_utterance_is_its_first_candidate_of_1_to_5_seconds(tmp_path):
    from tta_brain.data.prep.tts import in_fresh_processes
    speaker = dict(voice="en-us+m1", rate=90, pitch=50, pitch_range=50)   # 80-100 words a minute
    too_short, ok = "no", "the cat slept"
    too_long = "the old farmer carried a heavy basket across the wooden bridge today"
    jobs = [dict(utt=f"1000-107-000{i}", path=str(tmp_path / f"{i}.flac"), speaker=speaker,
                 candidates=cands, seed=i) for i, cands in enumerate(
                     ([too_short, ok, too_long], [too_long]))]
    good, dropped = in_fresh_processes(_render_in_a_worker, [jobs])[0]
    assert good["utt"] == "1000-107-0000" and good["text"] == ok
    wav, sr = sf.read(jobs[0]["path"])
    assert sr == SR and good["duration"] == len(wav) / SR and 1.0 <= len(wav) / SR <= 5.0
    assert dropped == dict(utt="1000-107-0001", text=None, duration=0.0)
    assert not os.path.exists(jobs[1]["path"])


@pytest.mark.parametrize("argv,expected", [
    (["corpus", "--root", "r", "--n_test", "0"], "corpus --n_test 0: must be an integer >= 1"),
    (["corpus", "--root", "r", "--n_train", "-1"], "corpus --n_train -1: must be an integer >= 0"),
    (["long_test", "--root", "r", "--n_speakers", "0"], "long_test --n_speakers 0: must be"),
    (["noises", "--noise_dir", "n", "--seconds", "0"], "noises --seconds 0.0: must be > 0"),
    (["noises", "--noise_dir", "n", "--seed", "-1"], "noises --seed -1: must be an integer >= 0"),
    (["noises", "--noise_dir", "n", "--seconds", "nan"], "noises --seconds nan: must be > 0"),
    (["corpus", "--root", "r", "--n_train_speakers", "0"], "corpus --n_train_speakers 0: must be"),
    (["corpus", "--root", "r", "--n_test_speakers", "0"], "corpus --n_test_speakers 0: must be"),
    (["long_test", "--root", "r", "--n_test", "0"], "long_test --n_test 0: must be"),
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
                      (["streams", "--manifest", "m.csv", "--out", "o", "--max_duration", "nan"],
                       "streams --max_duration nan: must be a number of seconds >= 0"),
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
    # each file holds its own kind of noise (the domain codes name them)
    x = {code: sf.read(a[code])[0] for code in a}
    for code, sig in x.items():
        assert abs(np.abs(sig).max() - 0.8) < 1e-3, code                  # normalised, not clipped
    spec = {code: np.abs(np.fft.rfft(sig)) ** 2 for code, sig in x.items()}
    f = np.fft.rfftfreq(3 * SR, 1 / SR)
    peak = {code: f[20:][np.argmax(s[20:])] for code, s in spec.items()}   # above 6.7 Hz
    band = (f > 100) & (f < 7000)
    flatness = {code: np.exp(np.mean(np.log(s[band] + 1e-20))) / np.mean(s[band])
                for code, s in spec.items()}
    low = {code: s[f < 500].sum() / s.sum() for code, s in spec.items()}
    frames = {code: np.sqrt((sig.reshape(-1, 400) ** 2).mean(1)) for code, sig in x.items()}
    impulsive = {code: np.percentile(e, 99) / np.median(e) > 8 for code, e in frames.items()}
    assert flatness["GS"] > 0.5 > max(v for k, v in flatness.items() if k != "GS")    # white
    assert 48 < peak["AC"] < 52 and low["AC"] > 0.8                  # 50 Hz hum and fan rumble
    assert 880 < peak["VC"] < 920                                    # the motor's 900 Hz whine
    assert {k for k, v in impulsive.items() if v} == {"TP", "SD"}
    assert low["TP"] < 0.05 < 0.9 < low["SD"]                        # clicks high, slams low
    semitones = 12 * np.log2(peak["MU"] / 110.0 / np.arange(1, 4))  # a harmonic of a note of A
    assert flatness["MU"] < 1e-3 and np.abs(semitones - np.round(semitones)).min() < 0.05
    assert flatness["BA"] > 2 * flatness["TR"]       # voices vs. low-passed rumble and engines
    # another seed or length in the same folder is rendered anew (not the stamped old files)
    again = synthetic.make_noises(str(tmp_path / "a"), seed=6, seconds=3)
    assert all(np.array_equal(sf.read(again[k])[0], sf.read(c[k])[0]) for k in a)
    shorter = synthetic.make_noises(str(tmp_path / "a"), seed=6, seconds=2)
    assert all(len(sf.read(shorter[k])[0]) == 2 * SR for k in a)
    # another sample rate: the files are written at it, with its number of samples
    synthetic.main(["noises", "--noise_dir", str(tmp_path / "d"), "--seed", "5", "--seconds", "1",
                    "--sample_rate", "8000"])
    for code, name in synthetic.NOISE_FILES.items():
        sig, sr = sf.read(str(tmp_path / "d" / name))
        assert sr == 8000 and len(sig) == 8000, code


@pytest.mark.slow
def test_a_stamp_cut_short_is_rendered_again_not_a_traceback(tmp_path):
    """A run killed while it wrote a stamp (``json.dump`` into the stamp itself) left it cut
    short; every rerun was then a JSONDecodeError naming no file. Such a stamp stamps nothing:
    the noises and the corpus are rendered again, and stamped (the long test split reads its
    stamp with the same ``read_stamp``)."""
    noises = synthetic.make_noises(str(tmp_path / "n"), seed=5, seconds=0.5)
    corpus = synthetic.make_corpus(str(tmp_path), n_train=0, n_test=1, seed=2,
                                   n_train_speakers=1, n_test_speakers=1, num_workers=1)
    base = tmp_path / "LibriSpeech"
    stamps = [tmp_path / "n" / synthetic_noise.STAMP_NAME, base / synthetic.STAMP_NAME]
    for stamp in stamps:
        stamp.write_text(stamp.read_text()[:7])
    assert synthetic.make_noises(str(tmp_path / "n"), seed=5, seconds=0.5) == noises
    assert synthetic.make_corpus(str(tmp_path), n_train=0, n_test=1, seed=2, n_train_speakers=1,
                                 n_test_speakers=1, num_workers=1) == json.loads(json.dumps(corpus))
    for stamp in stamps:
        assert json.loads(stamp.read_text())["options"]


def test_corpus_command_renders_with_its_options_on_two_workers(tmp_path, capsys):
    synthetic.main(["corpus", "--root", str(tmp_path), "--n_train", "0", "--n_test", "4",
                    "--n_train_speakers", "3", "--n_test_speakers", "2", "--seed", "3",
                    "--num_workers", "2"])
    base = tmp_path / "LibriSpeech"
    stamp = json.loads((base / synthetic.STAMP_NAME).read_text())
    assert stamp["options"] == dict(version=synthetic.CORPUS_VERSION, n_train=0, n_test=4, seed=3,
                                    n_train_speakers=3, n_test_speakers=2, num_workers=2,
                                    train_split="train-synth", test_split="test-synth")
    st = stamp["stats"]["test-synth"]
    assert set(stamp["stats"]) == {"test-synth"} and sorted(st["speakers"]) == ["9000", "9001"]
    seconds = 0.0
    for trans in (base / "test-synth").rglob("*.trans.txt"):     # each transcript by its file
        for line in trans.read_text().splitlines():
            utt = line.split(" ", 1)[0]
            assert utt.startswith(trans.name[: -len(".trans.txt")] + "-")
            seconds += sf.info(str(trans.parent / f"{utt}.flac")).frames / SR
    assert st["n_utts"] == 4 == len(list((base / "test-synth").rglob("*.flac")))
    assert abs(st["hours"] * 3600 - seconds) < 1e-6
    assert "test-synth: 4 utterances" in capsys.readouterr().out


def test_noises_yaml_matches_the_generator():
    import yaml

    conf = os.path.join(os.path.dirname(__file__), "..", "recipes", "synthetic", "conf",
                        "noises.yaml")
    with open(conf) as f:
        mapping = yaml.safe_load(f)
    assert mapping == synthetic.NOISE_FILES
    assert all(len(code) == 2 and code.isupper() for code in mapping)
