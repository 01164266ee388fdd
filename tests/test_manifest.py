"""Manifest reading (BOM, truncated / malformed lines, quoted values), cache records and the
file hash cache of the preparation steps."""
import errno
import hashlib
import io
import json
import os
import re
import time

import pytest

from tta_brain.data import cache
from tta_brain.data import manifest as manifest_mod
from tta_brain.data.cache import HashCache, file_sha1, load_record, save_record, why_redo
from tta_brain.data.manifest import (STREAM_COLUMNS, UTT_COLUMNS, ManifestError, is_up_to_date,
                                     manifest_text, read_header, read_manifest, save_options,
                                     stored_options, validate_manifest, write_manifest)
from tta_brain.data.streams import filter_by_duration, md_long


def stream_rows(n=10):
    return [{"ID": f"u{i}", "duration": 1.5, "wav": f"$data_root/a/u{i}.wav", "spk_id": "s1",
             "wrd": "HELLO WORLD", "domain": "AC", "segment": 0, "position": i}
            for i in range(n)]


def test_manifest_with_utf8_bom_reads_everywhere(tmp_path):
    text = write_manifest(tmp_path / "plain.csv", stream_rows(3)).read_text(encoding="utf-8")
    path = tmp_path / "export.csv"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # what a spreadsheet writes
    assert read_header(path) == list(STREAM_COLUMNS)
    rows = read_manifest(path, replacements={"data_root": "/d"})
    assert [r["ID"] for r in rows] == ["u0", "u1", "u2"] and rows[0]["wav"] == "/d/a/u0.wav"
    assert "\ufeffID" not in rows[0]
    assert len(validate_manifest(path, required=STREAM_COLUMNS)) == 3
    assert len(validate_manifest(path, required=UTT_COLUMNS)) == 3


def test_truncated_last_line_names_file_and_line(tmp_path):
    path = write_manifest(tmp_path / "s.csv", stream_rows(10))
    data = path.read_bytes()
    last = data.rstrip(b"\r\n").rsplit(b"\n", 1)[1]  # u9,1.5,$data_root/a/u9.wav,s1,HELLO ...
    cut = data[:len(data.rstrip(b"\r\n")) - len(last)] + b",".join(last.split(b",")[:4])
    path.write_bytes(cut)  # e.g. a copy interrupted in the middle of the last row
    expected = (rf"^{re.escape(str(path))}:11: 4 fields, the header has 8 "
                r"\(truncated or malformed line\)$")
    with pytest.raises(ManifestError, match=expected):
        read_manifest(path)
    with pytest.raises(ManifestError, match=expected):
        validate_manifest(path, required=STREAM_COLUMNS)


def test_short_and_long_rows_anywhere_are_errors(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("ID,duration,wav,spk_id,wrd\nu1,1,/a.wav,s,A\nu2,1,/b.wav\nu3,1,/c.wav,s,C\n")
    with pytest.raises(ManifestError, match=rf"^{re.escape(str(path))}:3: 3 fields, the header "
                                            r"has 5 \(truncated or malformed line\)$"):
        read_manifest(path)
    path.write_text("ID,duration,wav,spk_id,wrd\nu1,1,/a.wav,s,A, B\n")
    with pytest.raises(ManifestError, match=r"m\.csv:2: 6 fields, the header has 5 \(malformed "
                                            r"line: a value with an unquoted comma\?\)"):
        read_manifest(path)


def test_quoted_commas_and_newlines_are_one_value(tmp_path):
    path = tmp_path / "q.csv"
    path.write_text('ID,duration,wav,spk_id,wrd\n'
                    'u1,1,/a.wav,s,"WELL, YES"\n'
                    'u2,1,/b.wav,s,"TWO\nLINES"\n'
                    '\n'  # blank lines are skipped, as before
                    'u3,1,/c.wav,s\n')
    with pytest.raises(ManifestError, match=r"q\.csv:6: 4 fields"):  # physical line, not row 4
        read_manifest(path)
    path.write_text(path.read_text().replace("u3,1,/c.wav,s\n", "u3,1,/c.wav,s,C\n"))
    rows = read_manifest(path)
    assert [r["wrd"] for r in rows] == ["WELL, YES", "TWO\nLINES", "C"]
    assert rows[0]["duration"] == 1.0
    write_manifest(tmp_path / "w.csv", rows)      # written quoted: the same values read back
    assert read_manifest(tmp_path / "w.csv") == rows


def test_truncated_inside_quotes_and_other_malformed_files(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('ID,duration,wav,spk_id,wrd\nu1,1,/a.wav,s,A\nu2,1,/b.wav,s,"HELLO WO')
    with pytest.raises(ManifestError, match=r"t\.csv:3: malformed CSV: unexpected end of data "
                                            r"\(truncated file\?\)"):
        read_manifest(path)
    path.write_text("ID,duration,wav,ID,wrd\nu1,1,/a.wav,s,A\n")
    with pytest.raises(ManifestError, match=r"t\.csv:1: column 'ID' appears twice"):
        read_manifest(path)
    path.write_bytes(b"ID,duration,wav,spk_id,wrd\nu1,1,/a.wav,s,CAF\xe9\n")  # Latin-1
    with pytest.raises(ManifestError, match=r"t\.csv:2: not UTF-8 text"):
        read_manifest(path)
    # the line, not the last line before the decoder's chunk (it said "after line 0", or 2990
    # for a bad byte on line 3002)
    good = "".join(f"u{i},1,/a{i}.wav,s,A\n" for i in range(3000))
    path.write_bytes(b"ID,duration,wav,spk_id,wrd\n" + good.encode() + b"u,1,/a.wav,s,CAF\xe9\n")
    with pytest.raises(ManifestError, match=r"t\.csv:3002: not UTF-8 text"):
        read_manifest(path)
    path.write_text("")
    with pytest.raises(ManifestError, match="empty manifest"):
        read_header(path)


def test_snr_and_source_id_follow_the_stream_columns_in_this_order(tmp_path):
    """The written header is the stream columns, then ``snr, source_id``, then the others (in
    first-seen order), whatever the order of the row's keys."""
    row = dict(stream_rows(1)[0], source_id="u0", extra="x", snr=5.0)
    write_manifest(tmp_path / "s.csv", [row])
    assert read_header(tmp_path / "s.csv") == [*STREAM_COLUMNS, "snr", "source_id", "extra"]


def test_a_write_that_fails_keeps_the_manifest_it_would_replace(tmp_path, monkeypatch):
    """A full disk half-way through a rewrite leaves the old manifest as it was (the text goes to
    a temporary file, renamed over it only when complete) and no temporary file."""
    path = write_manifest(tmp_path / "s.csv", stream_rows(3))
    before = path.read_bytes()

    class FullDisk(io.FileIO):
        def write(self, data):
            super().write(data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manifest_mod, "open", lambda f, mode="r", **kw: FullDisk(f, "w")
                        if "w" in mode else open(f, mode, **kw), raising=False)
    with pytest.raises(OSError, match="No space left"):
        write_manifest(path, stream_rows(9))
    monkeypatch.undo()
    assert path.read_bytes() == before and len(validate_manifest(path, STREAM_COLUMNS)) == 3
    assert os.listdir(tmp_path) == ["s.csv"]


# ----------------------------------------------------------------------------------------------
# cache records and the hash cache
# ----------------------------------------------------------------------------------------------
def test_records_old_and_new_format(tmp_path):
    out = tmp_path / "x.csv"
    out.write_text("ID\n")
    save_options(out, {"seed": 1})  # format 1: the options object (earlier versions)
    assert stored_options(out) == {"seed": 1} and is_up_to_date(out, {"seed": 1})
    record, why = load_record(out)
    assert record is None and "older version (options only, no content hashes)" in why
    assert "older version" in why_redo(out, {"seed": 1}, {})
    save_record(out, "demo", {"seed": 1}, inputs={"a.wav": "0" * 40})
    assert stored_options(out) == {"seed": 1} and is_up_to_date(out, {"seed": 1})
    assert json.loads((tmp_path / "x.csv.opts.json").read_text())["format"] == 2
    assert why_redo(out, {"seed": 1}, {"a.wav": "0" * 40}, step="demo") is None
    assert why_redo(out, {"seed": 2}, {"a.wav": "0" * 40}) == "seed changed (1 -> 2)"
    assert why_redo(out, {"seed": 1}, {"a.wav": "1" * 40, "b.wav": "2" * 40}) == \
        "input file a.wav changed (sha1 00000000 -> 11111111); 1 input file(s) added (e.g. b.wav)"
    (tmp_path / "x.csv.opts.json").write_text("{broken")
    assert "unreadable" in why_redo(out, {"seed": 1}, {})
    save_record(out, "demo", {"seed": 1}, inputs={})
    out.unlink()
    assert why_redo(out, {"seed": 1}, {}) == "x.csv is missing"
    assert not is_up_to_date(out, {"seed": 1})           # a record without its file
    (tmp_path / "x.csv.opts.json").unlink()
    assert why_redo(out, {"seed": 1}, {}) == "not written yet"


def test_a_removed_input_or_another_steps_record_is_a_redo(tmp_path):
    """An input file gone from the list (a noise file dropped from the noise folder) and a record
    written by another step are reasons to redo, each said in the log line."""
    out = tmp_path / "x.csv"
    out.write_text("ID\n")
    save_record(out, "demo", {"seed": 1}, inputs={"a.wav": "0" * 40, "b.wav": "1" * 40})
    assert why_redo(out, {"seed": 1}, {"a.wav": "0" * 40, "b.wav": "1" * 40}, step="demo") is None
    assert why_redo(out, {"seed": 1}, {"a.wav": "0" * 40}, step="demo") == \
        "1 input file(s) removed (e.g. b.wav)"
    assert why_redo(out, {"seed": 1}, {"a.wav": "0" * 40, "b.wav": "1" * 40}, step="other") == \
        f"cache record {tmp_path / 'x.csv.opts.json'} belongs to step 'demo'"


def test_hash_cache_reuses_unchanged_files_and_sees_replacements(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "RACY_MARGIN_NS", 0)
    files = [tmp_path / f"f{i}.bin" for i in range(5)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 1000)
    time.sleep(0.05)
    store = tmp_path / "c.json"
    first = HashCache(store)
    digests = [first.sha1(f) for f in files]
    assert digests == [file_sha1(f) for f in files] and first.n_read == 5
    first.save()
    second = HashCache(store)
    assert [second.sha1(f) for f in files] == digests
    assert (second.n_read, second.n_cached) == (0, 5)  # not read again
    # the same entries in a cache file of another version are not trusted: read again
    (tmp_path / "v2.json").write_text(json.dumps({**json.loads(store.read_text()), "version": 2}))
    other = HashCache(tmp_path / "v2.json")
    assert [other.sha1(f) for f in files] == digests and other.n_read == 5
    # replaced in place with the same size and the old modification time put back (cp -p style)
    st = files[2].stat()
    time.sleep(0.05)
    files[2].write_bytes(b"\x09" * 1000)
    os.utime(files[2], ns=(st.st_atime_ns, st.st_mtime_ns))
    third = HashCache(store)
    assert third.sha1(files[2]) == file_sha1(files[2]) != digests[2]
    assert third.n_read == 1


def test_a_replacing_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    """The one atomic write of the data and run files (manifests, records, audio, fingerprints,
    summaries, checkpoints): an error or an interrupt in the middle keeps the old file and
    removes the half-written temporary one; a write that completes replaces the file."""
    path = tmp_path / "f.json"
    path.write_text("old")
    for stop in (OSError("No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(stop)):
            with cache.replaced_when_written(path, tmp_path / ".f.json.tmp") as tmp:
                tmp.write_text("half")
                raise stop
        assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]
    with cache.replaced_when_written(path, tmp_path / ".f.json.tmp") as tmp:
        tmp.write_text("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]


def test_file_sha1_reads_the_whole_file_block_by_block(tmp_path):
    data = bytes(range(256)) * 5
    (tmp_path / "f.bin").write_bytes(data)
    for chunk in (7, 256, 1 << 20):                     # the last block short, exact, one block
        assert file_sha1(tmp_path / "f.bin", chunk=chunk) == hashlib.sha1(data).hexdigest()


@pytest.mark.parametrize("old_mtime", [False, True])
def test_hash_cache_does_not_store_files_changed_just_before_hashing(tmp_path, old_mtime):
    """Written within RACY_MARGIN_NS of hashing: a change in the same clock tick could look
    unchanged, so the file is not stored and is hashed again next time. Also after ``cp -p``
    just before hashing (``old_mtime``): the modification time is an hour old, the change time
    is now; the change time decides (a second same-size copy in the tick would keep the stat)."""
    f = tmp_path / "new.bin"
    f.write_bytes(b"a" * 100)
    if old_mtime:
        old = time.time_ns() - 3600 * 10**9
        os.utime(f, ns=(old, old))                  # mtime an hour ago, ctime now
    store = tmp_path / "c.json"
    hc = HashCache(store)
    hc.sha1(f)
    hc.save()
    assert f.as_posix() not in json.loads(store.read_text()).get("files", {})
    again = HashCache(store)
    again.sha1(f)
    assert again.n_read == 1


def test_the_hash_cache_forgets_deleted_files_and_unknown_record_formats_redo(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setattr(cache, "RACY_MARGIN_NS", 0)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    time.sleep(0.05)
    store = tmp_path / "c.json"
    hc = HashCache(store)
    hc.sha1(a), hc.sha1(b)
    hc.save()
    assert set(json.loads(store.read_text())["files"]) == {a.as_posix(), b.as_posix()}
    b.unlink()
    c = tmp_path / "c.bin"
    c.write_bytes(b"c")
    time.sleep(0.05)
    later = HashCache(store)
    later.sha1(c)
    later.save()                                      # b's entry goes with its file
    assert set(json.loads(store.read_text())["files"]) == {a.as_posix(), c.as_posix()}
    # a record of a format this version does not know is not trusted, even with its options
    out = tmp_path / "x.csv"
    out.write_text("ID\n")
    save_record(out, "demo", {"seed": 1}, inputs={})
    rec = tmp_path / "x.csv.opts.json"
    rec.write_text(rec.read_text().replace('"format": 2', '"format": 3'))
    assert why_redo(out, {"seed": 1}, {}, step="demo") == f"cache record {rec} has unknown format 3"


def test_tuple_options_and_a_moved_data_folder_are_no_reason_to_redo(tmp_path):
    """Options are compared as JSON stores them (a tuple reads back as a list), and input files
    are keyed relative to their base folder: moving the corpus does not redo the step."""
    from tta_brain.data.cache import hash_inputs
    out = tmp_path / "x.csv"
    out.write_text("ID\n")
    save_record(out, "demo", {"snrs": (5, 10)}, inputs={})
    assert why_redo(out, {"snrs": (5, 10)}, {}, step="demo") is None
    for name in ("old", "new"):
        (tmp_path / name / "a").mkdir(parents=True)
        (tmp_path / name / "a" / "u.wav").write_bytes(b"RIFF")
    hashes = HashCache()
    old = hash_inputs([tmp_path / "old" / "a" / "u.wav"], tmp_path / "old", hashes)
    assert old == {"a/u.wav": file_sha1(tmp_path / "old" / "a" / "u.wav")}
    assert hash_inputs([tmp_path / "new" / "a" / "u.wav"], tmp_path / "new", hashes) == old
    assert hash_inputs([tmp_path / "old" / "a" / "u.wav"], tmp_path / "new", hashes) == \
        {str(tmp_path / "old" / "a" / "u.wav"): old["a/u.wav"]}


def test_a_dollar_that_is_no_placeholder_is_the_values_own_text(tmp_path, monkeypatch):
    """A corpus under a folder with ``$`` in its name (manifests with absolute paths: the
    LibriSpeech and statistics manifests the recipes write) and a transcript with ``$`` were
    refused ("needs $HOME; pass a replacement for 'HOME' (e.g. --HOME=...)"): the statistics
    stage of a recipe under such a folder could not run. ``$data_root`` is still the placeholder;
    a path option's data root is not expanded a second time (``source_stats`` was looked for
    under ``/root`` for a data root ``/x/$HOME``)."""
    from tta_brain.data.manifest import expand_path
    rows = [{"ID": "u1", "duration": 1.0, "wav": "/c/$5 set/$HOME/u1.wav", "wrd": "COSTS $5"},
            {"ID": "u2", "duration": 1.0, "wav": "$data_root/u2.wav", "wrd": "A"}]
    path = write_manifest(tmp_path / "m.csv", rows)
    got = read_manifest(path, replacements={"data_root": "/d $x"})
    assert [(r["wav"], r["wrd"]) for r in got] == [("/c/$5 set/$HOME/u1.wav", "COSTS $5"),
                                                   ("/d $x/u2.wav", "A")]
    with pytest.raises(ManifestError, match=r"m.csv:3: .*needs \$data_root"):
        read_manifest(path, replacements={"data_root": ""})
    monkeypatch.setenv("TTA_STATS_HOME", "/stats")
    assert expand_path("$data_root/s.pt", "/x/$HOME run") == "/x/$HOME run/s.pt"
    assert expand_path("${data_root}/s.pt", "/r") == "/r/s.pt"
    assert expand_path("$TTA_STATS_HOME/s.pt") == expand_path("${TTA_STATS_HOME}/s.pt") == \
        "/stats/s.pt"
    assert expand_path("$NO_SUCH_VARIABLE_HERE/s.pt") == "$NO_SUCH_VARIABLE_HERE/s.pt"


def test_a_name_that_is_not_utf8_is_one_line_naming_the_manifest(tmp_path):
    """A corpus under a folder named in Latin-1 (os.listdir gives its byte as a surrogate): the
    write failed with "'utf-8' codec can't encode character '\\udce9' ...", naming no file."""
    from tta_brain.data.manifest import write_manifest
    out = tmp_path / "test.csv"
    rows = [{"ID": "u1", "duration": 1.0, "wav": "/data/a.wav", "spk_id": "s", "wrd": "A"},
            {"ID": "u2", "duration": 1.0, "wav": "/data/caf\udce9/b.wav", "spk_id": "s",
             "wrd": "B"}]
    with pytest.raises(ValueError, match=re.escape(f"{out}: cannot write '/data/caf\\udce9/b.wav' "
                                                   f"as UTF-8 text (a file or folder name")):
        write_manifest(out, iter(rows))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    write_manifest(out, rows[:1])
    assert out.read_bytes().startswith(b"ID,duration,wav,spk_id,wrd\r\nu1,1,/data/a.wav,s,A")


# ------------------------------------------------- the docstrings' rules (mutation audit)
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
    got = read_manifest(tmp_path / "m.csv", replacements={"data_root": "/d"})
    assert got[1]["wav"] == "/d/1.wav"


def test_explicit_columns_refuse_a_field_they_would_drop():
    with pytest.raises(ValueError, match="not in the columns: 'snr'"):
        manifest_text(rows(1, snr=5), columns=("ID", "duration", "wav", "spk_id", "wrd"))


def test_segments_start_at_zero(tmp_path):
    stream = [dict(r, domain="A", segment=s, position=i)
              for i, (r, s) in enumerate(zip(rows(3), (-1, 0, 0)))]
    write_manifest(tmp_path / "s.csv", stream)
    with pytest.raises(ManifestError, match="segments must start at 0"):
        validate_manifest(tmp_path / "s.csv", required=STREAM_COLUMNS)
