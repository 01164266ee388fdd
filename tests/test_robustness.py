"""Bad input: each gives a clear message naming the file / key, or (audio inside a stream) is
skipped, listed in rejects.csv with the reason and counted in summary.json.

Also: stereo and non-16 kHz files are converted where they are read (and decoded), and a
configuration mistake on the command line ends in one ``ERROR:`` line, not a traceback.
"""
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile as sf
import torch

from fake_corpora import fake_speech
from tta_brain import decode, sweep
from tta_brain.run.cli import parse_arguments
from tta_brain.run.summary import read_summary
from tta_brain.data.audio import AudioError, load_audio
from tta_brain.methods import build_method

REPO = Path(__file__).resolve().parents[1]
SR = 16000
FAST = ["--steps=1", "--buffer_size=2", "--ckpt_every=0", "--noprogressbar"]



def speech(seconds=0.4, seed=0):
    return fake_speech(seconds, seed=seed)


def write_manifest(path, rows, columns=("ID", "duration", "wav", "spk_id", "wrd", "domain",
                                        "segment", "position")):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for i, r in enumerate(rows):
            w.writerow({"spk_id": "s", "domain": "d", "segment": 0, "position": i, **r})
    return path


def row(uid, wav, seconds, wrd="ALPHA BRAVO"):
    return {"ID": uid, "wav": str(wav), "duration": f"{seconds:.3f}", "wrd": wrd}


def dsuta_args(model, stream, out, *extra):
    return ["dsuta", f"--source={model}",
            f"--stream_csv={stream}", f"--output_folder={out}", *FAST, *extra]


# ----------------------------------------------------------------------------- audio in a stream
@pytest.fixture(scope="module")
def bad_stream(tmp_path_factory):
    """Good, convertible and broken files in one stream; ``expect``: ID -> reason substring."""
    d = tmp_path_factory.mktemp("bad")
    rows, expect = [], {}
    good = speech(0.4)

    def add(uid, path, seconds, reason=None, **kw):
        rows.append(row(uid, path, seconds, **kw))
        if reason:
            expect[uid] = reason

    sf.write(d / "good0.wav", good, SR, subtype="PCM_16")
    add("good0", d / "good0.wav", 0.4)
    add("missing", d / "missing.wav", 0.4, "missing.wav: file not found")
    (d / "zero.wav").write_bytes(b"")
    add("zero_bytes", d / "zero.wav", 0.4, "zero.wav: empty file (0 bytes)")
    sf.write(d / "nosamples.wav", np.zeros(0, np.float32), SR)
    add("no_samples", d / "nosamples.wav", 0.0, "nosamples.wav: empty audio (0 samples)")
    (d / "corrupt.wav").write_bytes(os.urandom(2000))
    add("corrupt", d / "corrupt.wav", 0.4, "corrupt.wav: unreadable or corrupt audio file")
    (d / "text.flac").write_text("not audio at all\n")
    add("not_audio", d / "text.flac", 0.4, "text.flac: unreadable or corrupt audio file")
    full = (d / "good0.wav").read_bytes()
    (d / "truncated.wav").write_bytes(full[:44 + (len(full) - 44) // 2])
    add("truncated", d / "truncated.wav", 0.4, "truncated.wav: 0.20 s of audio but the manifest "
        "says 0.40 s")
    (d / "adir.wav").mkdir()
    add("directory", d / "adir.wav", 0.4, "adir.wav: not a regular file")
    for kind, value in (("nan", np.nan), ("inf", np.inf)):
        bad = good.copy()
        bad[100] = value
        sf.write(d / f"{kind}.wav", bad, SR, subtype="FLOAT")
        add(kind, d / f"{kind}.wav", 0.4, f"{kind}.wav: audio contains NaN or infinite samples")
    add("empty_ref", d / "good0.wav", 0.4, "empty transcript (wrd)", wrd="")
    add("punct_ref", d / "good0.wav", 0.4, "empty transcript (wrd)", wrd=" ... ")
    add("too_long", d / "good0.wav", 25.0, "longer than max_duration (25 s > 20 s)")
    # just over the limit (said 20.0 s > 20.0 s), and audio longer than its manifest says
    add("just_over", d / "good0.wav", 20.04, "longer than max_duration (20.04 s > 20 s)")
    sf.write(d / "long.wav", np.tile(good, 53)[:21 * SR], SR, subtype="PCM_16")
    add("long_audio", d / "long.wav", 19.5, "long.wav: longer than max_duration (21 s > 20 s; "
        "the manifest says 19.5 s)")
    sf.write(d / "short.wav", good[:100], SR, subtype="PCM_16")
    add("too_short", d / "short.wav", 100 / SR, "short.wav: too short for the model (100 samples")
    # convertible: decoded, not rejected
    sf.write(d / "stereo.wav", np.stack([good, 0.5 * good], axis=1), SR, subtype="PCM_16")
    add("stereo", d / "stereo.wav", 0.4)
    sf.write(d / "rate8k.wav", speech(0.4, seed=1)[::2], 8000, subtype="PCM_16")
    add("rate8k", d / "rate8k.wav", 0.4)
    sf.write(d / "stereo44k.flac", np.stack([good, good], 1).repeat(3, 0)[: int(0.4 * 44100)],
             44100, subtype="PCM_16")
    add("stereo44k", d / "stereo44k.flac", 0.4)
    add("good1", d / "good0.wav", 0.4, wrd="charlie, delta!")
    return write_manifest(d / "stream.csv", rows), expect


@pytest.fixture(scope="module")
def bad_run(bad_stream, tiny_model_dir, tmp_path_factory):
    stream, expect = bad_stream
    out = tmp_path_factory.mktemp("bad_out") / "exp"
    summary = decode.main(dsuta_args(tiny_model_dir, stream, out, "--reset=dynamic",
                                     "--reset_K=4"))
    return out, summary, expect


def test_long_audio_without_a_duration_is_skipped_unread(tmp_path, monkeypatch):
    """A recording longer than max_duration whose manifest gives no duration (its own length,
    README) is skipped by its header, not read whole first: an hour at 48 kHz in stereo was 1.4 GB
    of float32 (a 20-minute one took 7 s and 2.3 GB to be skipped), and a long one an OOM kill."""
    from tta_brain.data import loader as loader_mod
    sf.write(tmp_path / "long.wav", np.zeros((21 * 48000, 2), np.int16), 48000, subtype="PCM_16")
    sf.write(tmp_path / "short.wav", speech(0.4), SR, subtype="PCM_16")
    rows = [row("long", tmp_path / "long.wav", 0), row("short", tmp_path / "short.wav", 0)]
    for r in rows:
        r["duration"] = ""
    read = []
    real = loader_mod.load_audio
    monkeypatch.setattr(loader_mod, "load_audio",
                        lambda p, sr, *w: read.append(p) or real(p, sr, *w))
    long, short = loader_mod.StreamLoader(rows, max_duration=20.0).iterate()
    assert long.wav is None and long.reason == (
        f"{tmp_path / 'long.wav'}: longer than max_duration (21 s > 20 s; the manifest gives no "
        f"duration)")
    assert short.reason is None and short.duration == pytest.approx(0.4)
    assert read == [str(tmp_path / "short.wav")]          # the long file was never read
    # no limit: read and decoded as any other
    assert loader_mod.StreamLoader(rows, max_duration=0).load(0).wav.numel() == 21 * SR


def test_the_loaders_checks_at_their_edges(tmp_path, monkeypatch):
    """Audio exactly max_duration long is decoded (only longer is skipped), a blank wav cell is
    an empty path, an unreadable duration cell a skip reason, and a file whose header gives no
    length is still measured once read."""
    from tta_brain.data import loader as loader_mod
    sf.write(tmp_path / "a.wav", speech(0.4), SR, subtype="PCM_16")
    rows = [row("at_limit", tmp_path / "a.wav", 0.4), row("blank", "  ", 0.4),
            row("bad_dur", tmp_path / "a.wav", 0.4)]
    rows[2]["duration"] = "0.4s"
    at, blank, bad = loader_mod.StreamLoader(rows, max_duration=0.4).iterate()
    assert at.reason is None and at.wav.numel() == int(0.4 * SR)
    assert blank.reason == "empty wav path" and bad.reason == "bad duration '0.4s'"
    monkeypatch.setattr(loader_mod, "_header_seconds", lambda path: None)
    rows[0]["duration"] = ""
    assert loader_mod.StreamLoader(rows, max_duration=0.3).load(0).reason == (
        f"{tmp_path / 'a.wav'}: longer than max_duration (0.4 s > 0.3 s; the manifest gives no "
        f"duration)")


def test_a_duration_is_a_mismatch_only_over_a_tenth_of_a_second_and_ten_percent(tmp_path):
    """README (stream manifest): a manifest duration more than 0.1 s and 10 % away from the
    audio's own length skips the row as a truncated or replaced file; within either it is read."""
    from tta_brain.data import loader as loader_mod
    sf.write(tmp_path / "a.wav", speech(0.4), SR, subtype="PCM_16")
    sf.write(tmp_path / "b.wav", speech(2.0), SR, subtype="PCM_16")
    rows = [row("short_in", tmp_path / "a.wav", 0.49),      # 0.09 s (22 %): kept
            row("short_out", tmp_path / "a.wav", 0.52),     # 0.12 s (23 %): skipped
            row("long_in", tmp_path / "b.wav", 2.15),       # 0.15 s (7 %): kept
            row("long_out", tmp_path / "b.wav", 2.3)]       # 0.3 s (13 %): skipped
    got = list(loader_mod.StreamLoader(rows, max_duration=0).iterate())
    assert [u.reason is None for u in got] == [True, False, True, False]
    assert got[1].reason == (f"{tmp_path / 'a.wav'}: 0.40 s of audio but the manifest says "
                             f"0.52 s (truncated or replaced file?)")
    assert got[3].reason.endswith("2.00 s of audio but the manifest says 2.30 s (truncated or "
                                  "replaced file?)")


def test_bad_audio_is_skipped_listed_and_counted(bad_run):
    out, summary, expect = bad_run
    rejects = {r["ID"]: r["reason"] for r in csv.DictReader(open(out / "rejects.csv"))}
    assert set(rejects) == set(expect)
    for uid, reason in expect.items():
        assert reason in rejects[uid], (uid, rejects[uid])
    assert summary.n_skipped == len(expect)
    assert json.loads((out / "summary.json").read_text())["n_skipped"] == len(expect)
    assert {s["ID"]: s["reason"] for s in summary.skipped} == rejects
    decoded = [r["ID"] for r in csv.DictReader(open(out / "transcripts.csv"))]
    assert decoded == ["good0", "stereo", "rate8k", "stereo44k", "good1"]
    assert summary.n_utts == 5 and summary.n_words == 10
    log = (out / "log.txt").read_text()
    for uid in expect:
        assert f"Skipping {uid} (position" in log
    assert f"{len(expect)} utterance(s) skipped, listed with the reasons in" in log


def test_a_model_of_another_sample_rate_gets_its_rate(tmp_path, monkeypatch):
    """A checkpoint whose processor takes 8 kHz audio, run through a yaml's
    ``HFCTCLobe(sample_rate: 8000)``: the stream's audio is resampled to the lobe's rate, not
    read at 16 kHz and fed to it as if it were 8 kHz. The packaged yamls refused such a model
    (the lobe's 16 kHz default); they take the processor's rate now."""
    from tta_brain.data import loader as loader_mod
    from tta_brain.data.manifest import write_manifest
    from tta_brain.lobes.testing import TINY, save_random_ctc_model
    model = save_random_ctc_model(str(tmp_path / "m8k"), 0, **TINY)
    cfg = Path(model) / "preprocessor_config.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), sampling_rate=8000)))
    (tmp_path / "src8k.yaml").write_text(
        "include: [run]\n"
        "model: !new:tta_brain.lobes.hf_ctc.HFCTCLobe\n"
        "    source: !ref <source>\n    device: !ref <device>\n    runtime: !ref <runtime>\n"
        "    sample_rate: 8000\n"
        "method: !apply:tta_brain.methods.build_method\n    name: source\n"
        "    model: !ref <model>\n")
    sf.write(tmp_path / "a.wav", speech(0.4), SR, subtype="PCM_16")
    stream = write_manifest(tmp_path / "s.csv", [row("a", tmp_path / "a.wav", 0.4)])
    rates = []
    real = loader_mod.load_audio
    monkeypatch.setattr(loader_mod, "load_audio",
                        lambda p, sr, *w: rates.append(sr) or real(p, sr, *w))
    summary = decode.main([str(tmp_path / "src8k.yaml"), f"--source={model}",
                           f"--stream_csv={stream}", f"--output_folder={tmp_path / 'out'}",
                           "--noprogressbar"])
    assert rates == [8000] and summary.n_utts == 1
    assert summary.audio_s == pytest.approx(0.4, abs=1e-3)     # its seconds at the lobe's rate
    # the packaged yamls take the processor's rate: the same stream, resampled to 8 kHz
    summary = decode.main(["source", f"--source={model}", f"--stream_csv={stream}",
                           f"--output_folder={tmp_path / 'packaged'}", "--noprogressbar"])
    assert rates == [8000, 8000] and summary.n_utts == 1
    assert "resampled from 16000 Hz to 8000 Hz" in (tmp_path / "packaged" / "log.txt").read_text()
    # a live stream of it takes its rate too: 16 kHz samples are resampled to 8 kHz, as the
    # loader resamples the file (mutation audit: a stream fixed at 16 kHz fed them as they were)
    from tta_brain.stream import TTAStream
    live = TTAStream.from_hparams("source", source=model)
    assert live.sample_rate == 8000
    assert live.transcribe(speech(0.4), sample_rate=SR) == \
        live.transcribe(load_audio(tmp_path / "a.wav", 8000))


def test_a_sample_rate_other_than_the_processors_is_refused(tmp_path):
    """``HFCTCLobe(sample_rate=...)``: the processor's rate is the model's; a yaml that names
    another is refused in one line (its audio would be resampled to a rate the model was not
    trained on), the same one is taken, none takes the processor's."""
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.lobes.testing import TINY, save_random_ctc_model
    model = save_random_ctc_model(str(tmp_path / "m8k"), 0, **TINY)
    cfg = Path(model) / "preprocessor_config.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), sampling_rate=8000)))
    assert HFCTCLobe(model).sample_rate == 8000
    assert HFCTCLobe(model, sample_rate=8000).sample_rate == 8000
    with pytest.raises(ValueError, match=r"the processor expects 8000 Hz audio, not 16000 "
                                         r"\(sample_rate: leave it out"):
        HFCTCLobe(model, sample_rate=16000)


def test_conversions_happen_on_read_and_are_logged(bad_run, bad_stream):
    out, _, _ = bad_run
    log = (out / "log.txt").read_text()
    assert "stereo.wav: 2 channels averaged to mono" in log
    assert "resampled from 8000 Hz to 16000 Hz" in log
    assert log.count("averaged to mono") == 1           # once a run, not once a file
    d = Path(bad_stream[0]).parent
    good = load_audio(d / "good0.wav")
    stereo = load_audio(d / "stereo.wav")
    assert stereo.shape == good.shape
    assert torch.allclose(stereo, 0.75 * good, atol=1e-4)
    r8 = load_audio(d / "rate8k.wav")
    assert r8.dtype == torch.float32 and r8.dim() == 1 and r8.numel() == 2 * int(0.2 * SR)
    assert load_audio(d / "stereo44k.flac").numel() == int(0.4 * SR)


def test_every_run_in_one_process_logs_the_conversions(bad_stream, tiny_model_dir, tmp_path):
    """Conversions were logged once a process: a second decode in a notebook, or a sweep's
    second run, had no "averaged to mono" / "resampled" line in its log.txt. Each run's log says
    them (a sweep's read-ahead thread, shared by its runs, writes to every run's log)."""
    stream, _ = bad_stream
    lines = ("stereo.wav: 2 channels averaged to mono", "resampled from 8000 Hz to 16000 Hz")
    out = tmp_path / "again"
    decode.main(["source", f"--source={tiny_model_dir}", f"--stream_csv={stream}",
                 f"--output_folder={out}", "--noprogressbar"])
    assert all(line in (out / "log.txt").read_text() for line in lines)
    a, b = tmp_path / "a", tmp_path / "b"
    run = ["suta", f"--source={tiny_model_dir}", f"--stream_csv={stream}", "--noprogressbar",
           "--steps=1"]
    assert sweep.main([*run, f"--output_folder={a}", "--", *run, f"--output_folder={b}",
                       "--lr=1e-3"]) == 0
    for folder in (a, b):
        log = (folder / "log.txt").read_text()
        assert all(log.count(line) == 1 for line in lines), folder


def test_a_stream_of_only_unreadable_audio_is_one_line_and_reruns_once_fixed(tmp_path,
                                                                            tiny_model_dir,
                                                                            capfd):
    """Every utterance skipped (a wrong --data_root): SpeechBrain's WER summary divided by zero
    (a traceback). Now one line naming the first reason and rejects.csv, no summary.json (the
    folder is not a finished run), and the rerun it asks for decodes once the audio is there.
    The line is in log.txt and printed once (it was logged on the console too)."""
    wavs = [tmp_path / "audio" / f"u{i}.wav" for i in range(2)]
    stream = write_manifest(tmp_path / "s.csv", [row(w.stem, w, 0.4) for w in wavs])
    out = tmp_path / "exp"
    capfd.readouterr()
    msg = _error(dsuta_args(tiny_model_dir, stream, out))
    printed = capfd.readouterr()
    assert "none of its 2 utterances" not in printed.out + printed.err   # only the SystemExit's
    assert (out / "log.txt").read_text().count(msg[len("ERROR: "):]) == 1
    assert msg == (f"ERROR: s: none of its 2 utterances was decoded (first: u0: {wavs[0]}: file "
                   f"not found); every reason is in {out / 'rejects.csv'}: fix what they name "
                   f"(audio, --data_root, the manifest), delete {out} (it holds no transcript) "
                   f"and rerun")
    assert not (out / "summary.json").exists()
    assert _error(dsuta_args(tiny_model_dir, stream, out)) == msg          # a resume: the same
    wavs[0].parent.mkdir()
    for w in wavs:
        sf.write(w, speech(0.4), SR, subtype="PCM_16")
    shutil.rmtree(out)
    summary = decode.main(dsuta_args(tiny_model_dir, stream, out))
    assert (summary.n_utts, summary.n_skipped) == (2, 0)


def test_references_in_another_script_are_scored_not_skipped(tmp_path, one_wav, tiny_model_dir):
    """A Cyrillic (or accented) reference normalised to nothing: every utterance was skipped as
    having no transcript, so a model of another language could not be evaluated at all."""
    rows = [row("a", one_wav, 0.4, "Привет, мир"), row("b", one_wav, 0.4, "L'été est là"),
            row("c", one_wav, 0.4, "日本語のテストです。")]
    summary = decode.main(dsuta_args(tiny_model_dir, write_manifest(tmp_path / "s.csv", rows),
                                     tmp_path / "exp"))
    assert (summary.n_utts, summary.n_skipped, summary.n_words) == (3, 0, 6)
    written = list(csv.DictReader(open(tmp_path / "exp" / "transcripts.csv")))
    refs, hyps = [r["ref"] for r in written], [r["hyp"] for r in written]
    assert refs == ["ПРИВЕТ МИР", "L'ÉTÉ EST LÀ", "日本語のテストです"]
    # a language written without spaces: its WER counts the sentence as one word; the summary
    # also has the CER (jiwer's, an independent implementation) over the same written text
    assert summary.cer == pytest.approx(100 * jiwer.cer(refs, hyps))
    assert read_summary(tmp_path / "exp").cer == pytest.approx(summary.cer)


def test_audio_shorter_than_a_train_mode_time_mask_is_skipped(tmp_path, one_wav):
    """AWMC adapts in train mode, where wav2vec2 draws SpecAugment time masks of
    ``mask_time_length`` frames: a 0.1 s utterance (4 frames, fewer than a mask) stopped the
    whole run with transformers' traceback, and a live stream's pass counts took the failed
    call. Now it is skipped with the reason; in eval mode it is decoded as before."""
    from conftest import save_ctc_model
    from tta_brain.stream import TTAStream
    model = save_ctc_model(tmp_path / "masked", mask_time_prob=0.05, mask_time_length=10)
    short = tmp_path / "short.wav"
    sf.write(short, speech(0.1), SR, subtype="PCM_16")
    stream = write_manifest(tmp_path / "s.csv", [row("a", one_wav, 0.4), row("b", short, 0.1),
                                                 row("c", one_wav, 0.4)])
    common = [f"--source={model}", f"--stream_csv={stream}", "--steps=1", "--noprogressbar"]
    summary = decode.main(["awmc", *common, f"--output_folder={tmp_path / 'awmc'}"])
    assert (summary.n_utts, summary.n_skipped) == (2, 1)
    assert summary.skipped[0]["ID"] == "b" and summary.skipped[0]["reason"] == (
        f"{short}: too short for the model (1600 samples give 4 output frames, fewer than the 10 "
        f"of one SpecAugment time mask, which the model draws in train mode)")
    summary = decode.main(["suta", *common, f"--output_folder={tmp_path / 'suta'}"])
    assert (summary.n_utts, summary.n_skipped) == (3, 0)
    live = TTAStream.from_hparams("awmc", source=model, overrides={"steps": 1})
    with pytest.raises(ValueError, match=re.escape("1600 samples at 16000 Hz are too short for "
                                                   "the model (1600 samples give 4 output")):
        live.transcribe(speech(0.1))
    assert live.position == 0 and not any(live.counts.values())


def test_load_audio_errors(tmp_path):
    (tmp_path / "zero.wav").write_bytes(b"")
    with pytest.raises(AudioError, match=r"zero\.wav: empty file \(0 bytes\)"):
        load_audio(tmp_path / "zero.wav")
    with pytest.raises(AudioError, match=r"nothere\.flac: file not found"):
        load_audio(tmp_path / "nothere.flac")


# ----------------------------------------------------------------------------- manifests
@pytest.fixture
def one_wav(tmp_path):
    sf.write(tmp_path / "a.wav", speech(0.4), SR, subtype="PCM_16")
    return tmp_path / "a.wav"


@pytest.mark.parametrize("drop", ["wrd", "wav", "ID", "duration"])
def test_manifest_missing_column(tmp_path, one_wav, tiny_model_dir, drop):
    cols = [c for c in ("ID", "duration", "wav", "spk_id", "wrd", "domain", "segment",
                        "position") if c != drop]
    stream = write_manifest(tmp_path / "s.csv", [row("a", one_wav, 0.4)], columns=cols)
    out = tmp_path / "exp"
    with pytest.raises(SystemExit) as e:
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    msg = str(e.value)
    assert msg.startswith("ERROR:") and "s.csv" in msg
    assert f"missing required column(s) {drop}" in msg and "--stream_csv" in msg
    assert not out.exists()        # checked before the experiment folder is made


def test_manifest_other_mistakes(tmp_path, one_wav, tiny_model_dir):
    out = tmp_path / "exp"
    with pytest.raises(SystemExit, match=r"ERROR: manifest not found: .*nope\.csv"):
        decode.main(dsuta_args(tiny_model_dir, tmp_path / "nope.csv", out))
    (tmp_path / "adir").mkdir()                          # was "manifest not found"
    with pytest.raises(SystemExit, match=r"adir: a directory, not a manifest \(a CSV file\)"):
        decode.main(dsuta_args(tiny_model_dir, tmp_path / "adir", out))
    rows = [row("a", one_wav, 0.4), row("b", one_wav, 0.4)]
    rows[1]["position"] = 5
    stream = write_manifest(tmp_path / "order.csv", rows)
    with pytest.raises(SystemExit, match=r"order\.csv:3: ID 'b' has position '5', its row's index is 1"):
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    rows = [row("a", one_wav, 0.4), {**row("b", one_wav, 0.4), "segment": "x"}]
    stream = write_manifest(tmp_path / "seg.csv", rows)          # was int()'s traceback
    with pytest.raises(SystemExit, match=r"seg\.csv:3: ID 'b' has segment 'x'; segments are "
                                         r"integers \(the domain block's index\) \(--stream_csv\)"):
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    # the same without a position column: was the traceback, and its fingerprint.json left
    # behind refused the rerun of the corrected manifest as a run with other settings
    stream = write_manifest(tmp_path / "seg2.csv", rows, columns=("ID", "duration", "wav",
                                                                   "wrd", "domain", "segment"))
    with pytest.raises(SystemExit, match=r"seg2\.csv:3: ID 'b' has segment 'x'; segments are "):
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    assert not out.exists()
    rows[1]["segment"] = 3
    stream = write_manifest(tmp_path / "seg3.csv", rows, columns=("ID", "duration", "wav",
                                                                   "wrd", "domain", "segment"))
    with pytest.raises(SystemExit, match=r"seg3\.csv:3: ID 'b' has segment 3 after 0; "):
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    stream = write_manifest(tmp_path / "root.csv", [row("a", "$data_root/a.wav", 0.4)])
    with pytest.raises(SystemExit, match=r"root\.csv:2: .*needs \$data_root.*--data_root"):
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    (tmp_path / "header.csv").write_text("ID,duration,wav,wrd\n")
    with pytest.raises(SystemExit, match=r"header\.csv: manifest has a header but no rows"):
        decode.main(dsuta_args(tiny_model_dir, tmp_path / "header.csv", out))
    stream = write_manifest(tmp_path / "dur.csv", [row("a", one_wav, 0.4) | {"duration": "x"}])
    with pytest.raises(SystemExit, match=r"dur\.csv:2: duration 'x' is not a number"):
        decode.main(dsuta_args(tiny_model_dir, stream, out))
    for bad in ("-0.4", "nan", "inf"):      # were accepted: -0.4 passed every length filter
        stream = write_manifest(tmp_path / "dur.csv", [row("a", one_wav, 0.4) | {"duration": bad}])
        with pytest.raises(SystemExit, match=rf"dur\.csv:2: duration {float(bad)!r} is not a "
                                             rf"length in seconds \(a number >= 0\)"):
            decode.main(dsuta_args(tiny_model_dir, stream, out))
    assert not out.exists()


# ----------------------------------------------------------------------------- configuration
@pytest.fixture
def ok_stream(tmp_path, one_wav):
    return write_manifest(tmp_path / "ok.csv", [row("a", one_wav, 0.4)])


def _error(argv):
    with pytest.raises(SystemExit) as e:
        decode.main(argv)
    msg = str(e.value)
    assert msg.startswith("ERROR:"), msg
    return msg


def test_flags_take_false_and_an_option_is_no_value_of_another():
    """``--noprogressbar=false`` / ``--overwrite=no`` mean what they say (a recipe passes its
    own switch as a value); ``--lr --steps=3`` is a missing value, not an lr of "--steps=3"."""
    from tta_brain.run.cli import UsageError
    args = parse_arguments(["a.yaml", "--noprogressbar=false", "--overwrite=no", "--compile=off"])
    assert (args.run_opts, args.overwrite, args.overrides) == (
        {"noprogressbar": False}, False, "compile: false\n")
    args = parse_arguments(["a.yaml", "--noprogressbar", "--overwrite", "--compile"])
    assert (args.run_opts, args.overwrite, args.overrides) == (
        {"noprogressbar": True}, True, "compile: true\n")
    home = os.path.expanduser("~")              # --key=~/x: the shell leaves the ~ as it is
    assert parse_arguments(["a.yaml", "--source_stats=~/s.pt", "--stream_name=~/s"]).overrides \
        == f'source_stats: "{home}/s.pt"\nstream_name: "~/s"\n'
    with pytest.raises(UsageError, match=r"^--lr needs a value \(--lr=<value>\)$"):
        parse_arguments(["a.yaml", "--lr", "--steps=3"])


def test_a_command_line_is_split_as_the_docstring_says():
    """``--key value`` is ``--key=value`` (a flag takes no value), ``-h`` is ``--help``, ``on`` is
    true as ``yes`` is, and a second positional, an option without a name or no method at all is
    a UsageError, not a run of something else (mutation audit)."""
    from tta_brain.run.cli import UsageError
    args = parse_arguments(["a.yaml", "--lr", "1e-4", "--noprogressbar", "--steps", "2",
                            "--compile=on"])
    assert (args.method, args.run_opts, args.overrides) == (
        "a.yaml", {"noprogressbar": True}, "lr: 1e-4\nsteps: 2\ncompile: true\n")
    assert parse_arguments(["a.yaml", "-h"]).help
    args = parse_arguments(["--help"])                 # decode --help: the packaged methods
    assert args.help and args.method is None
    for argv, expected in ((["a.yaml", "b.yaml"], "unexpected argument 'b.yaml'"),
                           (["a.yaml", "--=3"], "bad argument '--=3'"),
                           (["--lr=1"], "usage: python -m tta_brain.decode")):
        with pytest.raises(UsageError, match=re.escape(expected)):
            parse_arguments(argv)


def test_unknown_reset_method_and_override(tmp_path, ok_stream, tiny_model_dir):
    out = tmp_path / "exp"
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, out, "--reset=foo"))
    assert "dsuta.yaml" in msg and "reset = 'foo' is not valid" in msg and "dynamic" in msg
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, out, "--stepz=3"))
    assert "Override 'stepz' not found: --stepz is no key of this yaml (did you mean --steps? " \
        "python -m tta_brain.decode dsuta --help lists them)" in msg
    assert "__set_seed" not in msg                  # (hyperpyyaml's list named every key)
    # a reset option of an episodic method: why it has none, and which methods do
    msg = _error(["tent", f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
                  f"--output_folder={out}", "--reset_every=3"])
    assert "--reset_every is no key of this yaml (this yaml has no reset block (include: [run, reset]): " \
        "resets are for the continual methods, awmc, cotta, csuta, dsuta, eata, ebats, foa, sar, t3a; " in msg
    argv = dsuta_args(tiny_model_dir, ok_stream, out)
    argv[0] = "dsutaa"
    msg = _error(argv)
    assert "hparams file not found: dsutaa" in msg
    assert "awmc" in msg and "dsuta" in msg                  # lists the methods there
    with pytest.raises(ValueError, match="Unknown TTA method 'foo'. Valid: .*dsuta"):
        build_method("foo", model=None)
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, out, "--lr=[1"))
    assert "bad value for --lr" in msg
    args = parse_arguments(["a.yaml", "--steps=1", "--noprogressbar", "--lr=1", "--steps=2"])
    assert args.overrides == "steps: 2\nlr: 1\n"                  # later .opts files win
    assert args.run_opts == {"noprogressbar": True}
    msg = _error(["dsuta", f"--stream_csv={ok_stream}",
                  f"--output_folder={out}"])
    assert "dsuta.yaml: 'source' is required: pass --source=... (HF CTC checkpoint" in msg
    msg = _error(["foa", f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
                  f"--output_folder={out}"])     # the key's comment says how to make the file
    assert "foa.yaml: 'source_stats' is required: pass --source_stats=..." in msg
    assert "python -m tta_brain.stats --kinds hidden" in msg
    msg = _error(dsuta_args(tmp_path / "no_model", ok_stream, out))
    assert "source model directory not found" in msg and "no_model" in msg
    assert not out.exists()


def test_overrides_that_replace_objects_select_nothing_or_change_nothing(tmp_path, ok_stream,
                                                                         tiny_model_dir):
    """Probed: ``--adapt_params=[]`` was a traceback at the first step ('NoneType' object has no
    attribute 'zero_grad') with a run folder left behind; a text was read letter by letter
    ("Unknown parameter selector 'n'"); ``--method=foo`` a traceback opening the folder;
    ``--__set_seed=[1]`` replaced the yaml's seeding step (records said seed 0, the transcripts
    were another seed's, and a finished seed-0 folder was "the same settings"); ``--lm_weight``
    without an LM decoded exactly as without it, under another fingerprint. Each is one line
    naming the key now, before any folder."""
    out = tmp_path / "exp"
    for opt, want in (
            ("--adapt_params=[]", "adapt_params is empty: select at least one parameter group"),
            ("--adapt_params=[{param_collection: official}]", "adapt_params is empty"),
            ("--adapt_params=notalist", "adapt_params = 'notalist' is not a list of selector "
                                        "groups"),
            ("--adapt_params=5", "adapt_params = 5 is not a list"),
            ("--adapt_params=[layernrom]", "Unknown parameter selector 'layernrom'. Valid: "
                                           "layernorm,"),
            ("--adapt_params=['regex:(']", "Bad parameter selector 'regex:(': "),
            ("--adapt_params=[{select: layernorm, lr_mult: abc}]",
             "lr_mult 'abc' must be a number >= 0"),
            ("--adapt_params=[{select: layernorm, lr: 2}]", "a selector name or {select: "
                                                            "<selector>, lr_mult"),
            ("--adapt_params=[5]", "Bad adapt_params entry 5: a selector name"),
            ("--method=foo", "--method=foo: 'method' is an object the yaml builds"),
            ("--model=x", "--model=x: 'model' is an object the yaml builds"),
            ("--runtime=1", "--runtime=1: 'runtime' is an object the yaml builds"),
            ("--__set_seed=[1]", "--__set_seed: an internal key of")):
        msg = _error(dsuta_args(tiny_model_dir, ok_stream, out, opt))
        assert want in msg, (opt, msg)
        assert "\n" not in msg.strip()
    with pytest.raises(SystemExit, match="adapt_params is empty"):    # unbuilt: a grid's dry run
        decode.plan(dsuta_args(tiny_model_dir, ok_stream, out, "--adapt_params=[]"))
    sgem = ["sgem", f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
            f"--output_folder={out}", "--noprogressbar"]
    for opt in ("--lm_weight=2", "--word_bonus=0"):
        key = opt[2:].split("=")[0]
        assert f"{key} = {opt.split('=')[1]} (an override) without lm_path: it is only used " \
            f"with lm_path set" in _error(sgem + [opt])
    assert not out.exists()
    # what stays allowed: selector groups with multipliers
    decode.main(dsuta_args(tiny_model_dir, ok_stream, out,
                           "--adapt_params=[layernorm, {select: cnn, lr_mult: 2}]"))
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("opt,want", [
    ("--stage2_params=[]", "cea.yaml: stage2_params is empty: select at least one parameter "
                           "group"),
    ("--stage2_params=layernorm", "cea.yaml: stage2_params = 'layernorm' is not a list of "
                                  "selector groups"),
    ("--stage2_params=", "cea.yaml: stage2_params = None is not a list"),
    ("--stage2_params=[{select: layernorm, lr_mult: -1}]",
     "cea.yaml: Bad stage2_params entry {'select': 'layernorm', 'lr_mult': -1}: lr_mult -1 must "
     "be a number >= 0"),
    ("--stage2_params=[layernrom]", "cea.yaml: stage2_params: Unknown parameter selector "
                                    "'layernrom'"),
    ("--stage2_params=[layernorm, {param_collection: bad}]",
     "cea.yaml: Bad stage2_params entry {'param_collection': 'bad'}: use {param_collection: "),
    ("--stage2_params=[layernorm, {param_collection: clean}, {param_collection: clean}]",
     "cea.yaml: stage2_params sets param_collection 2 times"),
    # a plain value for the optimiser the yaml builds (!name:) was "'str' object is not callable
    # (check the spelling of the keys passed to that class)" once the model had loaded; an
    # empty one ran AdamW, eata's --eata_optimizer=sgd silently dropped
    ("--optimizer=sgd", "--optimizer=sgd: 'optimizer' is an object the yaml builds"),
    ("--optimizer=", "--optimizer=None: 'optimizer' is an object the yaml builds"),
])
def test_cea_stage2_params_and_the_optimizer_name_their_key(tmp_path, ok_stream, tiny_model_dir,
                                                            opt, want):
    """Probed: ``--stage2_params`` was not checked with the yaml: a bad one stopped the build,
    once the model had loaded, with the message of ``adapt_params`` (``--stage2_params=[]``:
    "adapt_params is empty", the key the user had not touched)."""
    out = tmp_path / "exp"
    cea = ["cea", f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
           f"--output_folder={out}", "--noprogressbar"]
    msg = _error(cea + [opt])
    assert want in msg and "\n" not in msg.strip(), msg
    assert "adapt_params" not in msg
    assert not out.exists()
    # what stays allowed: another optimiser the yaml builds, other arguments of its own
    assert decode.settings(cea + ["--optimizer=!name:torch.optim.SGD"])[1] is not None
    hp = decode.settings(cea + ["--optimizer={weight_decay: 0.1}"])[1]
    assert re.search(r"optimizer: (&\w+ )?!name:torch.optim.AdamW\n  weight_decay: 0.1\b", hp.text)


@pytest.mark.parametrize("opt,want", [
    ("--adapt_params={select: layernorm}", "dsuta.yaml: adapt_params = {'select': 'layernorm'} "
                                           "is not a list of selector groups"),
    ("--lr={a: 1}", "dsuta.yaml: lr = {'a': 1} is not valid: lr must be a number > 0"),
    ("--steps={}", "dsuta.yaml: steps = {} is not valid: steps must be an integer >= 0"),
])
def test_a_mapping_for_a_key_that_takes_none_names_the_key(tmp_path, ok_stream, tiny_model_dir,
                                                           opt, want):
    """Probed: ``--adapt_params={select: layernorm}`` (the list's brackets forgotten) was
    hyperpyyaml's "The structure of the overrides doesn't match the structure of the document"
    followed by every override of the command."""
    out = tmp_path / "exp"
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, out, opt))
    assert want in msg and "\n" not in msg.strip() and "structure" not in msg, msg
    assert str(ok_stream) not in msg                  # not every override listed
    assert not out.exists()


def test_a_mapping_for_an_own_key_that_takes_none_names_the_key(tmp_path):
    from tta_brain import hparams
    own = tmp_path / "mine.yaml"
    own.write_text(hparams.find("tent").read_text() + "groups: [1]\n")
    with pytest.raises(hparams.HparamsError, match=r"mine.yaml: --groups=\{'a': 1\}: groups takes "
                                                   r"no mapping"):
        hparams.resolve(own, "source: m\nstream_csv: s\noutput_folder: o\ngroups: {a: 1}\n")
    # a misspelt key given a mapping is still a key this yaml has not (not one taking none)
    with pytest.raises(hparams.HparamsError, match=r"Override 'adapt_parms' not found: "
                                                   r"--adapt_parms is no key of this yaml \(did "
                                                   r"you mean --adapt_params\?"):
        hparams.resolve(own, "source: m\nstream_csv: s\noutput_folder: o\n"
                             "adapt_parms: {select: cnn}\n")


def test_a_finished_run_asked_for_under_another_label_says_it_keeps_its_own(
        tmp_path, ok_stream, tiny_model_dir, capsys):
    """``--method_tag`` / ``--stream_name`` are labels, not settings: a finished run asked for
    under another one was "finished with the same settings, skipping", the label silently not
    applied. It is still skipped (its records are not rewritten), and now says so."""
    out = tmp_path / "exp"
    argv = dsuta_args(tiny_model_dir, ok_stream, out)
    decode.main(argv)
    capsys.readouterr()
    before = (out / "summary.json").read_bytes()
    decode.main(argv + ["--method_tag=renamed", "--stream_name=other"])
    said = capsys.readouterr().out
    assert said.strip().endswith("skipping; it stays labelled method 'dsuta' (not "
                                 "--method_tag=renamed) and stream 'ok' (not "
                                 "--stream_name=other): a finished run is not relabelled "
                                 "(--overwrite decodes it again)"), said
    assert (out / "summary.json").read_bytes() == before
    decode.main(argv + ["--method_tag=dsuta"])
    assert capsys.readouterr().out.strip().endswith("), skipping")
    # a new run takes them: its summary's method and stream (the reports' columns), not the
    # method's name and the manifest's file name (mutation audit: either dropped passed)
    new = decode.main(dsuta_args(tiny_model_dir, ok_stream, tmp_path / "new",
                                 "--method_tag=renamed", "--stream_name=other"))
    assert (new.method, new.stream) == ("renamed", "other")


def test_a_run_stopped_before_its_first_checkpoint_says_what_it_decodes_again(
        tmp_path, one_wav, tiny_model_dir):
    """Killed before its first checkpoint, a rerun started over, throwing its transcripts away,
    with only SpeechBrain's "Would load a checkpoint here, but none found yet" in the log."""
    stream = write_manifest(tmp_path / "s.csv", [row(f"u{i}", one_wav, 0.4) for i in range(3)])
    out = tmp_path / "exp"
    argv = dsuta_args(tiny_model_dir, stream, out)
    first = decode.main(argv)
    (out / "summary.json").unlink()                 # as if killed after its last transcript
    shutil.rmtree(out / "save", ignore_errors=True)
    again = decode.main(argv)
    assert f"{out}: no checkpoint yet (ckpt_every = 0: only the end of the stream is saved): " \
        f"the 3 utterance(s) decoded before it stopped are decoded again from the start" in \
        (out / "log.txt").read_text()
    assert again.wer == first.wer and again.n_utts == 3


def test_a_stream_whose_audio_changed_since_its_run_is_refused_saying_so(tmp_path, one_wav,
                                                                        tiny_model_dir):
    """The same manifest naming audio files mixed again (or replaced) since its finished run: the
    run is refused as one of other settings, and the difference says the audio files changed
    (the digests alone do not tell the user what to look at)."""
    stream = write_manifest(tmp_path / "s.csv", [row(f"u{i}", one_wav, 0.4) for i in range(2)])
    out = tmp_path / "exp"
    decode.main(dsuta_args(tiny_model_dir, stream, out))
    sf.write(one_wav, speech(0.4, seed=1), SR, subtype="PCM_16")        # mixed again
    msg = _error(dsuta_args(tiny_model_dir, stream, out))
    assert f"{out} holds a run with other settings (audio_sha1: " in msg and " != " in msg and \
        "(the audio files the stream names changed since that run: mixed again or replaced)" \
        in msg and "--overwrite" in msg, msg
    assert read_summary(out).n_utts == 2


def test_option_values_are_read_as_typed(tmp_path, ok_stream, tiny_model_dir):
    """Overrides become yaml lines: an output folder ``run #1`` was written to ``run`` (yaml read
    `` #1`` as a comment), a stream named ``2020`` was refused as no string (the grid names
    streams by their file), and ``--lr=1e-4 #x`` ran with 1e-4, silently."""
    import ruamel.yaml
    args = parse_arguments(["suta", "--output_folder=/x/run #1", "--stream_name=2020",
                            "--lr=1e-4 #x", "--steps=2", "--lm_path=", "--source_stats=null",
                            "--method_tag='q'", "--data_root=!ref <output_folder>"])
    got = dict(ruamel.yaml.YAML(typ="safe").load(args.overrides.replace("!ref ", "")))
    assert got == {"output_folder": "/x/run #1", "stream_name": "2020", "lr": "1e-4 #x",
                   "steps": 2, "lm_path": None, "source_stats": None, "method_tag": "q",
                   "data_root": "<output_folder>"}
    out = tmp_path / "exp" / "run #1"
    summary = decode.main(["source", f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
                           f"--output_folder={out}", "--stream_name=2020", "--noprogressbar"])
    assert (out / "summary.json").is_file() and summary.stream == "2020"
    assert [p.name for p in out.parent.iterdir()] == ["run #1"]
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, tmp_path / "x", "--lr=1e-4 #x"))
    assert "lr" in msg and "a number" in msg


@pytest.mark.parametrize("old,new,expected", [
    ("    buffer_size: !ref <buffer_size>", "    bufer_size: !ref <buffer_size>",
     "has no option(s) bufer_size; valid: adapt_params, buffer_size"),
    ("    name: dsuta", "    name: dsutaa", "Unknown TTA method 'dsutaa'"),
    ("!apply:tta_brain.methods.build_method", "!apply:tta_brain.methods.build_methd",
     "tta_brain.methods.build_methd"),
    ("steps: !ref <steps>", "steps: !ref <stepz>",
     "names no key of this yaml (no top-level 'stepz:'; did you mean steps?)"),
    ("steps: 10 ", "steps 10 ", "yaml syntax error"),
    ("    weight_decay: 0.0", "    weight_decay: abc",        # (the optimizer's)
     "a value of the wrong type among the arguments of a class"),   # was: check the spelling
])
def test_yaml_typos_name_the_file_and_key(tmp_path, ok_stream, tiny_model_dir, old, new, expected):
    text = (REPO / "tta_brain/hparams/dsuta.yaml").read_text()
    assert old in text
    bad = tmp_path / "typo.yaml"
    bad.write_text(text.replace(old, new, 1))
    argv = dsuta_args(tiny_model_dir, ok_stream, tmp_path / "exp")
    argv[0] = str(bad)
    msg = _error(argv)
    assert "typo.yaml" in msg and expected in msg, msg


def test_own_yaml_errors_name_its_lines_and_its_keys_win_over_its_blocks(tmp_path, ok_stream,
                                                                        tiny_model_dir):
    """A syntax error in one's own yaml was said at its line in the composed text (the blocks of
    its ``include`` in front: line 42 for line 3) with run.yaml's lines as its own; a key of an
    included block set in one's own yaml (``max_duration``) was a "duplicate key" there: the
    file's value wins, recorded with the run."""
    text = (REPO / "tta_brain/hparams/suta.yaml").read_text()
    lines = text.splitlines(keepends=True)
    n = next(i for i, x in enumerate(lines, 1) if x.startswith("steps: "))
    bad = tmp_path / "mine.yaml"
    bad.write_text(text.replace("steps: ", "steps:", 1))
    argv = dsuta_args(tiny_model_dir, ok_stream, tmp_path / "exp")
    argv[0] = str(bad)
    msg = _error(argv)
    assert f"yaml syntax error: while scanning a simple key at {bad}:{n}:" in msg, msg
    assert "run.yaml" not in msg and "\n" not in msg
    bad.write_text(text + "lr: 3e-5\n")                             # a key twice in one's file
    msg = _error(argv)
    assert 'found duplicate key "lr"' in msg and f"at {bad}:{len(lines) + 1}:" in msg, msg
    own = tmp_path / "own.yaml"
    own.write_text(text.replace("steps: ", "max_duration: 30.0\nsteps: ", 1))
    out = tmp_path / "own_exp"
    summary = decode.main([str(own), f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
                           f"--output_folder={out}", "--steps=1", "--noprogressbar"])
    assert summary.hparams["max_duration"] == 30.0
    hp = (out / "hyperparams.yaml").read_text()
    assert len(re.findall(r"^max_duration: 30\.0", hp, re.M)) == 1 and "max_duration: 20" not in hp


def test_an_own_yaml_without_a_seed_is_seeded_with_0(tmp_path, ok_stream, tiny_model_dir):
    """A yaml without ``seed`` (and so without run.yaml's seeding step) is seeded with 0, as
    its log says, not left with whatever the process's generators held."""
    from tta_brain import hparams as hp_files
    text = hp_files.compose(REPO / "tta_brain/hparams/suta.yaml")
    own = tmp_path / "unseeded.yaml"
    own.write_text("".join(x for x in text.splitlines(keepends=True)
                           if not x.startswith(("seed:", "__set_seed:"))))
    out = tmp_path / "exp"
    torch.manual_seed(123)
    decode.main([str(own), f"--source={tiny_model_dir}", f"--stream_csv={ok_stream}",
                 f"--output_folder={out}", "--steps=1", "--noprogressbar"])
    assert torch.initial_seed() == 0
    assert "unseeded.yaml has no 'seed'; seeded with 0" in (out / "log.txt").read_text()


def test_command_line_error_is_one_line_not_a_traceback(tmp_path, ok_stream, tiny_model_dir):
    res = subprocess.run([sys.executable, "-m", "tta_brain.decode",
                          *dsuta_args(tiny_model_dir, ok_stream, tmp_path / "exp", "--reset=foo")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert "ERROR: " in res.stderr and "reset = 'foo' is not valid" in res.stderr


# ----------------------------------------------------------------------------- the surface (#13)
@pytest.mark.parametrize("extra,expected", [
    (["--steps=-1"], "steps = -1 is not valid: steps must be an integer >= 0"),
    (["--lr=-0.1"], "lr = -0.1 is not valid: lr must be a number > 0"),
    (["--lr=abc"], "lr = 'abc' is not valid: lr must be a number > 0 (AdamW learning rate"),
    (["--steps=many"], "steps = 'many' is not valid: steps must be an integer"),
    (["--seed=abc"], "seed = 'abc' is not valid: seed must be an integer"),
    # SpeechBrain's seed_everything seeded 0 instead, with an INFO line: two seeds, one run
    (["--seed=-1"], "seed = -1 is not valid: seed must be an integer between 0 and 4294967295"),
    (["--seed=4294967296"], "seed = 4294967296 is not valid: seed must be an integer between 0"),
    (["--em_coef=2"], "em_coef must be a number between 0 and 1"),
    (["--precision=fp8"], "precision must be one of fp32, bf16, fp16"),
    (["--precision=fp16", "--device=cpu"], "precision = fp16 (--precision) needs a CUDA device"),
    (["--reset=dynamic", "--reset_K=4", "--buffer_size=3"],
     "reset_K = 4 with buffer_size = 3: phi_D is saved after K/2 = 2 utterances"),
    (["--reset=dynamic", "--reset_K=6", "--buffer_size=5"], "use reset_K >= 10"),
    (["--reset=dynamic", "--reset_K=4", "--buffer_size=1", "--reset_lii_count=official"],
     "reset_K = 4 with reset_lii_count = official is not valid"),
    (["--reset=sometimes"], "reset must be one of none, fixed, oracle, dynamic"),
    (["--reset_lii_count=half"], "reset_lii_count must be one of paper, official"),
    (["--reset_patience=0"], "reset_patience must be an integer >= 1"),
    (["--buffer_size=0"], "buffer_size must be an integer >= 1"),
    (["--slow_grad=sometimes"], "slow_grad must be one of reuse, recompute"),
    (["--fast_moments=warm"], "fast_moments must be one of slow, zero"),
    (["--device=cuda:7"] if torch.cuda.is_available() else ["--device=cuda:0"],
     "--device=cuda:"),
    (["--device=gpu"], "device = 'gpu' (--device) is not valid: use cpu, cuda or cuda:N"),
    (["--device="], "device = empty (--device) is not valid: use cpu, cuda or cuda:N"),
    (["--debug"], "--debug is a SpeechBrain training option; decoding does not use it"),
    (["--grad_accumulation_factor=2"], "--grad_accumulation_factor is a SpeechBrain training"),
    (["--compile=maybe"], "--compile takes true or false"),
    (["--cpu_native_backward=maybe"], "cpu_native_backward = 'maybe' is not valid: "
                                      "cpu_native_backward must be true or false"),
])
def test_bad_values_and_options_name_the_key(tmp_path, ok_stream, tiny_model_dir, extra, expected):
    out = tmp_path / "exp"
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, out, *extra))
    assert expected in msg and "\n" not in msg, msg
    assert not out.exists()                          # nothing written


def test_true_false_keys_read_yes_and_no_as_the_flags_do(tmp_path, ok_stream, tiny_model_dir):
    """``--compile=no`` (a run option) was taken and ``--cpu_native_backward=no`` (a yaml key:
    yaml 1.2 reads ``no`` as text) refused: every true/false key now reads them alike."""
    from tta_brain import decode
    for value, want in (("no", False), ("YES", True), ("off", False), ("1", True)):
        p = decode.plan(dsuta_args(tiny_model_dir, ok_stream, tmp_path / "x",
                                   f"--cpu_native_backward={value}", f"--compile={value}"))
        assert p.record["cpu_native_backward"] is want and p.record["compile"] is want, value


def test_a_cma_seed_numpy_cannot_take_is_one_line():
    """FOA / E-BATS draw from ``RandomState(cma_seed)``: a negative seed was numpy's traceback."""
    from tta_brain import hparams
    base = "source: m\nstream_csv: s.csv\noutput_folder: o\nsource_stats: s.pt\n"
    for method in ("foa", "ebats"):
        with pytest.raises(hparams.HparamsError, match=f"{method}.yaml: cma_seed = -1 is not "
                                                       f"valid: cma_seed must be an integer between"):
            hparams.resolve(method, base + "cma_seed: -1\n")
        assert hparams.resolve(method, base + "cma_seed: 4294967295\n").values["cma_seed"] > 0


def test_each_seed_is_its_own_cma_es_run(capsys):
    """FOA / E-BATS drew from a fixed cma_seed: every --seed of a grid was the same run, and the
    report showed their spread as 0.0 over n seeds. The reference's seed at seed 0, one more per
    seed; --cma_seed still sets it; --help shows the rule."""
    from tta_brain import hparams
    base = "source: m\nstream_csv: s.csv\noutput_folder: o\nsource_stats: s.pt\n"
    for method, start in (("ebats", 2024), ("foa", 2020)):
        seeds = [hparams.resolve(method, base + f"seed: {s}\n").values["cma_seed"] for s in (0, 3)]
        assert seeds == [start, start + 3]
        assert hparams.resolve(method, base + "seed: 3\ncma_seed: 7\n").values["cma_seed"] == 7
        decode.main([method, "--help"])
        assert re.search(rf"--cma_seed +\(<seed> \+ {start}\) % 4294967296 +CMA-ES seed",
                         capsys.readouterr().out)
        top = hparams.resolve(method, base + "seed: 4294967295\n").values["cma_seed"]
        assert top == start - 1                      # numpy's seeds end at 2^32 - 1


def test_output_folder_problems_are_one_line(tmp_path, ok_stream, tiny_model_dir, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, why in ((a_file, "it is a file"), (a_file / "sub", "Not a directory")):
        msg = _error(dsuta_args(tiny_model_dir, ok_stream, out))
        assert f"cannot write the output folder {out} (--output_folder): {why}" in msg, msg
    # a folder of another program's (a hyperparams.yaml, no fingerprint): replaced without a word
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "hyperparams.yaml").write_text("lr: 1.0  # my own\n")
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, mine))
    assert "no fingerprint recorded" in msg and "--overwrite" in msg, msg
    assert (mine / "hyperparams.yaml").read_text() == "lr: 1.0  # my own\n"
    # given empty (an unset shell variable) or null: the run wrote its records into a folder
    # named None in the working directory, then stopped with a TypeError traceback
    monkeypatch.chdir(tmp_path)
    for value in ("", "null", "~", '""'):
        argv = dsuta_args(tiny_model_dir, ok_stream, "x")
        argv[argv.index("--output_folder=x")] = f"--output_folder={value}"
        msg = _error(argv)
        assert "dsuta.yaml: 'output_folder' is required: pass --output_folder=... (experiment " \
            "folder: records, checkpoints, summary); it was given empty" in msg, msg
        msg = _error(dsuta_args(tiny_model_dir, ok_stream, tmp_path / "o", f"--source={value}"))
        assert "'source' is required: pass --source=... (HF CTC checkpoint" in msg, msg
    assert not (tmp_path / "None").exists() and not (tmp_path / "~").exists()


def test_a_folder_being_written_is_one_line_naming_its_holder(tmp_path, ok_stream, tiny_model_dir):
    """One writer per folder: a second writer (here this process, through its own descriptor,
    as a second process would hold it) stops at once with one line naming the holder, writes
    nothing and leaves the holder's lock its own."""
    out = tmp_path / "exp"
    held = decode.identity.FolderLock(out).acquire("the other writer")
    try:
        msg = _error(dsuta_args(tiny_model_dir, ok_stream, out))
        assert msg.startswith(f"ERROR: {out} is being written by pid {os.getpid()} ") and \
            "the other writer" in msg and "\n" not in msg, msg
        assert os.listdir(out) == [decode.identity.LOCK_FILE]
        assert decode.identity.FolderLock(out).busy().startswith(f"pid {os.getpid()} ")
    finally:
        held.release()
    decode.main(dsuta_args(tiny_model_dir, ok_stream, out))      # released: the run goes on
    assert (out / "summary.json").is_file()      # with the manifest it decoded (README's files)
    assert (out / "stream.csv").read_bytes() == Path(ok_stream).read_bytes()


@pytest.mark.parametrize("name", ["save/CKPT+old/stream.ckpt", "transcripts.csv", "env.log"])
def test_a_runs_files_without_its_fingerprint_are_refused(name, tmp_path, ok_stream,
                                                          tiny_model_dir):
    """A folder holding a run's records, checkpoint or environment but no fingerprint (another
    program's, an older tta_brain's) is refused, not decoded into."""
    mine = tmp_path / "mine"
    (mine / name).parent.mkdir(parents=True)
    (mine / name).write_text("mine\n")
    msg = _error(dsuta_args(tiny_model_dir, ok_stream, mine))
    assert "no fingerprint recorded" in msg and "--overwrite" in msg, msg
    assert (mine / name).read_text() == "mine\n" and os.listdir(mine) == [name.split("/")[0]]


def test_a_plan_made_before_another_run_took_its_folder_is_checked_again(tmp_path, ok_stream,
                                                                         tiny_model_dir):
    """``decode.prepare`` looks at the folder again once the lock is held (a sweep prepares runs
    planned before): a run that finished there meanwhile is skipped, one of other settings
    refused, not decoded over."""
    out = tmp_path / "exp"
    same = decode.plan(dsuta_args(tiny_model_dir, ok_stream, out))
    other = decode.plan(dsuta_args(tiny_model_dir, ok_stream, out, "--lr=0.5"))
    assert same.status == other.status == "new"
    decode.main(dsuta_args(tiny_model_dir, ok_stream, out))
    assert decode.prepare(same) == "done"
    with pytest.raises(SystemExit, match=r"^ERROR: .* holds a run with other settings \(.*lr"):
        decode.prepare(other)


def test_a_mistyped_local_source_names_the_directory(tmp_path, ok_stream, tiny_model_dir):
    typo = str(tiny_model_dir) + "x"
    msg = _error(["dsuta", f"--source={typo}", f"--stream_csv={ok_stream}",
                  f"--output_folder={tmp_path / 'exp'}", *FAST])
    assert f"source model directory not found: {typo}" in msg and "hub model" in msg
    assert not (tmp_path / "exp").exists()
    made = tmp_path / "made"          # a folder made for the run beforehand: kept
    made.mkdir()
    _error(["dsuta", f"--source={typo}", f"--stream_csv={ok_stream}", f"--output_folder={made}",
            *FAST])
    assert made.is_dir() and {p.name for p in made.iterdir()} <= {decode.identity.LOCK_FILE}


def test_a_mistyped_source_on_a_folder_of_another_run_is_said_missing(tmp_path, ok_stream,
                                                                       tiny_model_dir):
    """A mistyped ``--source`` path reads as a hub name: a folder's run of the real source looked
    like one of other settings, to ``--overwrite``; the path is said missing and the run kept. A
    grid planning for a Slurm node (``device_here=False``) leaves the source to the node."""
    out = tmp_path / "exp"
    decode.main(dsuta_args(tiny_model_dir, ok_stream, out))
    typo = str(tiny_model_dir) + "x"
    argv = dsuta_args(tiny_model_dir, ok_stream, out, f"--source={typo}")
    msg = _error(argv)
    assert f"source model directory not found: {typo}" in msg and "which is kept" in msg, msg
    assert "add --overwrite" not in msg and (out / "summary.json").is_file()
    assert decode.plan(argv, device_here=False).status == "differs"


def test_a_relative_source_path_in_missing_folders_is_said_missing(tmp_path, monkeypatch):
    """A relative ``--source`` with two slashes (``runs/ft/model``), or one under an existing
    folder, is a local path said missing, not a hub name said uncached; ``org/name`` is a hub
    name (mutation audit: a path of two slashes read as a hub name)."""
    from huggingface_hub import constants
    from tta_brain.lobes.hf_ctc import source_problem
    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")    # never resolves
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp").mkdir()
    for typo in ("runs/ft/model", "exp/model"):
        assert source_problem(typo).startswith(f"source model directory not found: {typo} ")
    assert "it is not in the local Hugging Face cache" in source_problem("org/not-cached")


@pytest.mark.parametrize("damage,expected", [
    # a missing file is named, without what transformers made of it (400 model types, protobuf)
    ("rm vocab.json", "its tokenizer (vocab.json, tokenizer_config.json): vocab.json missing in "
     "{src}. `source`"),
    ("rm preprocessor_config.json", "its feature extractor (preprocessor_config.json): "
                                    "preprocessor_config.json missing in"),
    ("rm config.json", "its model (config.json, the weights): config.json missing in {src}. `source`"),
    ("rm model.safetensors", "its model (config.json, the weights): OSError: "),
    ("cut model.safetensors", "its model (config.json, the weights): ValueError: cannot read "
     "the weights in {src}/model.safetensors (1000 bytes) (SafetensorError: "),   # (file unnamed)
    ("bad config.json", "its model (config.json, the weights): OSError: "),
    # a config of no CTC model: transformers lists ~400 model types; a few hundred characters kept
    ("bert config.json", "its model (config.json, the weights): ValueError: Unrecognized "
     "configuration class"),
    # transformers only warned, and the run decoded with a random output layer (WER ~100 %)
    ("nohead model.safetensors", "its model (config.json, the weights): ValueError: the "
     "checkpoint has no CTC output layer (lm_head.bias, lm_head.weight would be random): a "
     "pretrained-only model (e.g. facebook/wav2vec2-base) is no recogniser"),
])
def test_a_damaged_source_directory_is_one_line(tmp_path, ok_stream, tiny_model_dir, damage,
                                                expected):
    """A checkpoint folder with a file missing, cut short (a download that stopped) or malformed
    fails with one line naming the folder, the part and the file, never a traceback (a cut
    safetensors file raised safetensors' own error type; a missing vocab.json made transformers
    ask for protobuf)."""
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    verb, name = damage.split()
    if verb == "rm":
        (src / name).unlink()
    elif verb == "cut":
        (src / name).write_bytes((src / name).read_bytes()[:1000])
    elif verb == "nohead":                 # the encoder without its CTC head, as pretrained
        from transformers import AutoModelForCTC
        AutoModelForCTC.from_pretrained(src).base_model.save_pretrained(src)
    elif verb == "bert":
        from transformers import BertConfig
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                   intermediate_size=8).save_pretrained(src)
    else:
        (src / name).write_text("{")
    msg = _error(["dsuta", f"--source={src}", f"--stream_csv={ok_stream}",
                  f"--output_folder={tmp_path / 'exp'}", *FAST])
    assert len(msg) < 800, msg                  # was 5 KB with a BERT config
    assert f"Cannot load the CTC source model '{src}': " + expected.format(src=src) in msg, msg
    assert "`source` must be a local directory written by save_pretrained" in msg
    assert "\n" not in msg and not (tmp_path / "exp").exists()


def test_a_model_without_its_ctc_head_is_refused_alone(tmp_path, ok_stream, tiny_model_dir):
    """transformers' own warning about the missing head ("Some weights of Wav2Vec2ForCTC were
    not initialized ... You should probably TRAIN this model ...") came before the refusal; now
    the one ERROR line stands alone (a real process: pytest holds transformers' stream)."""
    from transformers import AutoModelForCTC
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    AutoModelForCTC.from_pretrained(src).base_model.save_pretrained(src)
    res = subprocess.run([sys.executable, "-m", "tta_brain.decode", "dsuta", f"--source={src}",
                          f"--stream_csv={ok_stream}", f"--output_folder={tmp_path / 'exp'}",
                          *FAST], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    said = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(said) == 1 and "the checkpoint has no CTC output layer" in said[0], res.stderr


def test_transformers_loading_warnings_of_a_model_it_takes_are_still_said(tmp_path,
                                                                         tiny_model_dir):
    """transformers' loading warnings are held while the lobe checks the head, and said once it
    takes the model: a checkpoint with weights the model does not use (another architecture's)
    is warned of, not loaded silently (mutation audit: the held records were dropped)."""
    import logging
    from safetensors.torch import load_file, save_file
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    weights = load_file(src / "model.safetensors")
    save_file(dict(weights, **{"extra.weight": torch.zeros(2)}), src / "model.safetensors",
              metadata={"format": "pt"})
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)    # it does not propagate to root
    try:
        HFCTCLobe(str(src))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [m for m in said if "were not used when initializing" in m and "extra.weight" in m]


def test_a_vocabulary_that_does_not_name_every_output_is_refused(tmp_path, ok_stream,
                                                                  tiny_model_dir):
    """vocab.json of another model (fewer tokens than the model's outputs): the frames of the
    unnamed ids vanished from every transcript (WER 98 % on the synthetic stream), silently."""
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    vocab = json.loads((src / "vocab.json").read_text())
    (src / "vocab.json").write_text(json.dumps({t: i for t, i in vocab.items() if i < 10}))
    msg = _error(["dsuta", f"--source={src}", f"--stream_csv={ok_stream}",
                  f"--output_folder={tmp_path / 'exp'}", *FAST])
    assert (f"{src}: the model outputs 32 classes but its tokenizer names only 10 of them (no "
            f"token for ids 10-31): vocab.json does not belong to this model") in msg, msg
    assert not (tmp_path / "exp").exists()


class _CountingHub:
    """A stand-in for the hub on a local port (``HF_ENDPOINT``): answers every request 404 and
    counts the connections, so a test sees whether anything asked the network."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.connections = 0
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")


def _hub_cache(root, model_dir, repo="org/tiny-ctc", commit="c0ffee" * 6 + "abcd", only=None):
    """``model_dir`` as hub model ``repo`` at ``commit`` in a Hugging Face cache under ``root``
    (its layout: models--org--name/{refs/main, snapshots/<commit>/...}); ``only``: those files."""
    snap = Path(root) / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if only is None or f.name in only:
            shutil.copy(f, snap / f.name)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(commit)
    return repo, commit


def _decode_with_hub(tmp_path, ok_stream, hub, repo, *extra):
    return subprocess.run(
        [sys.executable, "-m", "tta_brain.decode", "dsuta", f"--source={repo}",
         f"--stream_csv={ok_stream}", f"--output_folder={tmp_path / 'exp'}", *FAST, *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"),
             "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"})


def test_a_cached_hub_model_loads_without_the_network_and_its_commit_is_recorded(
        tmp_path, ok_stream, tiny_model_dir):
    """A hub name whose snapshot is in the local HF cache is loaded from there without one
    request (before, each file was asked for first: 2 min 47 s of retries a run on a machine
    without network), and the run's fingerprint and log name the commit it ran on."""
    hub = _CountingHub()
    repo, commit = _hub_cache(tmp_path / "hf", tiny_model_dir)
    res = _decode_with_hub(tmp_path, ok_stream, hub, repo)
    assert res.returncode == 0, res.stderr[-2000:]
    assert hub.connections == 0
    fp = json.loads((tmp_path / "exp" / "fingerprint.json").read_text())
    assert fp["hparams"]["source"] == f"hub:{repo}@{commit}"
    log = (tmp_path / "exp" / "log.txt").read_text()
    assert f"Source model: hub:{repo}@{commit}" in log
    # logged while the model was built, before log.txt existed: it used to reach no file
    line = f"{repo}: loaded from the local Hugging Face cache (commit {commit})"
    assert log.count(line) == 1 and (res.stdout + res.stderr).count(line) == 1


def test_an_mms_adapter_that_the_cached_snapshot_lacks_is_asked_of_the_hub(tmp_path, ok_stream):
    """A hub cache holds the files fetched so far: an MMS snapshot without the language's
    adapter (``adapter.fra.safetensors``) asks the hub for it, not refused as a language the
    checkpoint has no adapter for (that is said of a local folder, which holds all its files)."""
    from tta_brain.lobes.testing import save_random_mms_model
    mms = save_random_mms_model(str(tmp_path / "mms"))
    hub = _CountingHub()
    repo, _ = _hub_cache(tmp_path / "hf", mms, repo="org/mms-tiny",
                         only={f for f in os.listdir(mms) if f != "adapter.fra.safetensors"})
    res = _decode_with_hub(tmp_path, ok_stream, hub, repo, "--target_lang=fra")
    assert res.returncode != 0 and hub.connections > 0
    assert "adapter.fra.safetensors" in res.stderr and "has no adapter" not in res.stderr, \
        res.stderr[-2000:]


def _cached_mms(tmp_path, repo="org/mms-tiny", **kw):
    """A tiny MMS checkpoint (``save_random_mms_model(**kw)``) as hub model ``repo`` in a HF
    cache; (its ``cache_dir``, the snapshot folder)."""
    from tta_brain.lobes.testing import save_random_mms_model
    mms = save_random_mms_model(str(tmp_path / repo.split("/")[1]), **kw)
    _, commit = _hub_cache(tmp_path / "hf", mms, repo=repo)
    hub = tmp_path / "hf" / "hub"
    return str(hub), str(hub / ("models--" + repo.replace("/", "--")) / "snapshots" / commit)


def test_a_cached_mms_snapshot_loads_the_target_lang_or_refuses_it_without_the_hub(
        tmp_path, caplog):
    """A hub name whose MMS snapshot is cached: ``target_lang`` loads that language's adapter and
    vocabulary from the snapshot; a language its vocab.json has not, or no language where its
    tokenizer names none, is the one-line ValueError of a local folder, said at once (not taken
    for an unreadable snapshot: no "asking the hub" warning, no RuntimeError of the hub)."""
    import logging
    from safetensors.torch import load_file
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.lobes.testing import MMS_VOCABS
    hub, snap = _cached_mms(tmp_path)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="tta_brain.lobes.hf_ctc")
    fra = HFCTCLobe("org/mms-tiny", savedir=hub, target_lang="fra")
    assert (fra.target_lang, fra.vocab_size) == ("fra", len(MMS_VOCABS["fra"]))
    assert fra.id_to_token == dict(enumerate(MMS_VOCABS["fra"]))
    state = fra.model.state_dict()
    assert all(torch.equal(state[k], v)
               for k, v in load_file(f"{snap}/adapter.fra.safetensors").items())
    assert caplog.text.count("org/mms-tiny: loaded from the local Hugging Face cache") == 1
    with pytest.raises(ValueError, match=rf"^target_lang: 'deu' is not a language of "
                                         rf"{re.escape(snap)}'s vocab.json \(eng, fra\)$"):
        HFCTCLobe("org/mms-tiny", savedir=hub, target_lang="deu")
    hub, snap = _cached_mms(tmp_path, repo="org/mms-unnamed", default=None)
    with pytest.raises(ValueError, match=r"^target_lang: .*mms-unnamed.*'s vocab.json holds one "
                                         r"vocabulary per language \(eng, fra\) and "
                                         r"tokenizer_config.json names none: set target_lang$"):
        HFCTCLobe("org/mms-unnamed", savedir=hub)
    assert HFCTCLobe("org/mms-unnamed", savedir=hub, target_lang="fra").vocab_size == 36
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_mms_hub_name_asked_of_the_offline_hub_loads_the_target_lang(tmp_path, monkeypatch):
    """``local_files_only=False`` asks the hub (here in offline mode: its cache answers): the
    source is a hub name, whose vocab.json is fetched first as its tokenizer would be
    (``_hub_folder``), and the language is handed to the tokenizer (else its default, eng: 32
    tokens for fra's 36 outputs),
    and a language of its vocab.json whose adapter the hub has not is the one RuntimeError
    naming the adapter's file."""
    from huggingface_hub import constants
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.lobes.testing import MMS_VOCABS
    hub, snap = _cached_mms(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fra = HFCTCLobe("org/mms-tiny", savedir=hub, local_files_only=False, target_lang="fra")
    assert (fra.target_lang, fra.id_to_token) == ("fra", dict(enumerate(MMS_VOCABS["fra"])))
    os.remove(os.path.join(snap, "adapter.fra.safetensors"))
    with pytest.raises(RuntimeError, match=r"^Cannot load the CTC source model 'org/mms-tiny': "
                                           r"its adapter of 'fra' \(adapter.fra.safetensors\): "):
        HFCTCLobe("org/mms-tiny", savedir=hub, local_files_only=False, target_lang="fra")


def test_an_mms_hub_name_asked_of_the_hub_has_its_language_checked(tmp_path, monkeypatch):
    """Asked of the hub (offline mode here), a hub name's vocab.json was never read before the
    load: a language it has not loaded the model and failed on the adapter's file, and a
    checkpoint whose tokenizer names no language failed in the tokenizer ("requires the
    protobuf library"); now both are the one-line ValueError of a local folder."""
    from huggingface_hub import constants
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub, snap = _cached_mms(tmp_path)
    with pytest.raises(ValueError, match=rf"^target_lang: 'deu' is not a language of "
                                         rf"{re.escape(snap)}'s vocab.json \(eng, fra\)$"):
        HFCTCLobe("org/mms-tiny", savedir=hub, local_files_only=False, target_lang="deu")
    hub, _ = _cached_mms(tmp_path, repo="org/mms-unnamed", default=None)
    with pytest.raises(ValueError, match=r"^target_lang: .*mms-unnamed.*'s vocab.json holds one "
                                         r"vocabulary per language \(eng, fra\) and "
                                         r"tokenizer_config.json names none: set target_lang$"):
        HFCTCLobe("org/mms-unnamed", savedir=hub, local_files_only=False)


def test_what_a_build_logs_reaches_its_own_runs_log_only(tmp_path, ok_stream, tiny_model_dir,
                                                         monkeypatch):
    """Two decodes in one process (a sweep's fallback, a notebook): what the second logs while
    its model is built went to the first run's log.txt (its handler was still attached), and
    before that to no file at all."""
    import logging
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    built = HFCTCLobe.__init__

    def logging_init(self, source, *a, **kw):
        logging.getLogger("tta_brain.lobes.hf_ctc").info("building for %s", kw.get("device"))
        built(self, source, *a, **kw)
    monkeypatch.setattr(HFCTCLobe, "__init__", logging_init)
    outs = [tmp_path / "one", tmp_path / "two"]
    for i, out in enumerate(outs):
        decode.main(dsuta_args(tiny_model_dir, ok_stream, out, f"--seed={i}"))
    logs = [(out / "log.txt").read_text() for out in outs]
    assert [log.count("building for cpu") for log in logs] == [1, 1]


def test_an_incomplete_cached_snapshot_asks_the_hub(tmp_path, ok_stream, tiny_model_dir):
    hub = _CountingHub()
    repo, _ = _hub_cache(tmp_path / "hf", tiny_model_dir, only={"config.json"})
    res = _decode_with_hub(tmp_path, ok_stream, hub, repo)
    assert res.returncode == 1 and hub.connections > 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ERROR: ") and f"Cannot load the CTC source model '{repo}'" in last
    assert "or a hub name already in the HF cache" in last


def test_an_uncached_hub_model_without_a_reachable_hub_is_one_line_at_once(
        tmp_path, ok_stream, monkeypatch):
    """A hub name that is not in the cache, on a machine where the hub's host does not resolve
    (a cluster node without network), used to retry for about 50 s a run before failing; now the
    run stops at once (no retry) with one line saying what to do."""
    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    hub = types.SimpleNamespace(url="https://hub.invalid")      # RFC 6761: never resolves
    res = _decode_with_hub(tmp_path, ok_stream, hub, "org/not-cached")
    assert res.returncode == 1 and "Retrying" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ERROR: ") and ("Cannot load the CTC source model 'org/not-cached': it "
                                           "is not in the local Hugging Face cache and the hub's "
                                           "host hub.invalid cannot be resolved here") in last
    assert "`huggingface-cli download org/not-cached` on a machine with network" in last
    assert not (tmp_path / "exp").exists()
    # behind a proxy, or offline (the hub library stops at once itself): not said unreachable
    from huggingface_hub import constants
    from tta_brain.data.cache import hub_unreachable
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert "host hub.invalid cannot be resolved here" in hub_unreachable()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_unreachable() is None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub_unreachable() is None


def test_a_hub_source_recorded_without_its_commit_is_the_same_run():
    from tta_brain.data.cache import same_source
    from tta_brain.run.identity import differences
    old = {"stream_sha1": "s", "hparams": {"source": "hub:org/m", "lr": 1}}
    new = {"stream_sha1": "s", "hparams": {"source": "hub:org/m@abc", "lr": 1}}
    assert differences(old, new) == [] and differences(new, old) == []
    other = {"stream_sha1": "s", "hparams": {"source": "hub:org/m@def", "lr": 1}}
    assert differences(new, other) == ["hparams.source: 'hub:org/m@abc' != 'hub:org/m@def'"]
    assert not same_source("hub:org/m", "hub:org/m2@abc") and not same_source("sha1:1", "sha1:2")
    assert not same_source("hub:org/m", "sha1:abc") and same_source(None, None)


def test_a_truncated_last_line_names_file_and_line(tmp_path, one_wav, tiny_model_dir):
    stream = write_manifest(tmp_path / "s.csv", [row(f"u{i}", one_wav, 0.4) for i in range(3)])
    text = stream.read_text()
    stream.write_text(text[: text.rindex(",", 0, len(text) - 1)] + "\n")   # cut the last row
    msg = _error(dsuta_args(tiny_model_dir, stream, tmp_path / "exp"))
    assert f"{stream}:4: " in msg and "truncated or malformed line" in msg and "(--stream_csv)" in msg


@pytest.mark.parametrize("missing", ["model", "method", "stream_csv", "output_folder"])
def test_an_own_yaml_without_a_run_key_is_one_line(missing, tmp_path, monkeypatch):
    """A yaml without ``include: [run]`` that lacks a key the run needs stops with one line
    naming the yaml and the key, before a file is written (not a KeyError traceback)."""
    keys = {"seed": "1", "model": "!new:collections.OrderedDict",
            "method": "!new:collections.OrderedDict", "stream_csv": "s.csv",
            "output_folder": "exp"}
    del keys[missing]
    (tmp_path / "own.yaml").write_text("".join(f"{k}: {v}\n" for k, v in keys.items()))
    monkeypatch.chdir(tmp_path)
    msg = _error(["own.yaml"])
    assert f"own.yaml: no '{missing}' key (a method yaml needs model, method, stream_csv " \
        "and output_folder" in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["own.yaml"]


@pytest.mark.parametrize("method,expected", [
    ("dsuta_typo", "hparams file not found: dsuta_typo (packaged methods: awmc,"),
    ("bad_include.yaml", "bad_include.yaml: include 'nosuch' not found"),
])
def test_help_of_a_method_that_is_not_there_is_one_line(method, expected, tmp_path, monkeypatch):
    (tmp_path / "bad_include.yaml").write_text("include: [nosuch]\nlr: 0.1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        decode.main([method, "--help"])
    assert str(e.value).startswith("ERROR: ") and expected in str(e.value)
    with pytest.raises(SystemExit) as e:                  # a sweep's run: decode's help
        sweep.main(["suta", "--", method, "--help"])
    assert str(e.value).startswith("ERROR: ") and expected in str(e.value)


def test_the_stream_module_run_as_a_command_says_it_is_an_api():
    """``python -m tta_brain.stream`` printed nothing and exited 0. The module is a Python API:
    ``--help`` prints its use (the module's docstring); anything else is one line naming the
    API and the command that decodes a manifest, exit 2."""
    def run(*a):
        return subprocess.run([sys.executable, "-m", "tta_brain.stream", *a], text=True,
                              capture_output=True, timeout=120)
    res = run("--help")
    assert res.returncode == 0 and "TTAStream.from_hparams(" in res.stdout, res
    for args in ((), ("--source", "x")):
        res = run(*args)
        err = res.stderr.strip()
        assert res.returncode == 2 and not res.stdout and "\n" not in err, res
        assert "Python API" in err and "python -m tta_brain.decode" in err, err


def test_run_options_do_what_they_say_and_help_lists_the_keys(tmp_path, ok_stream, tiny_model_dir,
                                                               capsys):
    decode.main(["dsuta", "--help"])
    text = capsys.readouterr().out
    for key in ("--steps", "--buffer_size", "--reset_K", "--lr", "--param_collection",
                "--device", "--precision", "--compile", "--noprogressbar", "--overwrite"):
        assert key in text, key
    assert "--source" in text and "(required)" in text
    assert "M: utterances per slow update" in text                 # one line of meaning each
    out = tmp_path / "exp"
    summary = decode.main(dsuta_args(tiny_model_dir, ok_stream, out, "--compile=false",
                                     "--precision=bf16", "--reset=dynamic", "--reset_K=4",
                                     "--buffer_size=1"))
    assert summary.hparams["precision"] == "bf16" and summary.hparams["compile"] is False
    hp = (out / "hyperparams.yaml").read_text()
    assert re.search(r"^precision: bf16\b", hp, re.M) and re.search(r"^reset_K: 4\b", hp, re.M)
    log = (out / "log.txt").read_text()
    assert "dsuta: continual, 1 step(s) per utterance; adapts" in log
    assert "layernorm (lr x1):" in log and "cnn (lr x1):" in log     # the groups, in log.txt
    assert "evaluation precision: `--eval_precision=bf16`" in log      # SpeechBrain's line, true
    # a stream shorter than K: the reset cannot act; said in the log and the summary
    assert any("reset_K = 4 on a stream of 1 utterances" in w for w in summary.warnings)
    assert "its construction stage (K utterances) does not end" in log
    # what it suggests is a reset_K the method takes (it said "use reset_K < 1", refused)
    assert "too short for any reset_K accepted (at least 4)" in log and "reset_K < 1" not in log
    from fake_corpora import write_stream
    six = write_stream(tmp_path / "six", n=6, block=3)
    for count, low in (("paper", 4), ("official", 5)):      # (official: reset_K >= 5)
        s = decode.main(dsuta_args(tiny_model_dir, six / "stream.csv", tmp_path / count,
                                   f"--data_root={six}", "--reset=dynamic", "--reset_K=6",
                                   "--buffer_size=3", f"--reset_lii_count={count}"))
        assert any("reset_K = 6 on a stream of 6 utterances" in w and f"(use {low} <= reset_K "
                   f"< 6; " in w for w in s.warnings), s.warnings
    # bf16: the LII (a difference of two bf16 losses) is of the size of their rounding
    assert any(w.startswith("dynamic reset in bf16: the LII is a difference of two losses")
               for w in summary.warnings) and "use --precision=fp32 for runs whose resets" in log


def test_awmc_takes_the_reset_options(tmp_path, tiny_model_dir):
    from fake_corpora import write_stream
    data = write_stream(tmp_path / "d", n=12, block=4)
    s = decode.main(["awmc", f"--source={tiny_model_dir}", f"--stream_csv={data / 'stream.csv'}",
                     f"--output_folder={tmp_path / 'exp'}", f"--data_root={data}", "--steps=1",
                     "--ckpt_every=0", "--noprogressbar", "--reset=oracle"])
    assert s.method == "awmc+oracle" and s.resets == [4, 8]


# ----------------------------------------------------------------------------- the Python API's input
def test_live_stream_takes_pcm_and_either_channel_layout(tmp_path, tiny_model_dir, utterances):
    """What a sound card or ``soundfile.read`` hands over: int16 PCM is scaled as libsndfile scales
    it when it reads the same samples from a file, ``[T, C]`` and ``[C, T]`` are both averaged;
    unusable input is one line and leaves the stream where it was."""
    from tta_brain.stream import TTAStream, as_mono_float
    stereo = torch.stack([utterances[1][:16000], 0.5 * utterances[3]], 1).numpy()   # 1.0 s each
    path = tmp_path / "stereo.wav"
    sf.write(path, stereo, 16000, subtype="PCM_16")
    pcm, _ = sf.read(path, dtype="int16")                         # [T, 2], as a sound card gives
    want = load_audio(path)                                       # the file path's own reading
    assert pcm.shape[1] == 2 and pcm.dtype == np.int16
    assert torch.equal(as_mono_float(pcm), want)                  # [T, C]
    assert torch.equal(as_mono_float(pcm.T.copy()), want)         # [C, T]
    left = torch.from_numpy(sf.read(path, dtype="float32")[0][:, 0].copy())
    assert torch.equal(as_mono_float(pcm[:, 0].copy()), left)
    assert torch.equal(as_mono_float(pcm[:, 0].astype(np.int32) << 16), left)
    assert torch.equal(as_mono_float(((pcm[:, 0] >> 8) + 128).astype(np.uint8)),
                       torch.from_numpy((pcm[:, 0] >> 8).astype(np.float32) / 128))
    assert not torch.equal(torch.as_tensor(pcm[:, 0], dtype=torch.float32), left)   # scaling matters
    assert torch.equal(as_mono_float(np.array([-128, 64, 0], np.int8)),    # int8 PCM too
                       torch.tensor([-1.0, 0.5, 0.0]))
    # the buffers of the ``wave`` module and pyaudio keep int16 (were widened to int64, refused)
    import array
    assert torch.equal(as_mono_float(array.array("h", pcm[:, 0].tobytes())), left)
    assert torch.equal(as_mono_float(memoryview(pcm[:, 0].copy())), left)
    frames = pcm[:, 0].tobytes()           # what wave's readframes and pyaudio's read give
    assert torch.equal(as_mono_float(memoryview(frames).cast("h")), left)
    with warnings.catch_warnings():        # numpy.frombuffer's read-only array: torch warned
        warnings.simplefilter("error")
        assert torch.equal(as_mono_float(np.frombuffer(frames, dtype=np.int16)), left)
        assert torch.equal(as_mono_float(memoryview(frames).cast("h")), left)
    # a memoryview of those bytes (format 'B') was read as uint8 PCM, twice as long: refused
    for raw in (memoryview(frames), memoryview(bytearray(frames))):
        with pytest.raises(ValueError, match=re.escape("raw bytes (wave's readframes, pyaudio's "
                                                       "read; a memoryview of them too)")):
            as_mono_float(raw)
    u8 = ((pcm[:, 0] >> 8) + 128).astype(np.uint8)        # a typed 8-bit buffer stays PCM
    assert torch.equal(as_mono_float(memoryview(array.array("B", u8.tobytes()))),
                       as_mono_float(u8))

    tta = TTAStream.from_hparams("suta", source=tiny_model_dir, overrides={"steps": 1})
    hyps = [tta.transcribe(x) for x in (want, pcm, pcm.T.copy())]
    assert hyps[1:] == hyps[:1] * 2 and tta.position == 3
    # a differentiable front end's output (requires_grad): samples; was torch's "backward
    # through the graph a second time" with steps >= 2 (a half-counted utterance)
    two, plain = (TTAStream.from_hparams("suta", source=tiny_model_dir, overrides={"steps": 2})
                  for _ in range(2))
    assert two.transcribe(want.clone().requires_grad_()) == plain.transcribe(want)
    assert two.position == 1 and two.counts == plain.counts and two.counts["adapt_backward"] == 2
    for bad, why in ((np.zeros(100, np.float32), "100 samples at 16000 Hz are too short for the model"),
                     (np.zeros(0, np.float32), "expected a non-empty 1-D waveform, got shape (0,)"),
                     (np.zeros((2, 3, 4), np.float32), "got shape (2, 3, 4)"),
                     (np.ones(800, bool), "expected float samples or integer PCM (int8, uint8, "
                                          "int16, int32), got torch.bool"),
                     (pcm[:, 0].tolist(), "got torch.int64 (integer samples: give their width, "
                                          "e.g. numpy.asarray(samples, dtype=numpy.int16))"),
                     (pcm.tobytes(), "got bytes (raw bytes (wave's readframes, pyaudio's "
                                     "read; a memoryview of them too): their sample width is "
                                     "unknown; give their samples, e.g. "
                                     "memoryview(data).cast('h') or numpy.frombuffer(data, "
                                     "dtype=numpy.int16))"),
                     (np.full(800, np.nan, np.float32), "contains NaN or inf"),
                     (np.r_[want.numpy(), np.float32(np.inf)], "contains NaN or inf"),
                     (str(path), "expected the samples (a numpy array, torch tensor or list of "
                                 "floats), got str"),         # a path: was torch's 'new()'
                     ([[0.1, 0.2], [0.3]], "got list")):
        with pytest.raises(ValueError, match=re.escape(why)):
            tta.transcribe(bad)
    for rate in (0, -8000, 8000.5, "16k", True):    # 0 was taken as 16 kHz, the others deep errors
        with pytest.raises(ValueError, match=re.escape(
                f"sample_rate must be a positive whole number of Hz, got {rate!r}")):
            tta.transcribe(want, sample_rate=rate)
    assert tta.position == 3 and tta.counts == tta.method.counts
    tta.reset()                            # an episodic method's reset is listed too (was not)
    tta.reset()                            # and a second one at that position is the same reset
    assert tta.resets == [3]
    hyp = tta.transcribe(want, sample_rate=np.int64(16000))          # numpy and whole floats
    assert hyp == tta.transcribe(want, sample_rate=16000.0) == hyps[0]


def test_live_stream_built_loaded_or_reset_in_inference_mode(tmp_path, tiny_model_dir,
                                                             utterances):
    """A server that builds its stream, loads a saved state or resets under its own
    ``torch.inference_mode()`` got inference tensors in the weights, the optimiser or the loaded
    state: the next transcribe failed ("Inplace update to inference tensor outside
    InferenceMode", "Inference tensors cannot be saved for backward"). Each now leaves
    inference mode, as transcribe does: the transcripts are those of a stream made outside it."""
    from tta_brain.stream import TTAStream
    for method, ov in (("csuta", {"lr": 0.05}), ("dsuta", {"steps": 1, "buffer_size": 1})):
        def stream():
            return TTAStream.from_hparams(method, source=tiny_model_dir, overrides=ov)
        plain = stream()
        ref = [plain.transcribe(w) for w in utterances[:4]]
        first = stream()
        first.transcribe(utterances[0])
        first.save(tmp_path / f"{method}.pt")
        with torch.inference_mode():
            built = stream()
        assert [built.transcribe(w) for w in utterances[:4]] == ref, method
        loaded = stream()
        with torch.inference_mode():
            loaded.load(tmp_path / f"{method}.pt")
        assert [loaded.transcribe(w) for w in utterances[1:4]] == ref[1:], method
        with torch.inference_mode():
            loaded.reset()
        assert [loaded.transcribe(w) for w in utterances[:2]] == ref[:2], method


def test_live_stream_is_one_sequence_whatever_the_caller_does(tmp_path, tiny_model_dir,
                                                               utterances):
    """An application's habits broke the stream: two threads at once (autograd's "modified by
    an inplace operation" in one thread, a half-counted utterance left), the app's
    ``torch.inference_mode()`` (an autograd error, counts changed), an utterance over
    ``max_duration`` (decoded here, skipped by a recipe run: every later transcript differed),
    ``segment="0"`` (another block than 0), a user reset missing from ``resets``. Now calls
    are taken one at a time, inference mode adapts as no_grad does, the long utterance and a
    text segment are one ValueError with the state unchanged, and the reset is listed."""
    import threading
    from tta_brain.stream import StreamStateError, TTAStream

    def stream(**ov):
        return TTAStream.from_hparams("suta", source=tiny_model_dir,
                                      overrides={"steps": 2, "lr": 0.05, **ov})
    serial = stream()
    ref = [serial.transcribe(w) for w in utterances]
    shared, errors = stream(), []

    def feed():
        try:
            for w in utterances:
                shared.transcribe(w)
        except Exception as e:              # noqa: BLE001 (the test says which)
            errors.append(e)
    threads = [threading.Thread(target=feed) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and shared.position == 2 * len(utterances)
    again = stream()
    for w in utterances + utterances:
        again.transcribe(w)
    assert shared.counts == again.counts                # whole utterances only
    inner = stream()
    with torch.inference_mode():        # samples made there too: inference tensors
        assert [inner.transcribe(w * 1.0) for w in utterances] == ref
    assert inner.counts == serial.counts
    long = torch.cat([utterances[1]] * 18)              # 21.6 s
    before = (serial.position, serial.counts)
    with pytest.raises(ValueError, match=r"transcribe: 21\.6 s is longer than max_duration "
                                         r"\(20 s\), which a recipe run skips too"):
        serial.transcribe(long)
    with pytest.raises(ValueError, match=r"transcribe: 20\.04 s is longer than max_duration "
                                         r"\(20 s\)"):     # was: 20.0 s > 20.0 s
        serial.transcribe(torch.zeros(int(20.04 * 16000)))
    for bad in ("0", 1.5, True):
        with pytest.raises(ValueError, match="transcribe: segment must be an integer"):
            serial.transcribe(utterances[0], segment=bad)
    with pytest.raises(ValueError, match="transcribe: expected real samples"):
        serial.transcribe(utterances[0].to(torch.complex64))
    assert (serial.position, serial.counts) == before
    unlimited = stream(max_duration=0)
    unlimited.transcribe(long)                          # no limit: decoded
    assert unlimited.position == 1
    edge = stream(steps=1)                              # 20.0 s: a recipe run decodes it too
    edge.transcribe(torch.zeros(20 * 16000))
    assert edge.position == 1
    assert serial.transcribe(utterances[0], segment=np.int64(3)) is not None
    continual = TTAStream.from_hparams("dsuta", source=tiny_model_dir,
                                       overrides={"steps": 1, "buffer_size": 1})
    continual.transcribe(utterances[0])
    continual.reset()                                   # the user's, as a policy's is listed
    continual.reset()                                   # twice at one position: listed once
    assert continual.resets == [1]
    episodic = TTAStream.from_hparams("suta", source=tiny_model_dir, overrides={"steps": 1})
    episodic.transcribe(utterances[0])
    episodic.reset()                                    # an episodic method's is listed alike
    episodic.reset()                                    # (mutation audit: unlisted, it passed)
    assert episodic.resets == [1]
    fixed = TTAStream.from_hparams("csuta", source=tiny_model_dir, overrides={
        "steps": 1, "reset": "fixed", "reset_every": 3})  # the policy counts from the user's reset
    for w in utterances[:2]:
        fixed.transcribe(w)
    fixed.reset()
    for w in utterances[:4]:
        fixed.transcribe(w)
    assert fixed.resets == [2, 5]
    fixed.save(tmp_path / "fixed.pt")                   # the resets so far go on with the state
    back = TTAStream.from_hparams("csuta", source=tiny_model_dir, overrides={
        "steps": 1, "reset": "fixed", "reset_every": 3})
    back.load(tmp_path / "fixed.pt")
    assert back.resets == [2, 5] and back.position == 6
    serial.save(tmp_path / "s.pt")
    cut = tmp_path / "cut.pt"
    cut.write_bytes((tmp_path / "s.pt").read_bytes()[:4000])
    for path, said in ((cut, "cannot be read: cut short or damaged (RuntimeError: "),
                       (tmp_path, "a folder, not a state file")):
        with pytest.raises(StreamStateError, match=re.escape(f"{path}: {said}")):
            serial.load(path)
    with pytest.raises(StreamStateError, match="TTAStream.save: the path is empty"):
        serial.save("")


def test_live_stream_saves_loads_resets_and_counts_between_utterances(tmp_path, tiny_model_dir,
                                                                      utterances, monkeypatch):
    """save, load, reset and counts take the stream's lock as transcribe does, so another
    thread's utterance is never half in a saved state, half overwritten by a load or a reset, or
    half counted (mutation audit: each without the lock passed every test). Another thread
    probes the lock while the method's state is read or written."""
    import threading
    from tta_brain.stream import TTAStream
    tta = TTAStream.from_hparams("dsuta", source=tiny_model_dir,
                                 overrides={"steps": 1, "buffer_size": 1})
    tta.transcribe(utterances[0])
    free = []

    def probe():
        def other():
            got = tta._lock.acquire(blocking=False)
            if got:
                tta._lock.release()
            free.append(got)
        t = threading.Thread(target=other)
        t.start()
        t.join()

    for name in ("state_dict", "load_state_dict", "reset_meta"):
        def probed(*a, _real=getattr(tta.method, name), **k):
            probe()
            return _real(*a, **k)
        monkeypatch.setattr(tta.method, name, probed)

    class Counts(dict):
        def __iter__(self):
            probe()
            return super().__iter__()

        def keys(self):
            probe()
            return super().keys()
    monkeypatch.setattr(tta.method, "counts", Counts(tta.method.counts))
    tta.save(tmp_path / "s.pt")
    tta.load(tmp_path / "s.pt")
    tta.reset()
    assert tta.counts["adapt_backward"] == 1 and tta.resets == [1]
    assert len(free) >= 4 and not any(free), free       # another thread found it taken each time


def test_live_stream_oracle_reset_needs_the_segment(tiny_model_dir):
    """Without segment= the oracle policy saw one block and never reset, silently."""
    from tta_brain.stream import TTAStream
    tta = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides={
        "reset": "oracle", "steps": 1, "buffer_size": 1})
    wav = torch.from_numpy(speech(0.4))
    with pytest.raises(ValueError, match=re.escape("the oracle reset policy needs segment=")):
        tta.transcribe(wav)
    assert tta.position == 0
    for seg in (0, 0, 1, 1, 2):
        tta.transcribe(wav, segment=seg)
    assert tta.resets == [2, 4]
    plain = TTAStream.from_hparams("suta", source=tiny_model_dir, overrides={"steps": 1})
    plain.transcribe(wav)                     # other policies need no segment
    assert plain.position == 1


def damage_a_tensor(src, dst):
    """A copy of the ``torch.save`` file ``src`` with 8 bytes of its largest tensor overwritten."""
    import zipfile
    with zipfile.ZipFile(src) as z:
        member = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(Path(src).read_bytes())
    name_len, extra_len = (int.from_bytes(raw[member.header_offset + k:member.header_offset + k + 2],
                                          "little") for k in (26, 28))
    at = member.header_offset + 30 + name_len + extra_len + member.file_size // 2
    raw[at:at + 8] = bytes(255 - b for b in raw[at:at + 8])
    Path(dst).write_bytes(bytes(raw))


def test_a_damaged_checkpoint_is_one_line_not_a_wrong_resume(tmp_path, tiny_model_dir, utterances):
    from tta_brain.lobes.hf_ctc import HFCTCLobe
    from tta_brain.methods import build_method
    from tta_brain.run.checkpoint import ResumeError, StreamState
    method = build_method("suta", model=HFCTCLobe(tiny_model_dir), steps=1)
    method.process(utterances[0])
    folder = tmp_path / "exp" / "save" / "CKPT+1"
    folder.mkdir(parents=True)
    good, bad = folder / "stream.ckpt", folder / "damaged.ckpt"
    StreamState(method, None)._save(good)
    damage_a_tensor(good, bad)
    fresh = StreamState(build_method("suta", model=HFCTCLobe(tiny_model_dir), steps=1), None)
    fresh._load(good)                                       # the good one loads
    assert fresh.cursor == 0
    with pytest.raises(ResumeError, match=re.escape(f"{bad}: the checkpoint is damaged (member ")):
        fresh._load(bad)
    # a checkpoint of an older tta_brain (its fingerprint without the yaml's structure digests)
    # resumes, as its folder does (it was compared key for key: "structure differ"); another
    # setting is refused, naming it
    older = {"stream_sha1": "s", "n_rows": 3, "tta_brain": "x", "hparams": {"lr": 0.1}}
    StreamState(method, older)._save(good)
    now = dict(older, structure={"method": "0123456789ab"})
    StreamState(build_method("suta", model=HFCTCLobe(tiny_model_dir), steps=1), now)._load(good)
    other = dict(now, hparams={"lr": 0.2})
    with pytest.raises(ResumeError, match=re.escape("from another run (hparams.lr: 0.1 != 0.2)")):
        StreamState(build_method("suta", model=HFCTCLobe(tiny_model_dir), steps=1), other)._load(good)


def test_save_removes_what_a_killed_save_left(tmp_path):
    """A kill -9 during a save leaves its temporary file (``<file>.tmp<pid>``); they piled up. The
    next save of the same file removes those over an hour old (a live save's is kept)."""
    from tta_brain.data.cache import save_torch
    path = tmp_path / "state.pt"
    old, live = tmp_path / "state.pt.tmp123", tmp_path / "state.pt.tmp456"
    for f in (old, live):
        f.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    save_torch({"x": 1}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt", "state.pt.tmp456"]
    assert torch.load(path) == {"x": 1}


def test_a_failed_save_keeps_the_file_it_would_replace(tmp_path, monkeypatch):
    """A save that fails half-way (a full disk: torch says RuntimeError) leaves the file it would
    have replaced as it was, and no temporary file."""
    from tta_brain.data.cache import save_torch
    path = tmp_path / "state.pt"
    save_torch({"x": 1}, path)
    real = torch.save

    def full_disk(obj, f):
        real(obj, f)
        with open(f, "r+b") as h:
            h.truncate(20)
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=re.escape("file write failed")):
        save_torch({"x": 2}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["state.pt"] and torch.load(path) == {"x": 1}


def test_a_live_stream_keeps_its_latest_lii_values(tmp_path, tiny_model_dir, utterances):
    """Every LII value of a stream was kept in memory and written by every save (a live stream
    runs for ever: O(n) memory and save time); ``lii_history`` keeps the latest, the detector's
    transcripts unchanged; a loaded state keeps its latest values within this stream's bound."""
    from tta_brain.stream import LII_HISTORY, TTAStream
    ov = {"reset": "dynamic", "steps": 1, "buffer_size": 2, "reset_K": 4, "reset_patience": 1,
          "lr": 1e-3}
    every = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov,
                                   lii_history=None)
    kept = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov, lii_history=2)
    assert TTAStream.from_hparams("source", source=tiny_model_dir)._lii.maxlen == LII_HISTORY
    for w in utterances + utterances:
        assert every.transcribe(w) == kept.transcribe(w)
    assert len(every.lii) >= 3 and kept.lii == every.lii[-2:]
    position, value, stage = every.lii[-1]               # (position, LII, stage), as documented
    assert isinstance(position, int) and isinstance(value, float) and stage in ("construction",
                                                                                "detection")
    every.save(tmp_path / "all.pt")
    one = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov, lii_history=1)
    one.load(tmp_path / "all.pt")
    assert one.lii == every.lii[-1:] and one.position == every.position
    kept.save(tmp_path / "two.pt")                       # a used stream takes the file's values
    every.reset()                                        # (and its resets: not this one)
    assert every.resets[-1] == every.position
    every.load(tmp_path / "two.pt")
    assert (every.lii, every.resets, every.position) == (kept.lii, kept.resets, kept.position)
    assert TTAStream(kept.method, lii_history=0).lii == []
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="lii_history must be a whole number >= 0 or None"):
            TTAStream(kept.method, lii_history=bad)


def test_live_stream_state_resumes_exactly_and_refuses_another_streams(tmp_path, tiny_model_dir,
                                                                       utterances, caplog):
    """save -> load continues as if never stopped (DSUTA + dynamic reset: meta-parameters, both
    optimisers, the detector); a state of another method, reset policy, model or parameter set is
    a one-line error that leaves the stream untouched, as is another dynamic-reset schedule
    (reset_K); other settings are taken and logged."""
    from tta_brain.stream import StreamStateError, TTAStream
    from conftest import save_ctc_model
    ov = {"reset": "dynamic", "steps": 2, "buffer_size": 2, "reset_K": 4, "reset_patience": 1,
          "lr": 1e-3}
    whole = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov)
    want = [whole.transcribe(w) for w in utterances]
    part = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov)
    first = [part.transcribe(w) for w in utterances[:3]]
    state = tmp_path / "state.pt"
    part.save(state)
    again = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov)
    again.load(state)
    assert again.position == 3 and again.lii == part.lii
    assert first + [again.transcribe(w) for w in utterances[3:]] == want
    assert (again.resets, again.lii, again.counts) == (whole.resets, whole.lii, whole.counts)
    assert whole.lii, "no LII value: the detector's state was not exercised"

    other_model = save_ctc_model(tmp_path / "other_model", seed=1)
    # the file's adapted tensors, counted from the saving stream's own parameters
    adapted = (f"adapted {len(part.method.params)} tensors of "
               f"{sum(p.numel() for p in part.method.params)} values (file) != ")
    for name, over, why in (
            ("suta", {"steps": 2}, "method 'dsuta' (file) != 'suta' (this stream)"),
            ("dsuta", {"steps": 2, "buffer_size": 2, "lr": 1e-3, "reset": "fixed"},
             "reset 'dynamic' (file) != 'fixed'"),
            # another K: the construction stage's fit position was passed, no test ever again
            ("dsuta", {**ov, "reset_K": 6}, "reset_schedule 'K 4, lii_count paper' (file) != "
                                            "'K 6, lii_count paper' (this stream)"),
            ("tent", {}, f"!= 'none' (this stream); {adapted}"),
            ("dsuta", {**ov, "source": str(other_model)}, "source 'sha1:")):
        stream = TTAStream.from_hparams(name, source=tiny_model_dir, overrides=over)
        before = [p.detach().clone() for p in stream.method.params]
        with pytest.raises(StreamStateError, match=re.escape(f"{state}: saved by another stream: ")) as e:
            stream.load(state)
        assert why in str(e.value) and "\n" not in str(e.value)
        assert stream.position == 0 and all(torch.equal(a, b) for a, b in
                                            zip(before, stream.method.params))
    caplog.set_level("WARNING", logger="tta_brain.stream")
    faster = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides={**ov, "lr": 2e-3})
    faster.load(state)
    assert faster.position == 3 and "lr 0.001 -> 0.002" in caplog.text
    # the optimisers (DSUTA's fast and slow) go on with this stream's lr, not the file's
    assert [g["lr"] for o in (faster.method.optimizer, faster.method.slow_optimizer)
            for g in o.param_groups] == [2e-3, 2e-3]
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a state")
    arrays = tmp_path / "arrays.npz"                # a whole zip archive, not torch's: not cut
    np.savez(arrays, x=np.zeros(3))
    for bad, why in ((tmp_path / "missing.pt", "no such state file"),
                     (garbage, "not a TTAStream state file"),
                     (arrays, "not a TTAStream state file (")):
        with pytest.raises(StreamStateError, match=re.escape(f"{bad}: {why}")):
            again.load(bad)
    # a damaged file (8 bytes of a saved tensor overwritten) loaded without a word: torch.load
    # does not check the archive's CRCs; a file with the format but no identity: a KeyError
    damaged, nameless = tmp_path / "damaged.pt", tmp_path / "nameless.pt"
    damage_a_tensor(state, damaged)
    torch.save({"format": "tta_brain.stream_state", "version": 1, "method": {}, "position": 0,
                "resets": []}, nameless)
    newer = tmp_path / "newer.pt"
    torch.save({**torch.load(state, weights_only=False), "version": 2}, newer)
    for bad, why in ((damaged, "damaged state file (member "),
                     (nameless, "not a TTAStream state file"),
                     (newer, "state format 'tta_brain.stream_state' version 2; this tta_brain "
                             "reads 'tta_brain.stream_state' version 1")):
        with pytest.raises(StreamStateError, match=re.escape(f"{bad}: {why}")):
            again.load(bad)
    # a file that fits but for its own fields: the method's state was loaded before they failed
    # (a raw TypeError / KeyError, or position 'x' taken); now refused before anything is applied
    saved = torch.load(state, weights_only=False)
    fresh = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov)
    params = [p.detach().clone() for p in fresh.method.params]
    for field, value, why in (("resets", None, "resets None is not a list of positions"),
                              ("resets", [2, "x"], "resets [2, 'x'] is not a list of positions"),
                              ("resets", [2, True], "resets [2, True] is not a list of positions"),
                              ("position", "x", "position 'x' is not a count of utterances"),
                              ("position", -1, "position -1 is not a count of utterances"),
                              ("position", True, "position True is not a count of utterances"),
                              ("lii", 5, "lii int is not a list"),
                              ("settings", None, "no settings recorded")):
        odd = tmp_path / f"odd_{field}.pt"
        torch.save({**saved, field: value}, odd)
        with pytest.raises(StreamStateError, match=re.escape(f"{odd}: not a TTAStream state "
                                                             f"file ({why})")):
            fresh.load(odd)
        assert fresh.position == 0 and fresh.counts["adapt_backward"] == 0
        assert all(torch.equal(a, b) for a, b in zip(params, fresh.method.params))
    before = sorted(os.listdir(tmp_path))
    for bad, why in ((tmp_path, "cannot write the state file: is a folder, not a file name"),
                     (tmp_path / "no" / "s.pt", f"cannot write the state file: no folder "
                                                f"{tmp_path / 'no'}")):    # the first left a .tmp
        with pytest.raises(StreamStateError, match=re.escape(f"{bad}: {why}")):
            again.save(bad)
    assert sorted(os.listdir(tmp_path)) == before and not list(tmp_path.parent.glob(
        f"{tmp_path.name}.tmp*"))
    legacy = tmp_path / "legacy.pt"        # what TTAStream.save wrote before states had an identity
    torch.save({"method": part.method.state_dict(), "position": 3, "resets": part.resets}, legacy)
    old = TTAStream.from_hparams("dsuta", source=tiny_model_dir, overrides=ov)
    caplog.clear()
    old.load(legacy)
    assert [old.transcribe(w) for w in utterances[3:]] == want[3:]
    assert "saved by an older tta_brain" in caplog.text
    assert "other settings" not in caplog.text      # none recorded: none said to differ
    # an older file (nothing to check it by) that does not fit the method: one line, and the
    # stream as it was (its step counter and pass counts had been taken from the file)
    awmc = TTAStream.from_hparams("awmc", source=tiny_model_dir, overrides={"steps": 1})
    awmc.transcribe(utterances[0])
    t, counts, params = awmc.method.t, awmc.counts, [p.clone() for p in awmc.method.params]
    with pytest.raises(StreamStateError, match=re.escape(f"{legacy}: does not fit this "
                                                         f"stream's awmc (")):
        awmc.load(legacy)
    assert (awmc.method.t, awmc.counts, awmc.position) == (t, counts, 1)
    assert all(torch.equal(a, b) for a, b in zip(params, awmc.method.params))


def test_live_stream_state_keeps_the_random_state(tmp_path, tiny_model_dir, utterances):
    """AWMC adapts in train mode (dropout): a loaded stream went on from the random state its
    construction seeded, not the saved stream's, so its parameters left the uninterrupted run's."""
    from tta_brain.stream import TTAStream
    ov = {"steps": 2, "lr": 0.05, "train_mode": True}
    whole = TTAStream.from_hparams("awmc", source=tiny_model_dir, overrides=ov)
    want = [whole.transcribe(w) for w in utterances]
    part = TTAStream.from_hparams("awmc", source=tiny_model_dir, overrides=ov)
    first = [part.transcribe(w) for w in utterances[:3]]
    part.save(tmp_path / "s.pt")
    again = TTAStream.from_hparams("awmc", source=tiny_model_dir, overrides=ov)  # seeds anew
    again.load(tmp_path / "s.pt")
    assert first + [again.transcribe(w) for w in utterances[3:]] == want
    assert all(torch.equal(a, b) for a, b in zip(whole.method.params, again.method.params))
    other = TTAStream.from_hparams("awmc", source=tiny_model_dir, overrides={**ov, "seed": 1})
    [other.transcribe(w) for w in utterances]
    assert not all(torch.equal(a, b) for a, b in zip(whole.method.params, other.method.params)), \
        "dropout had no effect: the test would prove nothing"


def test_live_stream_state_of_a_hub_model_matches_by_commit(tmp_path, tiny_model_dir,
                                                            utterances, monkeypatch):
    """A hub source counts by the commit of its cached snapshot: a state saved on another commit
    is refused; one recorded without a commit (the cache was empty then) is taken."""
    from tta_brain.data import cache
    from tta_brain.stream import StreamStateError, TTAStream
    snapshot = {"commit": "abc"}
    monkeypatch.setattr(cache, "hub_snapshot", lambda name, cache_dir=None:
                        f"/hf/models--org--m/snapshots/{snapshot['commit']}" if snapshot["commit"]
                        else None)
    stream = TTAStream.from_hparams("suta", source=tiny_model_dir, overrides={"steps": 1})
    stream.source = "org/m"                 # as if built from the hub name
    stream.transcribe(utterances[0])
    assert stream.identity()["source"] == "hub:org/m@abc"
    state = tmp_path / "state.pt"
    stream.save(state)
    snapshot["commit"] = "def"
    with pytest.raises(StreamStateError, match="source 'hub:org/m@abc' .file. != 'hub:org/m@def'"):
        stream.load(state)
    snapshot["commit"] = None                # saved when the cache had no snapshot of it
    stream.save(state)
    snapshot["commit"] = "def"
    stream.load(state)
    assert stream.position == 1



def test_live_stream_state_names_the_model_it_loaded(tmp_path, tiny_model_dir, utterances):
    """A local source counts by the files the stream loaded its model from: the directory's
    files replaced by another checkpoint (a deployment updating ``models/current``) while the
    stream ran on the loaded weights made save record the new model (a fresh stream on it took
    the state adapted from the old one) and load refuse the stream's own state; the directory
    moved away made it a hub name. Now both name the loaded model."""
    import shutil
    from conftest import save_ctc_model
    from tta_brain.stream import StreamStateError, TTAStream
    current = tmp_path / "current"
    shutil.copytree(tiny_model_dir, current)
    stream = TTAStream.from_hparams("suta", source=current, overrides={"steps": 1})
    stream.transcribe(utterances[0])
    loaded = stream.identity()["source"]
    assert loaded.startswith("sha1:")
    stream.save(tmp_path / "before.pt")
    save_ctc_model(current, seed=1)                      # another checkpoint in its place
    stream.transcribe(utterances[1])
    stream.save(tmp_path / "after.pt")
    assert torch.load(tmp_path / "after.pt", weights_only=False)["identity"]["source"] == loaded
    stream.load(tmp_path / "before.pt")
    assert stream.position == 1
    other = TTAStream.from_hparams("suta", source=current, overrides={"steps": 1})
    with pytest.raises(StreamStateError, match=re.escape(f"source '{loaded}' (file) != 'sha1:")):
        other.load(tmp_path / "after.pt")
    shutil.move(current, tmp_path / "moved")
    assert stream.identity()["source"] == loaded
    stream.load(tmp_path / "after.pt")
    assert stream.position == 2

# ----------------------------------------------------------------------------- one's own manifest
def _without(src, dst, column, **set_values):
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    fields = [c for c in rows[0] if c != column]
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows({**r, **set_values} for r in rows)
    return dst


def test_domains_without_segments_are_the_oracles_blocks(tmp_path, tiny_model_dir):
    """A manifest of one's own with a domain column and no segment column: its domain blocks are
    the segments (the column's definition), so the oracle reset fires where the domain changes,
    exactly as with the segments written out; one block only is a logged, summarised warning."""
    from fake_corpora import write_stream
    from tta_brain.data.loader import boundaries, load_stream
    root = write_stream(tmp_path / "s", n=8, block=3)            # domains d0 d0 d0 d1 d1 d1 d0 d0
    own = _without(root / "stream.csv", root / "own.csv", "segment")
    one = _without(root / "stream.csv", root / "one.csv", "segment", domain="street")
    full = load_stream(root / "stream.csv", root)
    assert [r["segment"] for r in load_stream(own, root)] == [r["segment"] for r in full]
    assert boundaries(load_stream(own, root)) == boundaries(full) == [3, 6]
    assert boundaries(load_stream(one, root)) == []
    got = {}
    for name in ("stream", "own", "one"):
        out = tmp_path / name
        decode.main(dsuta_args(tiny_model_dir, root / f"{name}.csv", out, "--reset=oracle",
                               f"--data_root={root}"))
        summary = json.loads((out / "summary.json").read_text())
        hyps = [r["hyp"] for r in csv.DictReader(open(out / "transcripts.csv"))]
        got[name] = (summary["resets"], summary["boundaries"], hyps, summary["warnings"])
    assert got["own"] == got["stream"] and got["stream"][:2] == ([3, 6], [3, 6])
    assert got["one"][:2] == ([], []) and "oracle reset on a stream with one domain block" in \
        got["one"][3][0]
    # and it says so in the run's log (was logged before the run had a log, and lost)
    note = "no segment column: 3 domain blocks from its domain column"
    assert note in (tmp_path / "own" / "log.txt").read_text()
    assert note not in (tmp_path / "stream" / "log.txt").read_text()
    # a segment column that does not follow the domains (accepted: the log says which is which)
    flat = _without(root / "stream.csv", root / "flat.csv", "no such column", segment="0")
    decode.main(["source", f"--source={tiny_model_dir}", f"--stream_csv={flat}",
                 f"--output_folder={tmp_path / 'flat'}", f"--data_root={root}", "--noprogressbar"])
    said = f"{flat}:5: the domain changes (d0 -> d1) within segment 0: the oracle reset"
    assert said in (tmp_path / "flat" / "log.txt").read_text()
    assert "within segment" not in (tmp_path / "stream" / "log.txt").read_text()


def test_live_stream_build_errors_speak_of_its_overrides(tiny_model_dir):
    """``TTAStream.from_hparams`` errors named decode's command-line options (``--lrr``,
    ``--source_stats``) to a Python caller who passed ``overrides={...}``; now its own words,
    a suggested command left as it is."""
    from tta_brain import hparams
    from tta_brain.stream import TTAStream
    for name, ov, said in (
            ("suta", {"lrr": 1e-4}, "overrides['lrr'] is no key of this yaml (did you mean "
                                    "overrides['lr']? python -m tta_brain.decode suta --help"),
            ("eata", {}, "no source statistics file given (overrides['source_stats']); make one "
                         "with python -m tta_brain.stats --source <model>")):
        with pytest.raises(hparams.HparamsError, match=re.escape(said)):
            TTAStream.from_hparams(name, source=tiny_model_dir, overrides=ov)


def test_live_stream_takes_the_models_rate_a_torch_device_and_names_source(tiny_model_dir,
                                                                           utterances):
    """TTAStream(method, sample_rate=8000) resampled 16 kHz input to 8 kHz and fed it to the
    16 kHz model; from_hparams(device=torch.device(...)) was "cannot represent an object"; a
    missing source named overrides['source'], though from_hparams has source= (and a bad
    device= overrides['device'])."""
    from tta_brain import hparams
    from tta_brain.stream import TTAStream
    tta = TTAStream.from_hparams("suta", source=tiny_model_dir, device=torch.device("cpu"),
                                 overrides={"steps": 1})
    assert tta.sample_rate == 16000 and isinstance(tta.transcribe(utterances[0]), str)
    with pytest.raises(ValueError, match=r"TTAStream: sample_rate=8000, but the model takes "
                                         r"16000 Hz audio"):
        TTAStream(tta.method, sample_rate=8000)
    assert TTAStream(tta.method, sample_rate=16000).sample_rate == 16000
    with pytest.raises(hparams.HparamsError, match=r"'source' is required: pass source=\.\.\."):
        TTAStream.from_hparams("suta")
    # a device= it cannot use is named as that argument, not as overrides['device']
    with pytest.raises(hparams.HparamsError, match=r"^device = 'gpu' \(device=\) is not valid"):
        TTAStream.from_hparams("suta", source=tiny_model_dir, device="gpu")
    from tta_brain.stream import api_words
    assert api_words("--device=cuda (--device) and --source=m, --devices, --lr=1") == \
        "device=cuda (device=) and source=m, overrides['devices'], overrides['lr']=1"


def test_live_stream_resamples_as_a_recipe_run_reads_the_file(tmp_path, tiny_model_dir,
                                                                utterances):
    """``transcribe(samples, sample_rate=8000)``: the samples of an 8 kHz file adapt as the
    file's own reading (resampled to the model's rate by the loader) does, not as the same
    samples taken at 16 kHz (no test fed another rate)."""
    from tta_brain.stream import TTAStream
    path = tmp_path / "8k.wav"
    sf.write(path, utterances[3][::2].numpy(), 8000, subtype="FLOAT")
    samples, rate = sf.read(path, dtype="float32")

    def adapted(wav, **kw):
        tta = TTAStream.from_hparams("suta", source=tiny_model_dir,
                                     overrides={"steps": 1, "lr": 0.05})
        return tta.transcribe(wav, **kw), [p.detach().clone() for p in tta.method.params]
    hyp, params = adapted(samples, sample_rate=rate)
    want, ref = adapted(load_audio(path))
    assert rate == 8000 and hyp == want and all(torch.equal(a, b) for a, b in zip(params, ref))
    _, raw = adapted(samples)                           # the samples taken as 16 kHz: another step
    assert not all(torch.equal(a, b) for a, b in zip(raw, ref)), "the rate had no effect"


def test_live_stream_state_at_the_start_or_of_a_moved_model_loads(tmp_path, tiny_model_dir,
                                                                  utterances, caplog):
    """A state saved before the first utterance (position 0) is a state, and one saved by a stream
    of the same model at another path (a copy: the same content) is this stream's: loaded without
    a word of other settings (where the model, device and data lie are not settings); one of a
    stream whose model is unknown (built from a method) is not refused for it."""
    from tta_brain.stream import TTAStream
    moved = tmp_path / "moved"
    shutil.copytree(tiny_model_dir, moved)
    ov = {"steps": 1, "lr": 0.05}
    start = TTAStream.from_hparams("suta", source=tiny_model_dir, overrides=ov)
    start.save(tmp_path / "start.pt")
    caplog.set_level("WARNING", logger="tta_brain.stream")
    again = TTAStream.from_hparams("suta", source=moved, overrides=ov)
    again.load(tmp_path / "start.pt")
    assert again.position == 0 and again.source == str(moved)
    assert "other settings" not in caplog.text, caplog.text
    assert again.transcribe(utterances[0]) == start.transcribe(utterances[0])
    TTAStream(start.method).save(tmp_path / "unknown.pt")   # built from a method: no source
    again.load(tmp_path / "unknown.pt")                      # nothing to check it by: taken
    assert again.position == 0
