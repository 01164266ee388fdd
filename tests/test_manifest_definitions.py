"""Manifest rules from tta_brain.data.manifest's docstrings (mutation audit): a stream may repeat
an utterance, durations keep what a 20-s filter needs, ``$data_root`` without a value is an
error, explicit columns refuse fields they would drop, segments start at 0."""
import pytest

from tta_brain.data.manifest import (STREAM_COLUMNS, ManifestError, manifest_text, read_manifest,
                                     validate_manifest, write_manifest)
from tta_brain.data.streams import filter_by_duration, md_long


def rows(n, **extra):
    return [{"ID": f"u{i}", "duration": 1.0, "wav": f"/x/{i}.wav", "spk_id": "s", "wrd": "A",
             **extra} for i in range(n)]


def test_an_md_long_stream_that_reuses_its_utterances_validates(tmp_path):
    # 2 domains x 6 utterances, 40 positions: every utterance recurs (pools refilled)
    doms = {d: [dict(r, ID=f"{r['ID']}_{d}") for r in rows(6)] for d in ("A", "B")}
    stream = md_long(doms, total=40, min_len=3, max_len=8, seed=0)
    assert len({r["ID"] for r in stream}) < len(stream)
    path = write_manifest(tmp_path / "md_long.csv", stream)
    got = validate_manifest(path, required=STREAM_COLUMNS)
    assert [r["ID"] for r in got] == [r["ID"] for r in stream]
    # an utterance manifest still refuses a repeated ID
    write_manifest(tmp_path / "utts.csv", rows(3) + rows(1))
    with pytest.raises(ManifestError, match="duplicate ID 'u0'"):
        validate_manifest(tmp_path / "utts.csv")
    # and a stream's positions are checked by default when position is required
    bad = [dict(r, position=0) for r in stream]
    write_manifest(tmp_path / "bad.csv", bad)
    with pytest.raises(ManifestError, match="position"):
        validate_manifest(tmp_path / "bad.csv", required=STREAM_COLUMNS)


def test_durations_survive_a_write_as_the_20s_filter_needs_them(tmp_path):
    # 320007 samples at 16 kHz: 20.0004375 s, longer than the official 20 s limit
    out = [dict(r, duration=d) for r, d in zip(rows(3), (20.0004375, 0.0, 14.6604375))]
    write_manifest(tmp_path / "m.csv", out)
    back = read_manifest(tmp_path / "m.csv")
    assert [r["ID"] for r in filter_by_duration(back, 20)] == ["u1", "u2"]
    assert back[1]["duration"] == 0.0                  # ">= 0": an empty file is a length
    assert abs(back[2]["duration"] - 14.6604375) < 1e-4


def test_data_root_without_a_value_is_an_error_whatever_else_is_replaced(tmp_path):
    write_manifest(tmp_path / "m.csv", [dict(r, wav=f"$data_root/{i}.wav")
                                        for i, r in enumerate(rows(2))])
    for replacements in ({}, {"noise_root": "/n"}):
        with pytest.raises(ManifestError, match=r"m.csv:2: .*needs \$data_root"):
            read_manifest(tmp_path / "m.csv", replacements=replacements)
    assert read_manifest(tmp_path / "m.csv", replacements={"data_root": "/d"})[1]["wav"] == "/d/1.wav"


def test_explicit_columns_refuse_a_field_they_would_drop():
    with pytest.raises(ValueError, match="not in the columns: 'snr'"):
        manifest_text(rows(1, snr=5), columns=("ID", "duration", "wav", "spk_id", "wrd"))


def test_segments_start_at_zero(tmp_path):
    stream = [dict(r, domain="A", segment=s, position=i)
              for i, (r, s) in enumerate(zip(rows(3), (-1, 0, 0)))]
    write_manifest(tmp_path / "s.csv", stream)
    with pytest.raises(ManifestError, match="segments must start at 0"):
        validate_manifest(tmp_path / "s.csv", required=STREAM_COLUMNS)
