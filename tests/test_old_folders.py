"""Folders written by older tta_brain versions, read by today's report."""
import csv
import json

import pytest

from tta_brain.run.folder import load_run
from tta_brain.run.records import CSV_FILES, RecordError, _columns


def _old_folder(tmp_path, resets):
    """A finished run as tta_brain before 0ac67ac wrote it: 4 utterances, resets.csv holding
    a reset due after the last one (position 4, empty ID), counted in summary.json."""
    for name, cls in CSV_FILES.items():
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(_columns(cls))
            if name == "transcripts":
                for i in range(4):
                    w.writerow([i, f"u{i}", "A", 0, 1.0, "A B", "A B", 2, 0, 0, 0, 0,
                                int(i in resets)])
            if name == "resets":
                for p in resets:
                    w.writerow([p, f"u{p}" if p < 4 else "", "fixed (every 2)", p - 1])
    summary = dict(method="csuta+fixed", stream="s", seed=0, wer=0.0, wer_per_domain={"A": 0.0},
                   n_utts=4, n_words=8, n_err=0, n_skipped=0, skipped=[], resets=list(resets),
                   boundaries=[], counts={}, wall_time_s=1.0, audio_s=4.0, time_per_audio_s=0.25,
                   num_adapted_params=1, hparams={}, device="cpu", versions={})
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_an_old_runs_reset_after_the_last_utterance_is_not_reported(tmp_path):
    run = load_run(_old_folder(tmp_path, [2, 4]))
    assert run.resets == [2]            # as today's decode records the same run
    assert load_run(_old_folder(tmp_path, [2, 3])).resets == [2, 3]    # at the last one: kept


def test_resets_csv_and_its_summary_must_agree(tmp_path):
    """A resets.csv cut short (or a summary of another run) reads as a run with other resets:
    refused naming the file; --overwrite's clear_run removes every record of the run."""
    import pytest
    from tta_brain.run.folder import clear_run
    from tta_brain.run.records import RecordError
    folder = _old_folder(tmp_path, [2, 3])
    lines = (folder / "resets.csv").read_text().splitlines()
    (folder / "resets.csv").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(RecordError, match=r"resets.csv: 1 resets at 2, but summary.json says 2 "
                                          r"at 2, 3"):
        load_run(folder)
    for name in ("fingerprint.json", "hyperparams.yaml", "log.txt", "env.log", "wer.txt",
                 "stream.csv"):      # (decode copies the stream only where none is: a stale one)
        (folder / name).write_text("x")
    (folder / "save").mkdir()
    (folder / "mine.txt").write_text("kept")
    removed = clear_run(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["mine.txt"]
    assert "fingerprint.json" in removed and "save" in removed and "summary.json" in removed
    assert clear_run(folder) == []      # what is not there is not said removed (--overwrite's line)


def test_records_changed_after_the_run_with_as_many_rows_are_refused(tmp_path):
    """An edited transcripts.csv (same utterances, other errors) or resets.csv (as many resets,
    at other rows) is not the run its summary counted: refused naming the file."""
    folder = _old_folder(tmp_path, [2, 3])
    path = folder / "transcripts.csv"
    path.write_text(path.read_text().replace("0,u0,A,0,1.0,A B,A B,2,0,0,0,0",
                                             "0,u0,A,0,1.0,A B,A,2,1,0,1,0"))
    with pytest.raises(RecordError, match=r"transcripts.csv: 4 utterances, 8 words, 1 errors, "
                                          r"but summary.json says 4, 8, 0"):
        load_run(folder)
    folder = _old_folder(tmp_path, [2, 3])
    path = folder / "resets.csv"
    path.write_text(path.read_text().replace("\n3,u3,", "\n1,u1,"))
    with pytest.raises(RecordError, match=r"resets.csv: 2 resets at 1, 2, but summary.json says 2 "
                                          r"at 2, 3"):
        load_run(folder)
    path.write_text(path.read_text().splitlines()[0] + "\n")     # every reset row lost
    with pytest.raises(RecordError, match=r"resets.csv: 0 resets, but summary.json says 2 at 2, "
                                          r"3 \(cut short"):
        load_run(folder)


def test_a_cea_run_fingerprinted_before_param_collection_is_the_same_run():
    """cea.yaml gained ``param_collection: clean`` and the item ``- param_collection: !ref
    <param_collection>`` in its adapt_params (11691bf): a finished CEA run fingerprinted before
    (the key unset, the block's old digest) was refused as other settings, and --overwrite, the
    way out the message gave, deleted it. ``clean`` is what it computed."""
    from tta_brain import hparams
    from tta_brain.run.identity import ADDED_TO_BLOCKS, differences
    path = hparams.find("cea")
    blocks = ["adapt_params", "stage2_params", "method", "model"]
    now = {"hparams": {"seed": 0, "lr": 2e-4, "param_collection": "clean"},
           "structure": hparams.structure(path, blocks, added=ADDED_TO_BLOCKS)}
    assert now["structure"]["adapt_params"] == "05ffdd77049c"    # RENAMED_DIGESTS' new value
    old = json.loads(json.dumps(now))
    del old["hparams"]["param_collection"]
    old["structure"]["adapt_params"] = "f7addc96ee81"             # cea.yaml before 11691bf
    assert differences(old, now) == []
    assert differences(old, now, recorded=True) == differences(now, old, recorded=True) == []
    ebats = json.loads(json.dumps(now))                          # the reference's list is not
    ebats["hparams"]["param_collection"] = "ebats"               # what an old run computed
    assert differences(old, ebats) == ["hparams.param_collection: 'clean' != 'ebats'"]
    bare = {"hparams": {"seed": 0}}                              # no blocks (foa, ebats)
    assert differences(bare, json.loads(json.dumps(bare)), recorded=True) == []
    other = json.loads(json.dumps(old))                          # another old block is no match
    other["structure"]["adapt_params"] = "20c451e3693a"
    assert differences(other, now) == [
        "structure.adapt_params: '20c451e3693a' != '05ffdd77049c'"]


def test_a_run_fingerprinted_before_target_lang_is_the_same_run():
    """run.yaml gained ``target_lang: ""`` and ``target_lang: !ref <target_lang>`` in its
    ``model`` block (MMS's language adapters): a run fingerprinted before (the key unset, the
    model block's old digest) loaded the checkpoint's own language, what ``""`` loads; one of
    another language is another run."""
    from tta_brain import hparams
    from tta_brain.run.identity import ADDED_TO_BLOCKS, differences
    now = {"hparams": {"seed": 0, "lr": 4e-5, "target_lang": ""},
           "structure": hparams.structure(hparams.find("suta"), ["model", "method"],
                                          added=ADDED_TO_BLOCKS)}
    assert now["structure"]["model"] == "a6d1f328a35b"       # run.yaml's model block before
    old = json.loads(json.dumps(now))
    del old["hparams"]["target_lang"]
    assert differences(old, now) == []
    assert differences(old, now, recorded=True) == differences(now, old, recorded=True) == []
    fra = json.loads(json.dumps(now))
    fra["hparams"]["target_lang"] = "fra"
    assert differences(old, fra) == ["hparams.target_lang: '' != 'fra'"]


def _write_records(folder, rows):
    """A run's records files in ``folder``: ``rows`` as transcripts (no reset), the others empty."""
    for name, cls in CSV_FILES.items():
        with open(folder / f"{name}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(_columns(cls))
            if name == "transcripts":
                w.writerows(r + (0,) for r in rows)


def test_a_runs_summary_counts_its_records_per_domain(tmp_path):
    """``summarise`` from the written records: WER and CER (spaces counted) per domain and
    pooled, the time per second of audio. By hand: A: "AB CD" -> "AB" (1 of 2 words, 3 of 5
    characters: " CD"); B: "XY" -> "XZ" (1 of 1 word, 1 of 2 characters)."""
    from types import SimpleNamespace
    from tta_brain.run.summary import read_summary, summarise
    rows = [(0, "u0", "A", 0, 1.0, "AB CD", "AB", 2, 1, 0, 1, 0),
            (1, "u1", "B", 1, 1.0, "XY", "XZ", 1, 1, 1, 0, 0)]
    _write_records(tmp_path, rows)
    stream_rows = [{"position": 0, "segment": 0}, {"position": 1, "segment": 1}]
    s = summarise(tmp_path, stream_rows, SimpleNamespace(wall_time=3.0, audio_time=2.0),
                  SimpleNamespace(counts={}, num_adapted=0), "x", "s", 0, {}, "cpu")
    import pytest
    assert (s.wer, s.wer_per_domain) == (pytest.approx(200 / 3), {"A": 50.0, "B": 100.0})
    assert (s.cer, s.cer_per_domain) == (pytest.approx(400 / 7), {"A": 60.0, "B": 50.0})
    assert (s.time_per_audio_s, s.n_utts, s.n_words, s.n_err) == (1.5, 2, 3, 2)
    assert s.boundaries == [1]                      # the manifest's segments, for the report
    assert read_summary(tmp_path) == s


def _summarise_own(folder, rows):
    """``summarise`` of a run of two rows (``rows``, the transcripts) of a stream of one's own."""
    from types import SimpleNamespace
    from tta_brain.run.summary import summarise
    _write_records(folder, rows)
    return summarise(folder, [{"position": 0}, {"position": 1}],
                     SimpleNamespace(wall_time=3.0, audio_time=2.0),
                     SimpleNamespace(counts={}, num_adapted=0), "x", "own", 0, {}, "cpu")


def test_a_stream_without_domains_has_no_per_domain_rates(tmp_path):
    """A manifest of one's own without a ``domain`` column (every transcript's domain ``""``):
    its summary has no per-domain WER or CER (was ``{"": rate}``, a domain named by nothing, which
    the report does not show either); one written so before is read the same way."""
    from tta_brain.run.summary import read_summary
    rows = [(0, "u0", "", 0, 1.0, "AB CD", "AB", 2, 1, 0, 1, 0),
            (1, "u1", "", 0, 1.0, "XY", "XZ", 1, 1, 1, 0, 0)]
    s = _summarise_own(tmp_path, rows)
    import pytest
    assert (s.wer, s.cer) == (pytest.approx(200 / 3), pytest.approx(400 / 7))
    assert s.wer_per_domain == s.cer_per_domain == {}
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["wer_per_domain"] == saved["cer_per_domain"] == {}
    old = {**saved, "wer_per_domain": {"": s.wer}, "cer_per_domain": {"": s.cer}}
    (tmp_path / "summary.json").write_text(json.dumps(old))      # as written before
    assert read_summary(tmp_path) == s and load_run(tmp_path).summary == s
    (tmp_path / "named").mkdir()
    named = _old_folder(tmp_path / "named", [2])
    assert read_summary(named).wer_per_domain == {"A": 0.0}     # a named domain is kept


def test_a_stream_mixing_unnamed_and_named_domains_keeps_every_rate(tmp_path):
    """A stream whose utterances are partly without a domain (``""``) and partly in a named one
    keeps all its per-domain rates, the unnamed one's too: only a stream with no named domain at
    all has none. By hand as in the test above: "": 1 of 2 words, 3 of 5 characters; A: 1 of 1
    word, 1 of 2 characters."""
    from tta_brain.run.summary import read_summary
    rows = [(0, "u0", "", 0, 1.0, "AB CD", "AB", 2, 1, 0, 1, 0),
            (1, "u1", "A", 0, 1.0, "XY", "XZ", 1, 1, 1, 0, 0)]
    s = _summarise_own(tmp_path, rows)
    assert (s.wer_per_domain, s.cer_per_domain) == ({"": 50.0, "A": 100.0}, {"": 60.0, "A": 50.0})
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["wer_per_domain"] == {"": 50.0, "A": 100.0}
    assert read_summary(tmp_path) == s and load_run(tmp_path).summary == s


def test_a_summary_of_another_version_is_read_or_named(tmp_path):
    """A summary.json with a key this version does not know (a newer tta_brain's) is read; one
    without a key it needs is a RecordError naming it (the folder is then damaged, not a
    traceback); a rate that is no number is written as JSON's null, which any reader takes."""
    import dataclasses
    import math
    import pytest
    from tta_brain.run.records import RecordError
    from tta_brain.run.summary import read_summary, write_summary
    folder = _old_folder(tmp_path, [2])
    data = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**data, "from_a_newer_version": 1}))
    assert load_run(folder).summary.n_utts == 4
    del data["boundaries"]
    (folder / "summary.json").write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"summary.json: not a summary of this tta_brain version "
                                          r"\(missing: boundaries\)"):
        load_run(folder)
    write_summary(folder, dataclasses.replace(read_summary(_old_folder(tmp_path, [2])),
                                              wer=math.nan, wer_per_domain={"A": math.inf}))

    def strict(name):
        raise ValueError(f"not JSON: {name}")
    saved = json.loads((folder / "summary.json").read_text(), parse_constant=strict)
    assert saved["wer"] is None and saved["wer_per_domain"] == {"A": None}
