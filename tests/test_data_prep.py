"""Audio I/O, manifests, and corpus preparation (LibriSpeech, MS-SNSD corruption, CHiME-3, CLI)."""
import csv
import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from fake_corpora import (estimate_snr_db, fake_noise, fake_speech, make_chime3,
                          make_librispeech, make_ms_snsd)
from tta_brain.data import audio as audio_mod
from tta_brain.data import cache
from tta_brain.data.prep import prepare
from tta_brain.data.audio import AudioError, load_audio, write_audio
from tta_brain.data.prep.chime3 import clean_transcript, prepare_chime3
from tta_brain.data.prep.librispeech import prepare_librispeech
from tta_brain.data.manifest import (STREAM_COLUMNS, ManifestError, ManifestNotFoundError,
                                     audio_duration, manifest_text, read_manifest, resolve_path,
                                     validate_manifest, write_manifest)
from tta_brain.data.mixing import gaussian_noise, tile_or_cut, utterance_seed
from tta_brain.data.prep.ms_snsd import corrupt_manifest, manifest_path
from tta_brain.data.prep.noise_table import LS_C_NOISES, find_noise_dir

SR = 16000


# ----------------------------------------------------------------------------------------------
# audio
# ----------------------------------------------------------------------------------------------
def test_write_load_roundtrip_wav_and_flac(tmp_path):
    x = fake_speech(0.3, seed=0)
    for ext in ("wav", "flac"):
        path = tmp_path / "sub" / f"a.{ext}"
        write_audio(path, torch.from_numpy(x))
        assert sf.info(str(path)).subtype == "PCM_16"
        assert sf.info(str(path)).format == ext.upper()
        y = load_audio(path)
        assert y.dtype == torch.float32 and y.ndim == 1 and y.numel() == x.size
        np.testing.assert_allclose(y.numpy(), x, atol=1 / 32767)
    assert not list(tmp_path.rglob(".*tmp*"))  # no leftovers of the atomic write
    # another rate is written as such (the header says it), an upper-case extension is accepted
    write_audio(tmp_path / "r8k.WAV", x, sample_rate=8000)
    assert sf.info(str(tmp_path / "r8k.WAV")).samplerate == 8000
    assert load_audio(tmp_path / "r8k.WAV", sample_rate=8000).numel() == x.size


def test_write_audio_clips_instead_of_wrapping(tmp_path, caplog):
    x = np.array([0.5, 1.7, -2.0, 0.0], dtype=np.float32)
    with caplog.at_level(logging.WARNING):
        write_audio(tmp_path / "c.wav", x)
    y = load_audio(tmp_path / "c.wav").numpy()
    assert y[1] > 0.99 and y[2] <= -0.99  # saturated, not wrapped around
    assert "clipped" in caplog.text
    with pytest.raises(ValueError, match="extension"):
        write_audio(tmp_path / "c.mp3", x)
    with pytest.raises(ValueError, match="1-D"):  # [1, T] is not written as T channels
        write_audio(tmp_path / "c2.wav", x[None])
    with pytest.raises(ValueError, match="NaN or infinite"):
        write_audio(tmp_path / "c3.wav", np.array([0.1, np.nan], dtype=np.float32))
    assert not (tmp_path / "c3.wav").exists()


def test_load_audio_downmixes_and_resamples_with_one_warning(tmp_path, caplog):
    audio_mod._warned.clear()
    stereo = np.stack([np.full(800, 0.2), np.full(800, 0.4)], axis=1).astype(np.float32)
    for i in range(2):
        sf.write(str(tmp_path / f"st{i}.wav"), stereo, SR)
    with caplog.at_level(logging.WARNING):
        a = load_audio(tmp_path / "st0.wav")
        load_audio(tmp_path / "st1.wav")
    np.testing.assert_allclose(a.numpy(), 0.3, atol=1e-4)
    assert caplog.text.count("averaged to mono") == 1
    t = np.arange(8000) / 8000
    tone = (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    sf.write(str(tmp_path / "r8k.wav"), tone, 8000)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        r = load_audio(tmp_path / "r8k.wav")
    assert r.numel() == 16000
    assert "resampled from 8000 Hz to 16000 Hz" in caplog.text
    # the 200 Hz tone survives resampling
    spec = np.abs(np.fft.rfft(r.numpy()))
    assert np.argmax(spec) == 200


def test_load_audio_errors_name_file_and_reason(tmp_path):
    with pytest.raises(AudioError, match=r"missing\.wav: file not found"):
        load_audio(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(os.urandom(300))
    with pytest.raises(AudioError, match=r"junk\.wav: unreadable or corrupt"):
        load_audio(tmp_path / "junk.wav")
    sf.write(str(tmp_path / "empty.wav"), np.zeros(0, dtype=np.float32), SR)
    with pytest.raises(AudioError, match=r"empty\.wav: empty audio"):
        load_audio(tmp_path / "empty.wav")
    bad = np.zeros(100, dtype=np.float32)
    bad[10] = np.nan
    sf.write(str(tmp_path / "nan.wav"), bad, SR, subtype="FLOAT")
    with pytest.raises(AudioError, match=r"nan\.wav: audio contains NaN"):
        load_audio(tmp_path / "nan.wav")
    assert issubclass(AudioError, ValueError)


def test_a_write_that_fails_keeps_the_file_it_would_replace(tmp_path, monkeypatch):
    """A full disk half-way through a rewrite leaves the old file as it was (written under a
    temporary name, renamed over it only when complete) and no temporary file."""
    path = tmp_path / "a.wav"
    write_audio(path, fake_speech(0.3, seed=0))
    before = path.read_bytes()
    real = sf.write

    def full_disk(file, data, *args, **kw):
        real(file, data, *args, **kw)
        with open(file, "r+b") as f:
            f.truncate(100)
        raise RuntimeError("Error : No space left on device")

    monkeypatch.setattr(audio_mod.sf, "write", full_disk)
    with pytest.raises(RuntimeError, match="No space left"):
        write_audio(path, fake_speech(0.5, seed=1))
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["a.wav"]


# ----------------------------------------------------------------------------------------------
# manifests
# ----------------------------------------------------------------------------------------------
def test_manifest_roundtrip_placeholders_and_column_order(tmp_path):
    rows = [{"wrd": "A B", "ID": "u1", "extra": "x", "duration": 1.25, "spk_id": "s",
             "wav": "$data_root/a/u1.wav"}]
    path = write_manifest(tmp_path / "m.csv", rows)
    assert path.read_text().splitlines()[0] == "ID,duration,wav,spk_id,wrd,extra"
    raw = read_manifest(path)
    assert raw[0]["wav"] == "$data_root/a/u1.wav" and raw[0]["duration"] == 1.25
    resolved = read_manifest(path, replacements={"data_root": "/corpus"})
    assert resolved[0]["wav"] == "/corpus/a/u1.wav"
    with pytest.raises(ManifestError, match="needs \\$data_root"):
        read_manifest(path, replacements={})
    assert resolve_path("$data_root/x.wav", "/r") == "/r/x.wav"
    assert resolve_path("/abs/x.wav") == "/abs/x.wav"


def test_audio_duration_is_the_headers_frames_at_its_rate(tmp_path):
    sf.write(str(tmp_path / "a8k.flac"), np.zeros(4000, dtype=np.float32), 8000)
    assert audio_duration(tmp_path / "a8k.flac") == 0.5
    sf.write(str(tmp_path / "none.wav"), np.zeros(0, dtype=np.float32), SR)
    with pytest.raises(ValueError, match=r"none\.wav: no audio in it \(0 frames\)"):
        audio_duration(tmp_path / "none.wav")


def test_validate_manifest_errors(tmp_path):
    with pytest.raises(ManifestNotFoundError, match="nope.csv"):
        validate_manifest(tmp_path / "nope.csv")
    assert issubclass(ManifestNotFoundError, FileNotFoundError)
    p = tmp_path / "bad.csv"
    p.write_text("ID,wav\nu1,/a.wav\n")
    with pytest.raises(ManifestError, match=r"bad\.csv: missing required column\(s\) duration, "
                                            r"spk_id, wrd"):
        validate_manifest(p)
    p.write_text("ID,duration,wav,spk_id,wrd\nu1,1,/a,s,A\n\nu1,1,/b,s,B\n")
    with pytest.raises(ManifestError, match=r"bad\.csv:4: duplicate ID 'u1' \(first at line 2\)"):
        validate_manifest(p)               # errors name the file's line (a blank line counts)
    p.write_text("ID,duration,wav,spk_id,wrd\nu1,1,/a,s,A\nu2,1,/b,s,B\nu1,1,/c,s,C\n")
    with pytest.raises(ManifestError, match=r"bad\.csv:4: duplicate ID 'u1' \(first at line 2\)"):
        validate_manifest(p)
    p.write_text("ID,duration,wav,spk_id,wrd\nu1,1,/a,s,A\n,1,/b,s,B\n")
    with pytest.raises(ManifestError, match=r"bad\.csv:3: empty ID"):
        validate_manifest(p)
    p.write_text("ID,duration,wav,spk_id,wrd\nu1,x,/a,s,A\n")
    with pytest.raises(ManifestError, match="not a number"):
        validate_manifest(p)
    header = ",".join(STREAM_COLUMNS)
    p.write_text(f"{header}\nu1,1,/a,s,A,AC,0,0\nu2,1,/b,s,B,AC,0,2\n")
    with pytest.raises(ManifestError, match="position"):
        validate_manifest(p, required=STREAM_COLUMNS)
    p.write_text(f"{header}\nu1,1,/a,s,A,AC,0,0\nu2,1,/b,s,B,CM,2,1\n")
    with pytest.raises(ManifestError, match="segment"):
        validate_manifest(p, required=STREAM_COLUMNS)
    p.write_text(f"{header}\nu1,1,/a,s,A,AC,0,0\nu1,1,/a,s,A,CM,1,1\n")
    assert len(validate_manifest(p, required=STREAM_COLUMNS)) == 2  # streams may repeat an ID


# ----------------------------------------------------------------------------------------------
# LibriSpeech
# ----------------------------------------------------------------------------------------------
def test_prepare_librispeech(tmp_path):
    utts = make_librispeech(tmp_path / "ls")
    out = tmp_path / "data" / "test_other.csv"
    prepare_librispeech(tmp_path / "ls", out, data_root=tmp_path / "ls")
    rows = validate_manifest(out)
    assert [r["ID"] for r in rows] == sorted(utts)
    for r in rows:
        path, text = utts[r["ID"]]
        assert r["wrd"] == text and r["spk_id"] == r["ID"].split("-")[0]
        assert r["wav"] == "$data_root/" + path.relative_to(tmp_path / "ls").as_posix()
        assert r["duration"] == pytest.approx(sf.info(str(path)).duration, abs=1e-3)
    # same options: skipped (file untouched); another option: rewritten with absolute paths
    mtime = out.stat().st_mtime_ns
    prepare_librispeech(tmp_path / "ls", out, data_root=tmp_path / "ls")
    assert out.stat().st_mtime_ns == mtime
    time.sleep(0.01)
    prepare_librispeech(tmp_path / "ls", out, data_root=tmp_path / "ls", skip_existing=False)
    assert out.stat().st_mtime_ns != mtime                      # asked: rewritten all the same
    prepare_librispeech(tmp_path / "ls", out)           # only data_root left out: not up to date
    assert read_manifest(out)[0]["wav"].startswith(str(tmp_path))
    prepare_librispeech(tmp_path / "ls", out, data_root=tmp_path / "ls")
    prepare_librispeech(tmp_path / "ls" / "LibriSpeech", out)  # root may be LibriSpeech/ itself
    assert read_manifest(out)[0]["wav"].startswith(str(tmp_path))


def test_prepare_librispeech_content_keyed(tmp_path, caplog, monkeypatch):
    utts = make_librispeech(tmp_path / "ls", speakers=(11,), utts=3)
    out = tmp_path / "m.csv"
    prepare_librispeech(tmp_path / "ls", out)
    rec = tmp_path / "m.csv.opts.json"
    record = json.loads(rec.read_text())
    assert record["format"] == 2 and record["step"] == "librispeech"
    assert len(record["inputs"]) == 4  # 3 .flac + 1 .trans.txt, by sha1
    mtime = out.stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        prepare_librispeech(tmp_path / "ls", out)
    assert "up to date" in caplog.text and out.stat().st_mtime_ns == mtime
    # the inputs' hashes are kept beside the manifest for the next run (files older than the
    # racy margin: here every file)
    monkeypatch.setattr(cache, "RACY_MARGIN_NS", 0)
    prepare_librispeech(tmp_path / "ls", out)
    assert len(json.loads((tmp_path / cache.HASH_CACHE_NAME).read_text())["files"]) == 4
    # a transcript corrected in place: the manifest is rewritten, the log says which file
    trans = next((tmp_path / "ls").rglob("*.trans.txt"))
    utt = sorted(utts)[0]
    trans.write_text(trans.read_text().replace(utts[utt][1], "CORRECTED TEXT"))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        prepare_librispeech(tmp_path / "ls", out)
    rel = trans.relative_to(tmp_path / "ls" / "LibriSpeech" / "test-other").as_posix()
    assert f"m.csv: input file {rel} changed (sha1 " in caplog.text
    assert read_manifest(out)[0]["wrd"] == "CORRECTED TEXT"
    # an audio file replaced by a longer one: new duration
    sf.write(str(utts[utt][0]), fake_speech(1.5, seed=3), SR, subtype="PCM_16")
    prepare_librispeech(tmp_path / "ls", out)
    assert read_manifest(out)[0]["duration"] == pytest.approx(1.5)
    # the record of the previous version (options only): rewritten with a log line, no error
    rec.write_text(json.dumps(record["options"]))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        prepare_librispeech(tmp_path / "ls", out)
    assert "is from an older version (options only, no content hashes), writing" in caplog.text
    assert json.loads(rec.read_text())["format"] == 2


def test_prepare_librispeech_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="set LIBRISPEECH="):
        prepare_librispeech(tmp_path / "nowhere", tmp_path / "o.csv")
    with pytest.raises(FileNotFoundError, match="LIBRISPEECH"):
        prepare_librispeech("", tmp_path / "o.csv")
    utts = make_librispeech(tmp_path / "ls", speakers=(11,), utts=2)
    gone = next(iter(utts))
    utts[gone][0].unlink()
    with pytest.raises(ValueError, match=re.escape(
            f"0 audio file(s) without transcript [] and 1 transcript(s) without audio "
            f"['{gone}']")):
        prepare_librispeech(tmp_path / "ls", tmp_path / "o.csv")
    # the other way round: a transcript line missing (its audio would have had no reference)
    make_librispeech(tmp_path / "ls2", speakers=(11,), utts=2)
    trans = next((tmp_path / "ls2").rglob("*.trans.txt"))
    first, *rest = trans.read_text().splitlines(keepends=True)
    trans.write_text("".join(rest))
    with pytest.raises(ValueError, match=re.escape(
            f"1 audio file(s) without transcript ['{first.split()[0]}'] and 0 transcript(s)")):
        prepare_librispeech(tmp_path / "ls2", tmp_path / "o2.csv")


# ----------------------------------------------------------------------------------------------
# MS-SNSD corruption
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def clean_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    make_librispeech(root / "ls", speakers=(7, 8), utts=2)
    noise_dir = make_ms_snsd(root / "snsd")
    manifest = prepare_librispeech(root / "ls", root / "clean.csv")
    return root, noise_dir, manifest


def test_ls_c_table_is_data():
    assert LS_C_NOISES["AC"] == "AirConditioner_6.wav" and LS_C_NOISES["GS"] is None
    assert sorted(LS_C_NOISES) == ["AA", "AC", "BA", "CM", "GS", "MU", "NB", "SD", "TP", "VC"]


def test_corrupt_layout_manifest_and_measured_snr(clean_set, tmp_path):
    root, noise_dir, manifest = clean_set
    out = tmp_path / "ls_c"
    written = corrupt_manifest(manifest, out, snrs=[5, 0], codes=["AC", "GS", "SD"],
                               noise_dir=root / "snsd", data_root=tmp_path)
    assert set(written) == {(c, s) for c in ("AC", "GS", "SD") for s in (5, 0)}
    clean = {r["ID"]: r for r in read_manifest(manifest)}
    for (code, snr), path in written.items():
        assert path == manifest_path(out, code, snr) == out / "manifests" / f"{code}_{snr}dB.csv"
        rows = validate_manifest(path, required=("ID", "duration", "wav", "spk_id", "wrd",
                                                  "domain", "snr", "source_id"))
        assert len(rows) == len(clean)
        for r in rows:
            src = clean[r["source_id"]]
            assert r["ID"] == f"{r['source_id']}_{code}" and r["domain"] == code
            assert r["snr"] == str(snr) and r["wrd"] == src["wrd"]
            assert r["spk_id"] == src["spk_id"] != ""
            wav = out / f"{snr}dB" / code / f"{r['source_id']}.wav"
            assert r["wav"] == f"$data_root/ls_c/{snr}dB/{code}/{r['source_id']}.wav"
            speech = load_audio(src["wav"]).numpy()
            mixed = load_audio(wav).numpy()
            assert mixed.size == speech.size
            if code == "GS":
                noise = gaussian_noise(speech.size, utterance_seed(666, r["source_id"]))
            else:
                noise = tile_or_cut(load_audio(noise_dir / LS_C_NOISES[code]).numpy(), speech.size)
            assert estimate_snr_db(mixed, speech, noise) == pytest.approx(snr, abs=0.1)


def test_corrupt_is_reproducible_and_skips_existing(clean_set, tmp_path):
    root, _, manifest = clean_set
    a = corrupt_manifest(manifest, tmp_path / "a", codes=["GS"], noise_dir=None)
    b = corrupt_manifest(manifest, tmp_path / "b", codes=["GS"])
    for ra, rb in zip(read_manifest(a[("GS", 5)]), read_manifest(b[("GS", 5)])):
        assert (tmp_path / "a" / "5dB" / "GS" / f"{ra['source_id']}.wav").read_bytes() == \
            (tmp_path / "b" / "5dB" / "GS" / f"{rb['source_id']}.wav").read_bytes()
    wav = next((tmp_path / "a" / "5dB" / "GS").glob("*.wav"))
    mtimes = (wav.stat().st_mtime_ns, a[("GS", 5)].stat().st_mtime_ns)
    corrupt_manifest(manifest, tmp_path / "a", codes=["GS"])
    assert (wav.stat().st_mtime_ns, a[("GS", 5)].stat().st_mtime_ns) == mtimes
    # another seed: the files are rewritten, not silently reused
    corrupt_manifest(manifest, tmp_path / "a", codes=["GS"], seed=1)
    assert wav.read_bytes() != (tmp_path / "b" / "5dB" / "GS" / wav.name).read_bytes()


def test_custom_domain_table_from_yaml(clean_set, tmp_path):
    root, noise_dir, manifest = clean_set
    table = tmp_path / "table.yaml"
    table.write_text("HUM: Typing_2\nWN: gaussian\n")
    written = corrupt_manifest(manifest, tmp_path / "syn", snrs=[10], table=table,
                               noise_dir=noise_dir)
    assert set(written) == {("HUM", 10), ("WN", 10)}
    assert (tmp_path / "syn" / "10dB" / "HUM").is_dir()
    with pytest.raises(ValueError, match="unknown domain code"):
        corrupt_manifest(manifest, tmp_path / "x", codes=["AC"], table=table, noise_dir=noise_dir)
    table.write_text("1: gaussian\n")  # a numeric code, as --domains gives it (a string)
    assert set(corrupt_manifest(manifest, tmp_path / "num", table=table, codes=["1"])) == \
        {("1", 5)}
    table.write_text("{}\n")           # nothing to corrupt: said, not an empty success
    with pytest.raises(ValueError, match="a domain table must map domain codes to noise file"):
        corrupt_manifest(manifest, tmp_path / "x", table=table, noise_dir=noise_dir)


@pytest.mark.parametrize("text,expected", [
    ("HUM: Typing_2\n  - bad: [\n", r": not a YAML domain table \(mapping values are not allowed "
                                     r"here, line 2, column 8\)$"),
    ("NO: Typing_2\n", r": domain code NO reads as the YAML boolean False: quote it "
                       r"\('NO': \.\.\.\)$"),
    ("HUM: 5\n", r": domain HUM: 5 is no noise file name \(a file name, or gaussian\)$"),
    ("HUM: [Typing_2]\n", r": domain HUM: \['Typing_2'\] is no noise file name"),
    ("HUM: Typing_2\nWN: gaussian\nHUM: Typing_3\n", r": domain code HUM given twice$"),
    ("1: Typing_2\n'1': Typing_3\n", r": domain code 1 given twice$"),
])
def test_a_domain_table_yaml_mistake_is_one_line_naming_the_file(clean_set, tmp_path, text,
                                                                 expected, capsys):
    """A YAML syntax error and a file name that is no string were tracebacks (ScannerError at
    "<unicode string>", TypeError of a path / 5); a code YAML 1.1 reads as a boolean (NO, ON,
    YES, OFF) silently became the domain "False" / "True", folders and manifests named so; a
    code given twice silently kept its last file name."""
    root, noise_dir, manifest = clean_set
    table = tmp_path / "table.yaml"
    table.write_text(text)
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--noise_dir", str(noise_dir), "--domain_table", str(table)]) == 1
    err = capsys.readouterr().err.strip()
    assert re.match("^ERROR: " + re.escape(str(table)) + expected, err), err
    assert not (tmp_path / "c").exists()


def test_a_fractional_snr_has_its_own_files(clean_set, tmp_path):
    """2 and 2.5 dB are two sets: neither overwrites the other's manifest or mixtures (and 2.0,
    as the command line gives it, is tagged 2)."""
    _, _, manifest = clean_set
    written = corrupt_manifest(manifest, tmp_path / "o", snrs=[2.0, 2.5], table={"WN": None})
    assert written[("WN", 2.5)].name == "WN_2.5dB.csv" and written[("WN", 2)].name == "WN_2dB.csv"
    for snr, tag in ((2, "2"), (2.5, "2.5")):
        rows = read_manifest(written[("WN", snr)])
        assert {r["snr"] for r in rows} == {tag}
        assert all(Path(r["wav"]).parent == tmp_path / "o" / f"{tag}dB" / "WN" for r in rows)
    assert len(list((tmp_path / "o").glob("*dB/WN/*.wav"))) == 2 * len(rows)


def test_corrupt_errors(clean_set, tmp_path):
    root, _, manifest = clean_set
    with pytest.raises(FileNotFoundError, match="MS_SNSD"):
        corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=None)
    empty = tmp_path / "empty_snsd" / "noise_test"
    empty.mkdir(parents=True)
    sf.write(str(empty / "Other.wav"), np.ones(10, dtype=np.float32) * 0.1, SR)
    with pytest.raises(FileNotFoundError, match="AirConditioner_6.wav.*check MS_SNSD"):
        corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=empty.parent)


def test_noise_folder_is_noise_test_or_the_folder_itself(clean_set, tmp_path):
    """An MS-SNSD clone's noise_test/ is used before noise files beside it, an empty noise_test/
    is passed over, and a folder of .flac noises is one (the table names the .flac file)."""
    _, _, manifest = clean_set
    root = tmp_path / "noises"
    (root / "noise_test").mkdir(parents=True)
    sf.write(str(root / "hum.wav"), fake_noise(0.25, 3), SR)
    assert find_noise_dir(root) == root            # noise_test/ is empty
    sf.write(str(root / "noise_test" / "hum.wav"), fake_noise(0.25, 4), SR)
    assert find_noise_dir(root) == root / "noise_test"
    flac = tmp_path / "flac"
    flac.mkdir()
    sf.write(str(flac / "hum.flac"), fake_noise(0.25, 5), SR)
    written = corrupt_manifest(manifest, tmp_path / "o", table={"HUM": "hum.flac"},
                               noise_dir=flac)
    assert len(read_manifest(written[("HUM", 5)])) == len(read_manifest(manifest))


def test_corrupt_at_another_sample_rate(small_set, tmp_path):
    """--sample_rate 8000: speech and noise are read at 8 kHz and the mixtures written at it."""
    manifest, noise_dir = small_set
    out = tmp_path / "c8"
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(out), "--domains",
                         "AC", "GS", "--noise_dir", str(noise_dir), "--sample_rate", "8000"]) == 0
    clean = {r["ID"]: r for r in read_manifest(manifest)}
    for code in ("AC", "GS"):
        for r in read_manifest(manifest_path(out, code, 5)):
            assert sf.info(r["wav"]).samplerate == 8000
            speech = load_audio(clean[r["source_id"]]["wav"], 8000).numpy()
            mixed = load_audio(r["wav"], 8000).numpy()
            assert mixed.size == speech.size
            noise = gaussian_noise(speech.size, utterance_seed(666, r["source_id"])) \
                if code == "GS" else tile_or_cut(load_audio(noise_dir / LS_C_NOISES[code],
                                                            8000).numpy(), speech.size)
            assert estimate_snr_db(mixed, speech, noise) == pytest.approx(5, abs=0.1)


def test_corrupt_names_a_silent_utterance(small_set, tmp_path):
    """An all-zero clean file stopped the stage with 'cannot normalise a silent (all-zero)
    signal', naming no file."""
    manifest, noise_dir = small_set
    rows = list(csv.DictReader(open(manifest)))
    silent = Path(rows[1]["wav"])
    data, sr = sf.read(silent)
    sf.write(silent, np.zeros_like(data), sr)
    with pytest.raises(ValueError, match=re.escape(
            f"{silent} (ID {rows[1]['ID']}, AC at 5 dB): cannot normalise a silent (all-zero) "
            f"signal; remove it from the manifest")):
        corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=noise_dir, snrs=[5])


def test_corrupt_names_a_silent_noise_not_the_speech(small_set, tmp_path):
    """An all-zero noise file was blamed on the first speech file ('.../x.flac (ID x, AC at
    5 dB): cannot normalise a silent (all-zero) signal; remove it from the manifest'): removing
    it blamed the next one, and so on."""
    manifest, noise_dir = small_set
    noise = Path(noise_dir) / "AirConditioner_6.wav"
    data, sr = sf.read(noise)
    sf.write(noise, np.zeros_like(data), sr)
    with pytest.raises(ValueError) as err:
        corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=noise_dir, snrs=[5])
    assert str(err.value) == (f"{noise} (noise of domain AC): silent (all-zero), it cannot be "
                              f"mixed at an SNR; replace the file, or leave AC out of --domains")
    # silent only at its start, longer than every utterance: the segment mixed is silent
    rows = list(csv.DictReader(open(manifest)))
    longest = max(float(r["duration"]) for r in rows)
    lead = int((longest + 0.5) * sr)
    sf.write(noise, np.concatenate([np.zeros(lead), 0.1 * np.ones(sr)]), sr)
    with pytest.raises(ValueError) as err:
        corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=noise_dir, snrs=[5])
    msg = str(err.value)
    assert msg.startswith(f"{noise} (noise of domain AC): silent for its first "
                          f"{lead / sr:.2f} s ({lead} samples), the part mixed into an utterance "
                          f"no longer than that (noise is taken from offset 0; here {rows[0]['wav']}")
    assert msg.endswith(f"{len(rows)} of the {len(rows)} utterances are that short by their "
                        f"manifest duration), which then cannot be set to an SNR; trim the "
                        f"silence from the start of the file, or leave AC out of --domains")
    assert "remove it from the manifest" not in msg and "\n" not in msg
    # silent for exactly the shortest utterance's samples: that one gets silence only
    sizes = {r["wav"]: sf.info(r["wav"]).frames for r in rows}
    shortest = min(sizes, key=sizes.get)
    sf.write(noise, np.concatenate([np.zeros(sizes[shortest]), 0.1 * np.ones(sr)]), sr)
    with pytest.raises(ValueError, match=re.escape(
            f"{noise} (noise of domain AC): silent for its first {sizes[shortest] / sr:.2f} s "
            f"({sizes[shortest]} samples), the part mixed into an utterance no longer than that "
            f"(noise is taken from offset 0; here {shortest}")):
        corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=noise_dir, snrs=[5])
    # a silent start shorter than the utterances: mixed as before
    sf.write(noise, np.concatenate([np.zeros(100), 0.1 * np.ones(sr)]), sr)
    corrupt_manifest(manifest, tmp_path / "o", codes=["AC"], noise_dir=noise_dir, snrs=[5])


def _mtimes(folder):
    return {f.name: f.stat().st_mtime_ns for f in sorted(Path(folder).iterdir())}


def _sha1(path):
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def small_set(tmp_path):
    """A clean manifest and noise folder of its own (the tests below modify them)."""
    make_librispeech(tmp_path / "ls", speakers=(7, 8), utts=2)
    noise_dir = make_ms_snsd(tmp_path / "snsd", names=("AirConditioner_6", "ShuttingDoor_6"))
    manifest = prepare_librispeech(tmp_path / "ls", tmp_path / "clean.csv")
    return manifest, noise_dir


def test_corrupt_replaced_noise_remixes_only_its_domain(small_set, tmp_path, caplog):
    manifest, noise_dir = small_set
    out = tmp_path / "c"
    kw = dict(codes=["AC", "SD", "GS"], noise_dir=noise_dir)
    corrupt_manifest(manifest, out, **kw)
    ac_noise = noise_dir / "AirConditioner_6.wav"
    before = {d: _mtimes(out / "5dB" / d) for d in ("AC", "SD", "GS")}
    ac_audio = {f: (out / "5dB" / "AC" / f).read_bytes() for f in before["AC"]}
    manifests = _mtimes(out / "manifests")
    # unchanged rerun: everything skipped, nothing rewritten
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, **kw)
    for d in ("AC", "SD", "GS"):
        assert f"{d}_5dB: up to date" in caplog.text and _mtimes(out / "5dB" / d) == before[d]
    assert "skipping" in caplog.text and _mtimes(out / "manifests") == manifests
    # the AC noise file replaced in place (same length, so same size)
    old_sha = _sha1(ac_noise)
    size = ac_noise.stat().st_size
    sf.write(str(ac_noise), fake_noise(0.25, seed=99, kind=2), SR, subtype="PCM_16")
    assert ac_noise.stat().st_size == size
    caplog.clear()
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, **kw)
    assert (f"AC_5dB: noise {ac_noise.resolve()} changed (sha1 {old_sha[:8]} -> "
            f"{_sha1(ac_noise)[:8]}), remixing all 4 utterances") in caplog.text
    assert "SD_5dB: up to date" in caplog.text and "GS_5dB: up to date" in caplog.text
    for f, data in ac_audio.items():
        assert (out / "5dB" / "AC" / f).read_bytes() != data  # remixed with the new noise
    assert _mtimes(out / "5dB" / "SD") == before["SD"]  # the other domains were not touched
    assert _mtimes(out / "5dB" / "GS") == before["GS"]
    # and the remixed audio is the new noise at the asked SNR
    clean = {r["ID"]: r for r in read_manifest(manifest)}
    for r in read_manifest(out / "manifests" / "AC_5dB.csv"):
        speech = load_audio(clean[r["source_id"]]["wav"]).numpy()
        noise = tile_or_cut(load_audio(ac_noise).numpy(), speech.size)
        mixed = load_audio(out / "5dB" / "AC" / f"{r['source_id']}.wav").numpy()
        assert estimate_snr_db(mixed, speech, noise) == pytest.approx(5, abs=0.1)


def test_corrupt_changed_option_speech_or_data_root(small_set, tmp_path, caplog):
    manifest, noise_dir = small_set
    out = tmp_path / "c"
    kw = dict(codes=["AC", "GS"], noise_dir=noise_dir)
    corrupt_manifest(manifest, out, **kw)
    gs = {f: (out / "5dB" / "GS" / f).read_bytes() for f in _mtimes(out / "5dB" / "GS")}
    ac = _mtimes(out / "5dB" / "AC")
    # another seed: the Gaussian domain is remixed; a noise-file mixture does not use the seed
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, seed=1, **kw)
    assert "GS_5dB: seed changed (666 -> 1), remixing all 4 utterances" in caplog.text
    assert "AC_5dB: up to date" in caplog.text and _mtimes(out / "5dB" / "AC") == ac
    assert all((out / "5dB" / "GS" / f).read_bytes() != data for f, data in gs.items())
    # another data_root: only the manifests change
    wavs = {d: _mtimes(out / "5dB" / d) for d in ("AC", "GS")}
    caplog.clear()
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, seed=1, data_root=tmp_path, **kw)
    assert "AC_5dB: manifest rows differ" in caplog.text and "manifest only" in caplog.text
    assert {d: _mtimes(out / "5dB" / d) for d in ("AC", "GS")} == wavs
    assert read_manifest(out / "manifests" / "AC_5dB.csv")[0]["wav"].startswith("$data_root/c/")
    # one speech file replaced: that utterance is remixed in every domain, nothing else
    src = read_manifest(manifest)[1]
    old_sha = _sha1(src["wav"])
    sf.write(src["wav"], fake_speech(0.7, seed=123), SR, subtype="PCM_16")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, seed=1, data_root=tmp_path, **kw)
    for d in ("AC", "GS"):
        assert (f"{d}_5dB: speech {src['wav']} changed (sha1 {old_sha[:8]} -> "
                f"{_sha1(src['wav'])[:8]}), remixing 1 of 4 utterances") in caplog.text
        now = _mtimes(out / "5dB" / d)
        assert [f for f in now if now[f] != wavs[d][f]] == [f"{src['ID']}.wav"]
        mixed = load_audio(out / "5dB" / d / f"{src['ID']}.wav")
        assert mixed.numel() == int(0.7 * SR)  # made from the new speech
    # a deleted mixture file is made again
    (out / "5dB" / "AC" / f"{src['ID']}.wav").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, seed=1, data_root=tmp_path, **kw)
    assert "AC_5dB: 1 mixture file(s) missing" in caplog.text
    assert (out / "5dB" / "AC" / f"{src['ID']}.wav").is_file()


def test_corrupt_old_record_or_interrupted_run_redoes_with_a_log_line(small_set, tmp_path,
                                                                      caplog, monkeypatch):
    manifest, noise_dir = small_set
    out = tmp_path / "c"
    corrupt_manifest(manifest, out, codes=["GS"])
    rec = out / "manifests" / "GS_5dB.csv.opts.json"
    # the record the previous version wrote: the options only
    old = json.loads(rec.read_text())["options"]
    rec.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    wav = next((out / "5dB" / "GS").glob("*.wav"))
    wav.write_bytes(b"stale")  # stands for audio made from other inputs
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, codes=["GS"])
    assert (f"GS_5dB: cache record {rec} is from an older version (options only, no content "
            "hashes), remixing all 4 utterances") in caplog.text
    assert load_audio(wav).numel() > 0
    record = json.loads(rec.read_text())
    assert record["format"] == 2 and record["options"] == old and "pending" not in record
    assert len(record["speech"]) == 4 and record["audio"]["kind"] == "gaussian"
    # interrupted after two files: the record says what is left, the rerun finishes it
    from tta_brain.data import audio as audio_mod
    real_write, calls = audio_mod.write_audio, []

    def failing_write(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(args[0])
        return real_write(*args, **kwargs)

    monkeypatch.setattr(audio_mod, "write_audio", failing_write)
    with pytest.raises(KeyboardInterrupt):
        corrupt_manifest(manifest, out, codes=["GS"], seed=5)
    assert len(json.loads(rec.read_text())["pending"]) == 4
    monkeypatch.setattr(audio_mod, "write_audio", real_write)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        corrupt_manifest(manifest, out, codes=["GS"], seed=5)
    assert ("GS_5dB: 4 utterance(s) pending in an interrupted run, remixing all 4 "
            "utterances") in caplog.text
    assert "pending" not in json.loads(rec.read_text())
    fresh = corrupt_manifest(manifest, tmp_path / "fresh", codes=["GS"], seed=5)
    for r in read_manifest(fresh[("GS", 5)]):
        name = f"{r['source_id']}.wav"
        assert (out / "5dB" / "GS" / name).read_bytes() == \
            (tmp_path / "fresh" / "5dB" / "GS" / name).read_bytes()


def test_corrupt_rerun_reads_no_unchanged_file(small_set, tmp_path, monkeypatch):
    manifest, noise_dir = small_set
    monkeypatch.setattr(cache, "RACY_MARGIN_NS", 0)  # the files were written a moment ago
    out = tmp_path / "c"
    corrupt_manifest(manifest, out, codes=["AC", "GS"], noise_dir=noise_dir)
    read = []
    real = cache.file_sha1
    monkeypatch.setattr(cache, "file_sha1", lambda p, *a: read.append(p) or real(p, *a))
    corrupt_manifest(manifest, out, codes=["AC", "GS"], noise_dir=noise_dir)
    assert read == []  # 4 speech files and 1 noise file: all answered by the hash cache
    time.sleep(0.05)
    ac_noise = noise_dir / "AirConditioner_6.wav"
    st = ac_noise.stat()
    sf.write(str(ac_noise), fake_noise(0.25, seed=7, kind=0), SR, subtype="PCM_16")
    os.utime(ac_noise, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime (cp -p)
    corrupt_manifest(manifest, out, codes=["AC", "GS"], noise_dir=noise_dir)
    assert read == [str(ac_noise)]


# ----------------------------------------------------------------------------------------------
# CHiME-3
# ----------------------------------------------------------------------------------------------
def test_prepare_chime3_default_splits(tmp_path):
    expected = make_chime3(tmp_path / "CHiME3")
    out = prepare_chime3(tmp_path / "CHiME3", tmp_path / "et05.csv", data_root=tmp_path / "CHiME3")
    rows = validate_manifest(out, required=("ID", "duration", "wav", "spk_id", "wrd", "domain"))
    assert {r["domain"] for r in rows} == {"bus_real", "bus_simu", "caf_real", "caf_simu",
                                           "ped_simu", "str_real", "str_simu"}
    assert len(rows) == 14
    for r in rows:
        assert r["wrd"] == expected[r["ID"]]  # .PERIOD of the simulated transcripts removed
        kind = r["domain"].split("_")[1]
        assert r["ID"].endswith("_" + kind.upper())
        assert r["wav"].startswith(f"$data_root/data/audio/16kHz/enhanced/et05_{r['domain']}/")
        assert r["spk_id"] in ("F05", "F06")
    all8 = prepare_chime3(tmp_path / "CHiME3", tmp_path / "all.csv", include_ped_real=True)
    assert len(read_manifest(all8)) == 16


def test_prepare_chime3_trn_all_raw_text_and_errors(tmp_path):
    make_chime3(tmp_path / "c", transcripts="trn_all")
    rows = read_manifest(prepare_chime3(tmp_path / "c", tmp_path / "m.csv", clean_text=False))
    simu = [r for r in rows if r["domain"].endswith("simu")]
    real = [r for r in rows if r["domain"].endswith("real")]
    assert simu and all(r["wrd"].endswith(".PERIOD") for r in simu)
    assert real and not any(r["wrd"].endswith(".PERIOD") for r in real)  # et05_real.trn_all
    # the clean-up asked for after a raw run: redone, not kept as up to date
    clean = read_manifest(prepare_chime3(tmp_path / "c", tmp_path / "m.csv"))
    assert not any(r["wrd"].endswith(".PERIOD") for r in clean)
    # a pooled transcript corrected: the manifest is redone (the .trn_all files are inputs)
    pooled = tmp_path / "c" / "data" / "transcriptions" / "et05_real.trn_all"
    name = pooled.read_text().split()[0]
    pooled.write_text(pooled.read_text().replace(f"{name} ", f"{name} CORRECTED ", 1))
    again = read_manifest(prepare_chime3(tmp_path / "c", tmp_path / "m.csv"))
    assert [r["wrd"] for r in again if r["ID"] == f"{name}_REAL"][0].startswith("CORRECTED ")
    assert clean_transcript('THE RATE ,COMMA <NOISE> "QUOTE ROSE .PERIOD') == "THE RATE ROSE"
    assert clean_transcript("DON'T STOP") == "DON'T STOP"
    with pytest.raises(FileNotFoundError, match="set CHIME3="):
        prepare_chime3(tmp_path / "missing", tmp_path / "m2.csv")
    make_chime3(tmp_path / "d", splits=("bus_real",))
    next((tmp_path / "d" / "data" / "transcriptions" / "et05_bus_real").glob("*.trn")).unlink()
    with pytest.raises(FileNotFoundError, match="no transcript"):
        prepare_chime3(tmp_path / "d", tmp_path / "m3.csv", splits=["bus_real"])
    with pytest.raises(FileNotFoundError, match="no split 'bus_rael': .*enhanced has bus_real$"):
        prepare_chime3(tmp_path / "d", tmp_path / "m4.csv", splits=["bus_rael"])
    (tmp_path / "d" / "data" / "audio" / "16kHz" / "enhanced" / "et05_caf_real").mkdir()
    with pytest.raises(FileNotFoundError, match="no .wav files"):
        prepare_chime3(tmp_path / "d", tmp_path / "m4.csv", splits=["caf_real"])


def test_prepare_chime3_content_keyed(tmp_path, caplog):
    make_chime3(tmp_path / "c", splits=("bus_real", "bus_simu"))
    out = prepare_chime3(tmp_path / "c", tmp_path / "m.csv", splits=["bus_real", "bus_simu"])
    mtime = out.stat().st_mtime_ns
    with caplog.at_level(logging.INFO):
        prepare_chime3(tmp_path / "c", out, splits=["bus_real", "bus_simu"])
    assert "up to date" in caplog.text and out.stat().st_mtime_ns == mtime
    trn = sorted((tmp_path / "c" / "data" / "transcriptions" / "et05_bus_real").glob("*.trn"))[0]
    name = trn.stem
    trn.write_text(f"{name} NEW WORDS\n")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        prepare_chime3(tmp_path / "c", out, splits=["bus_real", "bus_simu"])
    assert f"input file data/transcriptions/et05_bus_real/{name}.trn changed" in caplog.text
    assert {r["ID"]: r["wrd"] for r in read_manifest(out)}[f"{name}_REAL"] == "NEW WORDS"


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def test_cli_streams_written_once(clean_set, tmp_path, capsys):
    root, noise_dir, manifest = clean_set
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--domains", "GS", "AC", "CM", "--noise_dir", str(noise_dir)]) == 0
    args = ["streams", "--manifest_dir", str(tmp_path / "c" / "manifests"), "--snr", "5",
            "--out", str(tmp_path / "s"), "--per_domain", "2"]
    assert prepare.main(args + ["--names", "GS", "mini=md_easy", "--seed", "1"]) == 1
    err = capsys.readouterr().err                     # md_easy needs TP: a message, no traceback
    assert "ERROR: stream mini: multi_domain: no utterances for domain 'TP' (have: AC, CM, GS; " \
           "this stream's domains: AC, CM, TP, AA, SD); its noisy sets are made by `corrupt " \
           "--domains` (the recipes' --domains)" in err, err
    assert prepare.main(args + ["--names", "GS", "--seed", "1"]) == 0
    gs = tmp_path / "s" / "streams" / "GS.csv"
    first = gs.read_text()
    assert prepare.main(args + ["--names", "GS", "--seed", "1"]) == 0  # same options: kept
    assert prepare.main(args + ["--names", "GS", "--seed", "2"]) == 1  # other options: refused
    assert "written once" in capsys.readouterr().err
    assert gs.read_text() == first
    assert prepare.main(args + ["--names", "GS", "--seed", "2", "--force"]) == 0
    assert gs.read_text() != first
    assert prepare.main(["validate", str(gs), "--stream"]) == 0
    assert "OK, 4 rows" in capsys.readouterr().out


def test_cli_streams_follow_source_manifest_content(clean_set, tmp_path, capsys, caplog):
    root, noise_dir, manifest = clean_set
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--domains", "GS"]) == 0
    args = ["streams", "--manifest_dir", str(tmp_path / "c" / "manifests"), "--snr", "5",
            "--out", str(tmp_path / "s"), "--names", "GS"]
    assert prepare.main(args) == 0
    gs = tmp_path / "s" / "streams" / "GS.csv"
    rec = tmp_path / "s" / "streams" / "GS.csv.opts.json"
    first = gs.read_text()
    # a record of the previous version (options only), stream unchanged: kept, record migrated
    rec.write_text(json.dumps(json.loads(rec.read_text())["options"]))
    with caplog.at_level(logging.INFO):
        assert prepare.main(args) == 0
    assert "older version" in caplog.text and "a rebuild gives the same stream" in caplog.text
    assert json.loads(rec.read_text())["format"] == 2 and gs.read_text() == first
    # a source manifest edited (a transcript corrected): the stream would change -> refused
    src = tmp_path / "c" / "manifests" / "GS_5dB.csv"
    rows = read_manifest(src)
    rows[0]["wrd"] = "FIXED"
    write_manifest(src, rows)
    capsys.readouterr()
    assert prepare.main(args) == 1
    err = capsys.readouterr().err
    assert f"input file {src.resolve()} changed (sha1" in err and "written once" in err
    assert gs.read_text() == first
    assert prepare.main(args + ["--force"]) == 0
    assert "FIXED" in gs.read_text()


def test_cli_md_streams_follow_their_sizes_and_every_domain_they_draw_from(clean_set, tmp_path,
                                                                          capsys):
    """Another --per_domain, or a transcript corrected in the domain an md_easy order ends with
    (and md_long draws from last), is not 'up to date': each stream's record holds its sizes
    and every domain manifest it draws from, so the rebuilds are refused (written once)."""
    _, noise_dir, manifest = clean_set
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--domains", "GS", "AC", "--noise_dir", str(noise_dir)]) == 0
    args = ["streams", "--manifest_dir", str(tmp_path / "c" / "manifests"), "--out",
            str(tmp_path / "s"), "--names", "md_easy", "md_long", "--md_easy_order", "AC", "GS",
            "--total", "6", "--min_len", "1", "--max_len", "3", "--md_long_domains", "GS", "AC"]
    assert prepare.main(args + ["--per_domain", "2"]) == 0
    capsys.readouterr()
    assert prepare.main(args + ["--per_domain", "1"]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 's' / 'streams' / 'md_easy.csv'} exists and a rebuild differs" in err
    src = tmp_path / "c" / "manifests" / "GS_5dB.csv"
    write_manifest(src, [dict(r, wrd="FIXED") for r in read_manifest(src)])
    assert prepare.main(args + ["--per_domain", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ERROR: 2 streams in {tmp_path / 's' / 'streams'} exist and a "
                          "rebuild differs from them (md_easy, md_long; e.g. md_easy.csv: "
                          f"input file {src.resolve()} changed (sha1"), err


def test_cli_streams_default_names(tmp_path, caplog):
    """Without --names: every domain's single-domain stream and all MD presets from
    --manifest_dir, one 'random' stream from a --manifest (e.g. CHiME-3)."""
    make_librispeech(tmp_path / "ls", speakers=(7, 8, 9, 10, 11), utts=5)  # 25: md_easy_s20
    manifest = prepare_librispeech(tmp_path / "ls", tmp_path / "clean.csv")
    table = tmp_path / "table.yaml"                # the LS-C codes, all Gaussian (fast)
    table.write_text("".join(f"{code}: gaussian\n" for code in LS_C_NOISES))
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--domain_table", str(table)]) == 0
    assert prepare.main(["streams", "--manifest_dir", str(tmp_path / "c" / "manifests"), "--out",
                         str(tmp_path / "s"), "--per_domain", "25", "--total", "6", "--min_len",
                         "1", "--max_len", "3"]) == 0
    assert sorted(p.stem for p in (tmp_path / "s" / "streams").glob("*.csv")) == \
        sorted(list(LS_C_NOISES) + list(prepare.DEFAULT_STREAMS))
    assert "no stream of" not in caplog.text      # every size option was taken by some stream
    one = tmp_path / "c" / "manifests" / "GS_5dB.csv"
    assert prepare.main(["streams", "--manifest", str(one), "--out", str(tmp_path / "r")]) == 0
    assert [p.name for p in (tmp_path / "r" / "streams").glob("*.csv")] == ["random.csv"]
    assert len(read_manifest(tmp_path / "r" / "streams" / "random.csv")) == \
        len(read_manifest(manifest))


def test_cli_streams_refusal_names_every_differing_stream(clean_set, tmp_path, capsys):
    """Only the first differing stream was named (delete, rerun, next one ...), and the advice
    named the python CLI's options even when a recipe called it."""
    root, noise_dir, manifest = clean_set
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--domains", "GS", "AC", "--noise_dir", str(noise_dir)]) == 0
    out = tmp_path / "s"
    args = ["streams", "--manifest_dir", str(tmp_path / "c" / "manifests"), "--out", str(out),
            "--names", "AC", "GS", "--seed", "1"]
    assert prepare.main(args) == 0
    capsys.readouterr()
    first = {n: (out / "streams" / f"{n}.csv").read_text() for n in ("AC", "GS")}
    assert prepare.main(args[:-1] + ["2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"ERROR: 2 streams in {out / 'streams'} exist and a rebuild differs from them (AC, GS; "
        f"e.g. AC.csv: ")
    assert err.endswith("streams are written once (every method must decode the same stream): "
                        "delete them, use another --out, or pass --force\n")
    assert prepare.main(args[:-1] + ["2", "--names", "AC", "--rebuild_hint",
                                     "or rerun run.sh with --force_streams true"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ERROR: {out / 'streams' / 'AC.csv'} exists and a rebuild differs")
    assert err.endswith(": delete it, or rerun run.sh with --force_streams true\n")
    assert {n: (out / "streams" / f"{n}.csv").read_text() for n in ("AC", "GS")} == first
    assert prepare.main(args[:-1] + ["2", "--force"]) == 0
    assert all((out / "streams" / f"{n}.csv").read_text() != first[n] for n in ("AC", "GS"))


def test_cli_streams_size_errors_say_what_to_pass(clean_set, tmp_path, capsys):
    """Every stream error ended with 'its noisy sets are made by `corrupt --domains`', also
    those about sizes, where the domains are all there."""
    root, noise_dir, manifest = clean_set
    assert prepare.main(["corrupt", "--manifest", str(manifest), "--out", str(tmp_path / "c"),
                         "--domains", "GS", "AC", "CM", "TP", "AA", "SD",
                         "--noise_dir", str(noise_dir)]) == 0
    n = len(read_manifest(manifest))
    args = ["streams", "--manifest_dir", str(tmp_path / "c" / "manifests"), "--out",
            str(tmp_path / "s")]
    capsys.readouterr()
    assert prepare.main(args + ["--names", "md_easy"]) == 1
    err = capsys.readouterr().err
    assert err == (f"ERROR: stream md_easy: domain 'AC' has {n} utterances, fewer than "
                   f"per_domain=500; lower --per_domain to {n} or less\n")
    assert prepare.main(args + ["--names", "x=md_easy_s100", "--max_duration", "20"]) == 1
    err = capsys.readouterr().err
    assert err == (f"ERROR: stream x: domain 'AC' has {n} utterances of at most 20 s "
                   f"(--max_duration), fewer than per_domain=500; this stream needs at least 5 "
                   f"utterances per domain (the 5 cycles through the order) and the smallest "
                   f"domain has {n}: leave the stream out\n")
    assert prepare.main(args + ["--names", "x=md_easy_s20", "--per_domain", "40"]) == 1
    err = capsys.readouterr().err
    assert err == ("ERROR: stream x: stream 'md_easy_s20' cycles 25 times through its order: "
                   "per_domain=40 must be a multiple of 25 (e.g. 25 or 50)\n")
    assert "--domains" not in err


def test_cli_missing_data_message(tmp_path, capsys):
    assert prepare.main(["librispeech", "--root", str(tmp_path / "none"),
                         "--out", str(tmp_path / "x.csv")]) == 1
    assert "set LIBRISPEECH=" in capsys.readouterr().err


def test_cli_streams_from_a_manifest_without_domains_is_one_line(clean_set, tmp_path, capsys):
    """A corpus manifest (no domain column) given to ``streams --manifest``: what it needs, not
    a KeyError traceback, and no stream written."""
    _, _, manifest = clean_set
    assert prepare.main(["streams", "--manifest", str(manifest), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"ERROR: {manifest}: needs a 'domain' column for stream " \
                                      "building\n"
    assert not (tmp_path / "streams").exists()


def test_cli_a_corpus_file_that_is_no_audio_is_one_line_naming_it(tmp_path, capsys):
    """A cut FLAC (an interrupted extraction) or an empty WAV in the corpus was soundfile's
    traceback; nothing is written."""
    make_librispeech(tmp_path / "ls", speakers=(7,), utts=2)
    flac = sorted((tmp_path / "ls").rglob("*.flac"))[1]
    flac.write_bytes(flac.read_bytes()[:30])
    assert prepare.main(["librispeech", "--root", str(tmp_path / "ls"),
                         "--out", str(tmp_path / "ls.csv")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ERROR: {flac}: not readable as audio (") and \
        err[-1].endswith("); a corpus file: extract it again"), err
    make_chime3(tmp_path / "c", splits=("bus_real",))
    wav = sorted((tmp_path / "c").rglob("*.wav"))[0]
    sf.write(str(wav), np.zeros(0), 16000)
    assert prepare.main(["chime3", "--root", str(tmp_path / "c"), "--splits", "bus_real",
                         "--out", str(tmp_path / "c.csv")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"ERROR: {wav}: no audio in it (0 frames); a corpus file: extract it again")
    assert not (tmp_path / "ls.csv").exists() and not (tmp_path / "c.csv").exists()


# ----------------------------------------------------------------------------------------------
# A user's own corpus: what was silently dropped, relabelled or a traceback (probed)
# ----------------------------------------------------------------------------------------------
def test_librispeech_one_utterance_twice_is_refused_naming_both(tmp_path, capsys):
    """A copy of a flac in another chapter folder (or a second transcript line of one ID) kept
    one of them and its text silently: 4 of 5 utterances written, one relabelled."""
    utts = make_librispeech(tmp_path / "ls", speakers=(11,), chapters=(100, 200), utts=2)
    first = tmp_path / "ls" / "LibriSpeech" / "test-other" / "11" / "100"
    trans = first / "11-100.trans.txt"
    trans.write_text(trans.read_text() + "11-100-0001 SECOND VERSION\n")
    out = tmp_path / "o.csv"
    assert prepare.main(["librispeech", "--root", str(tmp_path / "ls"), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"ERROR: {trans}:3: a second transcript of 11-100-0001 (the first: "
                   f"{trans}:2)")
    trans.write_text("\n".join(trans.read_text().splitlines()[:2]) + "\n")
    other = tmp_path / "ls" / "LibriSpeech" / "test-other" / "11" / "200"
    copy = other / "11-100-0000.flac"
    copy.write_bytes(utts["11-100-0000"][0].read_bytes())
    assert prepare.main(["librispeech", "--root", str(tmp_path / "ls"), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"ERROR: two audio files of utterance 11-100-0000: {first}/11-100-0000.flac "
                   f"and {copy}; remove one")
    assert not out.exists()
    copy.unlink()
    trans.write_bytes(trans.read_bytes().replace(b"11-100-0000 ", b"11-100-0000 CAF\xe9 "))
    assert prepare.main(["librispeech", "--root", str(tmp_path / "ls"), "--out", str(out)]) == 1
    assert capsys.readouterr().err.strip().startswith(f"ERROR: {trans}: not UTF-8 text (")
    trans.write_text(trans.read_bytes().decode("latin-1").replace("CAF\xe9 ", ""))
    assert prepare.main(["librispeech", "--root", str(tmp_path / "ls"), "--out", str(out)]) == 0
    assert len(read_manifest(out)) == 4


def test_librispeech_blank_lines_extra_spaces_and_an_id_without_text(tmp_path):
    """Blank lines and extra spaces of a .trans.txt are no part of the text (scoring splits on
    spaces); an ID without its text is refused naming the file and line (it was written as an
    empty reference), with a hint when a tab separates them."""
    utts = make_librispeech(tmp_path / "ls", speakers=(11,), utts=2)
    trans = next((tmp_path / "ls").rglob("*.trans.txt"))
    (a, (_, ta)), (b, (_, tb)) = sorted(utts.items())
    trans.write_text(f"\n  {a}  {ta.replace(' ', '   ')}  \n\n{b} {tb}\n")
    rows = read_manifest(prepare_librispeech(tmp_path / "ls", tmp_path / "o.csv"))
    assert [(r["ID"], r["wrd"]) for r in rows] == [(a, ta), (b, tb)]
    trans.write_text(f"{a} {ta}\n{b}\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(trans))}:2: no transcript for {b}$"):
        prepare_librispeech(tmp_path / "ls", tmp_path / "o.csv")
    trans.write_text(f"{a} {ta}\n{b}\tALPHA\tBRAVO\n")
    with pytest.raises(ValueError, match=re.escape(
            f"{trans}:2: no transcript for {b}\tALPHA\tBRAVO (the ID and its text are separated "
            "by one space)")):
        prepare_librispeech(tmp_path / "ls", tmp_path / "o.csv")


def test_librispeech_where_it_looked_a_split_without_audio_and_a_copied_split(tmp_path,
                                                                            monkeypatch):
    """An unset location says so (the working folder, here holding a split, is not searched); a
    missing split names both folders looked at; a split of transcripts only says it has no
    .flac (not 'N transcripts without audio'); the first three unmatched IDs are listed; another
    split of the same files is its own manifest, not the first one's 'up to date'."""
    monkeypatch.chdir(tmp_path)
    utts = make_librispeech(tmp_path, speakers=(11,), utts=5)
    with pytest.raises(FileNotFoundError, match="^LibriSpeech location not set: set LIBRISPEECH="):
        prepare_librispeech("", tmp_path / "o.csv")
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"split 'dev-clean' not found (looked for {tmp_path}/LibriSpeech/dev-clean and "
            f"{tmp_path}/dev-clean); set LIBRISPEECH=")):
        prepare_librispeech(tmp_path, tmp_path / "o.csv", split="dev-clean")
    split_dir = tmp_path / "LibriSpeech" / "test-other"
    shutil.copytree(split_dir, tmp_path / "LibriSpeech" / "dev-other")
    out = prepare_librispeech(tmp_path, tmp_path / "o.csv")
    prepare_librispeech(tmp_path, out, split="dev-other")
    assert [r["wav"] for r in read_manifest(out)] == [
        str(tmp_path / "LibriSpeech" / "dev-other" / p.relative_to(split_dir))
        for p, _ in (utts[u] for u in sorted(utts))]
    ids = sorted(utts)
    trans = next(split_dir.rglob("*.trans.txt"))
    lines = trans.read_text().splitlines(keepends=True)
    trans.write_text(lines[-1])
    with pytest.raises(ValueError, match=re.escape(
            f"4 audio file(s) without transcript {ids[:3]} and 0 transcript(s) without audio []")):
        prepare_librispeech(tmp_path, tmp_path / "o2.csv")
    trans.write_text("".join(lines))
    for utt in ids[:4]:
        utts[utt][0].unlink()
    with pytest.raises(ValueError, match=re.escape(
            f"{split_dir}: 0 audio file(s) without transcript [] and 4 transcript(s) without "
            f"audio {ids[:3]}; is the split completely unpacked?")):
        prepare_librispeech(tmp_path, tmp_path / "o2.csv")
    utts[ids[4]][0].unlink()
    where = re.escape(str(split_dir))
    with pytest.raises(FileNotFoundError, match=f"^no .flac files under {where}$"):
        prepare_librispeech(tmp_path, tmp_path / "o2.csv")


def test_chime3_damaged_text_two_files_of_one_id_and_empty_transcripts(tmp_path, caplog):
    """A Latin-1 byte became U+FFFD (a space at scoring) silently; X.wav beside X.CH5.wav gave
    one ID twice; a transcript of markers only was written empty without a word."""
    refs = make_chime3(tmp_path / "c", splits=("bus_real",), per_split=2)
    trn_dir = tmp_path / "c" / "data" / "transcriptions" / "et05_bus_real"
    wav_dir = tmp_path / "c" / "data" / "audio" / "16kHz" / "enhanced" / "et05_bus_real"
    trn = sorted(trn_dir.glob("*.trn"))[0]
    good = trn.read_bytes()
    trn.write_bytes(good.replace(b"\n", b" CAF\xe9\n"))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(trn))}: not UTF-8 text \("):
        prepare_chime3(tmp_path / "c", tmp_path / "m.csv", splits=["bus_real"])
    trn.write_bytes(good)
    wav = sorted(wav_dir.glob("*.wav"))[0]
    ch5 = wav.with_name(wav.stem + ".CH5.wav")
    ch5.write_bytes(wav.read_bytes())
    with pytest.raises(ValueError, match=rf"two audio files of utterance {wav.stem}_REAL: "
                                         rf"{re.escape(str(ch5))} and {re.escape(str(wav))}"):
        prepare_chime3(tmp_path / "c", tmp_path / "m.csv", splits=["bus_real"])
    assert not (tmp_path / "m.csv").exists()
    ch5.unlink()
    trn.write_text(f"{wav.stem} <NOISE> .PERIOD\n")
    with caplog.at_level(logging.WARNING, logger="tta_brain.data.prep.chime3"):
        rows = read_manifest(prepare_chime3(tmp_path / "c", tmp_path / "m.csv",
                                            splits=["bus_real"]))
    assert [r["wrd"] for r in rows if r["ID"] == f"{wav.stem}_REAL"] == [""]
    assert f"1 utterance(s) with an empty transcript once markers are dropped (decode skips " \
        f"them, listed in its rejects.csv): {wav.stem}_REAL" in caplog.text
    assert len(rows) == len(refs)


def test_corrupt_refuses_ids_that_are_no_file_names_and_missing_columns(small_set, tmp_path,
                                                                        capsys):
    """An ID '../x' wrote every domain's mixture to one file outside its domain folder (the GS
    manifest named audio mixed with another noise); a manifest without wav/duration was a
    KeyError traceback; a placeholder's advice named no option."""
    manifest, noise_dir = small_set
    rows = read_manifest(manifest)
    args = ["corrupt", "--out", str(tmp_path / "c"), "--domains", "GS", "AC",
            "--noise_dir", str(noise_dir), "--manifest"]
    bad = tmp_path / "bad.csv"
    write_manifest(bad, [dict(rows[0], ID="../x")] + rows[1:])
    assert prepare.main(args + [str(bad)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ERROR: {bad}:2: ID '../x': a mixture is the file <ID>.wav in its domain's folder, so "
        "an ID must be a plain file name (no / or \\, not . or ..)")
    assert not (tmp_path / "c").exists()
    write_manifest(bad, [{k: v for k, v in r.items() if k != "wav"} for r in rows])
    assert prepare.main(args + [str(bad)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ERROR: {bad}: missing required column(s) wav (found: ID, duration, spk_id, wrd)")
    write_manifest(bad, [dict(r, wav="$data_root/" + Path(r["wav"]).name) for r in rows])
    assert prepare.main(args + [str(bad)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ERROR: {bad}:2: '$data_root/{Path(rows[0]['wav']).name}' uses a placeholder; pass the "
        "folder it stands for (--source_data_root)")
    root = manifest.parent / "ls"                 # the placeholder resolved: mixed as before
    write_manifest(bad, [dict(r, wav="$data_root/" + str(Path(r["wav"]).relative_to(root)))
                         for r in rows])
    assert prepare.main(args + [str(bad), "--source_data_root", str(root), "--out",
                                str(tmp_path / "placeholders")]) == 0
    assert len(list((tmp_path / "placeholders" / "5dB" / "AC").glob("*.wav"))) == len(rows)
    capsys.readouterr()
    write_manifest(bad, rows + [dict(rows[0], wrd="ANOTHER TEXT")])
    assert prepare.main(args + [str(bad)]) == 1   # two utterances, one mixture file
    assert capsys.readouterr().err.strip() == (
        f"ERROR: {bad}:{len(rows) + 2}: duplicate ID {rows[0]['ID']!r} (first at line 2; "
        "mixtures are named by ID)")
    # lines are the file's: a blank line counts (they were counted over the rows)
    bad.write_text(manifest_text(rows[:1]) + "\n" + manifest_text([dict(rows[1], ID="a/b")])
                   .split("\n", 1)[1], encoding="utf-8")
    assert prepare.main(args + [str(bad)]) == 1
    assert capsys.readouterr().err.strip().startswith(f"ERROR: {bad}:4: ID 'a/b': ")
    gone = tmp_path / "gone.wav"
    write_manifest(bad, [dict(rows[0], wav=str(gone))] + rows[1:])
    assert prepare.main(args + [str(bad)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"ERROR: {bad}: audio of {rows[0]['ID']} not found: {gone}")
    for snr in ("1e6", "-7000", "151"):
        with pytest.raises(SystemExit):
            prepare.main(args + [str(manifest), "--snrs", snr])
        assert "must be a number of dB from -150 to 150" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()          # no record left behind either
    assert prepare.main(args + [str(manifest), "--snrs", "150", "-150"]) == 0


def test_streams_duration_problems_and_unused_size_options(clean_set, tmp_path, capsys, caplog):
    """--max_duration on a manifest without durations was a KeyError traceback (or 'could not
    convert string to float' naming nothing); --per_domain with only single-domain streams was
    silently unused; validate asked for spk_id, which decode does not need."""
    root, _, manifest = clean_set
    rows = read_manifest(manifest)
    own = tmp_path / "own.csv"
    write_manifest(own, [dict({k: r[k] for k in ("ID", "wav", "wrd")}, duration="",
                              domain="A" if i % 2 else "B") for i, r in enumerate(rows)])
    base = ["streams", "--manifest", str(own), "--out", str(tmp_path / "s")]
    assert prepare.main(base + ["--max_duration", "20"]) == 1
    assert capsys.readouterr().err.strip() == (    # the manifest named (it was not)
        f"ERROR: {own}: utterance {rows[0]['ID']}: duration '' is no number of seconds, which "
        "max_duration needs (a manifest without durations: leave max_duration out)")
    empty = tmp_path / "empty.csv"
    empty.write_text(own.read_text().splitlines()[0] + "\n")
    assert prepare.main(["streams", "--manifest", str(empty), "--out", str(tmp_path / "e")]) == 1
    assert capsys.readouterr().err.strip() == (f"ERROR: {empty}: a header but no rows (no "
                                               f"utterance to build a stream of)")
    with caplog.at_level(logging.WARNING, logger="tta_brain.data.prep.prepare"):
        assert prepare.main(base + ["--names", "A", "B", "--per_domain", "3"]) == 0
    assert "--per_domain: no stream of A B takes it (per_domain: md_easy/md_hard streams" in \
        caplog.text
    assert len(read_manifest(tmp_path / "s" / "streams" / "A.csv")) == len(rows) // 2
    # validate: a stream as decode reads it (no spk_id), every file checked
    mine = tmp_path / "mine.csv"
    write_manifest(mine, [{k: r[k] for k in ("ID", "duration", "wav", "wrd")} for r in rows])
    capsys.readouterr()
    assert prepare.main(["validate", "--stream", str(mine)]) == 0
    assert capsys.readouterr().out == f"{mine}: OK, {len(rows)} rows\n"
    # a recipe's stream names its audio under $data_root: kept, or replaced with --data_root
    held = tmp_path / "held.csv"
    write_manifest(held, [dict({k: r[k] for k in ("ID", "duration", "wrd")}, position=i,
                               wav="$data_root/" + Path(r["wav"]).name)
                          for i, r in enumerate(rows)])
    assert prepare.main(["validate", "--stream", str(held)]) == 0
    assert prepare.main(["validate", "--stream", str(held), "--data_root", "/x"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):               # without --stream it was read by nothing
        prepare.main(["validate", str(held), "--data_root", "/x"])
    assert "validate --data_root: read with --stream only" in capsys.readouterr().err
    assert prepare.main(["validate", str(tmp_path / "none.csv"), str(mine), str(manifest)]) == 1
    out, err = capsys.readouterr()
    assert out == f"{manifest}: OK, {len(rows)} rows\n"
    assert "none.csv" in err.splitlines()[0] and "missing required column(s) spk_id" in \
        err.splitlines()[1] and err.splitlines()[2] == "ERROR: 2 of 3 manifest(s) failed the check"


def test_streams_order_reaches_the_s_variants_and_max_duration_0_is_no_limit(clean_set, tmp_path):
    """--md_easy_order is for md_easy and its s100/s20 variants (a recipe with its own domains
    passes it for all of them), and --max_duration 0 is documented as no limit."""
    _, _, manifest = clean_set
    wav = read_manifest(manifest)[0]["wav"]
    own = tmp_path / "own.csv"
    write_manifest(own, [{"ID": f"u{i}_{d}", "duration": "1.5", "wav": wav, "wrd": "A WORD",
                          "domain": d} for d in ("A", "B") for i in range(6)])
    assert prepare.main(["streams", "--manifest", str(own), "--out", str(tmp_path / "s"),
                         "--names", "x=md_easy_s100", "--md_easy_order", "B", "A",
                         "--per_domain", "5", "--max_duration", "0"]) == 0
    stream = read_manifest(tmp_path / "s" / "streams" / "x.csv")
    assert len(stream) == 10 and stream[0]["domain"] == "B"
    assert {r["domain"] for r in stream} == {"A", "B"}


def test_streams_another_max_duration_is_a_change_not_up_to_date(clean_set, tmp_path, capsys):
    """A stream built without a duration limit and asked for again with --max_duration that
    leaves utterances out: refused as written once (not kept as 'up to date'); --force
    rewrites it without them."""
    _, _, manifest = clean_set
    wav = read_manifest(manifest)[0]["wav"]
    own = tmp_path / "own.csv"
    write_manifest(own, [{"ID": f"u{i}", "duration": "30.0" if i % 2 else "1.5", "wav": wav,
                          "wrd": "A WORD", "domain": "A"} for i in range(6)])
    args = ["streams", "--manifest", str(own), "--out", str(tmp_path / "s"), "--names", "A"]
    assert prepare.main(args) == 0
    capsys.readouterr()
    assert prepare.main(args + ["--max_duration", "20"]) == 1
    assert "written once" in capsys.readouterr().err
    assert len(read_manifest(tmp_path / "s" / "streams" / "A.csv")) == 6
    assert prepare.main(args + ["--max_duration", "20", "--force"]) == 0
    assert len(read_manifest(tmp_path / "s" / "streams" / "A.csv")) == 3


def test_prepare_chime3_logs_the_tokens_clean_text_removes(tmp_path, caplog):
    """The default clean-up is a difference from the official code (raw line scored): stage 0
    says how many tokens it removed from how many references, and which."""
    make_chime3(tmp_path / "c", splits=("bus_real", "bus_simu"), per_split=3)
    with caplog.at_level(logging.INFO, logger="tta_brain.data.prep.chime3"):
        prepare_chime3(tmp_path / "c", tmp_path / "m.csv", splits=["bus_real", "bus_simu"])
    said = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert said and "removed 3 token(s) from 3 of 6 references (.PERIOD x3)" in said[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tta_brain.data.prep.chime3"):
        prepare_chime3(tmp_path / "c", tmp_path / "raw.csv", splits=["bus_real", "bus_simu"],
                       clean_text=False)
    assert not [r for r in caplog.records if "removed" in r.getMessage()]


def test_chime3_transcripts_with_a_tab_after_the_id_keep_their_first_word(tmp_path):
    """``<ID><TAB><TEXT>`` (a transcript saved by a spreadsheet or an editor): the ID was split
    off at the first space, so a .trn's reference silently lost its first word and a .trn_all's
    line was an entry for no utterance ("no transcript for ...")."""
    for transcripts in ("trn", "trn_all"):
        root = tmp_path / transcripts
        refs = make_chime3(root, splits=("bus_real",), transcripts=transcripts)
        for trn in (root / "data" / "transcriptions").rglob("*.trn*"):
            trn.write_text("\n".join(line.replace(" ", "\t", 1)
                                     for line in trn.read_text().splitlines()) + "\n")
        rows = read_manifest(prepare_chime3(root, tmp_path / f"{transcripts}.csv",
                                            splits=["bus_real"]))
        assert {r["ID"]: r["wrd"] for r in rows} == refs


def test_chime3_root_its_parent_odd_transcripts_and_what_the_errors_name(tmp_path, monkeypatch,
                                                                         caplog):
    """An unset location says so (the working folder, here a CHiME-3 root, is not used); the
    parent of CHiME3/ is accepted; data_root alone changes the manifest; an empty .trn is an
    empty reference with a warning (no StopIteration), a raw line loses the spaces after its ID;
    durations are the header's to 0.1 ms; errors name the folder, the .trn and the .trn_all
    looked in, and a misspelt split lists only the splits that have audio."""
    make_chime3(tmp_path / "cwd", splits=("bus_real",))
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(FileNotFoundError, match="^CHiME-3 location not set: set CHIME3="):
        prepare_chime3("", tmp_path / "m.csv", splits=["bus_real"])
    root = tmp_path / "p" / "CHiME3"
    make_chime3(root, splits=("bus_real",), per_split=6)
    out = prepare_chime3(tmp_path / "p", tmp_path / "m.csv", splits=["bus_real"], data_root=root)
    assert all(r["wav"].startswith("$data_root/") for r in read_manifest(out))
    prepare_chime3(tmp_path / "p", out, splits=["bus_real"])
    assert all(r["wav"].startswith(str(root)) for r in read_manifest(out))
    trn_dir = root / "data" / "transcriptions" / "et05_bus_real"
    wav_dir = root / "data" / "audio" / "16kHz" / "enhanced" / "et05_bus_real"
    trns = sorted(trn_dir.glob("*.trn"))
    for trn in trns:
        trn.write_text("")
    trns[0].write_text(f"{trns[0].stem}  TWO SPACES\n")
    sf.write(str(wav_dir / f"{trns[0].stem}.wav"), fake_speech(0.4567, seed=0), SR)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tta_brain.data.prep.chime3"):
        rows = read_manifest(prepare_chime3(tmp_path / "p", out, splits=["bus_real"],
                                            clean_text=False))
    assert [(r["wrd"], r["duration"]) for r in rows][0] == ("TWO SPACES", 0.4567)
    empty = [f"{t.stem}_REAL" for t in trns[1:]]
    assert [r["wrd"] for r in rows[1:]] == [""] * 5
    assert "5 utterance(s) with an empty transcript (decode skips them, listed in its " \
        f"rejects.csv): {', '.join(empty)}" in caplog.text
    trns[0].write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tta_brain.data.prep.chime3"):
        prepare_chime3(tmp_path / "p", out, splits=["bus_real"])
    assert f"6 utterance(s) with an empty transcript once markers are dropped (decode skips " \
        f"them, listed in its rejects.csv): {trns[0].stem}_REAL, {', '.join(empty[:4])} ...\n" \
        in caplog.text
    trns[1].unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"no transcript for {wav_dir / trns[1].stem}.wav: neither {trns[1]} nor an entry "
            f"'{trns[1].stem}' in {root}/data/transcriptions/*.trn_all")):
        prepare_chime3(root, out, splits=["bus_real"])
    (wav_dir.parent / "et05_caf_real").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"no .wav files in {wav_dir.parent / 'et05_caf_real'}; is CHIME3 the CHiME-3 root")):
        prepare_chime3(root, out, splits=["caf_real"])
    with pytest.raises(FileNotFoundError, match="no split 'bus_rael': .*enhanced has bus_real$"):
        prepare_chime3(root, out, splits=["bus_rael"])
    # tokens that start with a digit or an apostrophe are words
    assert clean_transcript("'EM 3RD <NOISE> .PERIOD ROSE") == "'EM 3RD ROSE"
