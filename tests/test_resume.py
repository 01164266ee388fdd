"""What a resume restores and refuses besides the transcripts (mutation audit): the run's time
and audio seconds (the summary's time per audio second), its method's pass counts, every random
generator a method may draw from (numpy's and Python's included); a RecordWriter reopened at a
checkpoint's offsets (running counts from the records kept, a pending reset marking the first
transcript decoded at or after it, what came after the checkpoint gone); and StreamState's own
check at load (a checkpoint of another run refused there too: a TTABrain used without decode has
no folder check before it; one written before fingerprints were kept loads)."""
import json
import random

import numpy as np
import pytest
import torch

from conftest import crash_at
from fake_corpora import write_stream
from tta_brain import decode
from tta_brain.run import records
from tta_brain.run.checkpoint import STATE_FILE, ResumeError, StreamState
from tta_brain.run.records import Reject, RecordWriter, Reset, Transcript


RUN = ["--steps=1", "--lr=0.05", "--noprogressbar"]


def args(root, model, out, *extra):
    return ["suta", f"--source={model}", f"--stream_csv={root / 'stream.csv'}",
            f"--output_folder={out}", f"--data_root={root}", *RUN, *extra]


def test_a_resumed_run_keeps_its_time_and_audio_seconds(tmp_path, tiny_model_dir, monkeypatch):
    root = write_stream(tmp_path / "data", n=10)
    ref = tmp_path / "ref"
    decode.main(args(root, tiny_model_dir, ref, "--ckpt_every=0"))
    out = tmp_path / "exp"
    # the Brain's clock: 0.5 s a reading, so each decoded utterance takes 0.5 s (the crashed one
    # read it once: none of that counts)
    from types import SimpleNamespace
    from tta_brain.run import brain
    clock = iter(0.5 * i for i in range(1000))
    monkeypatch.setattr(brain, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    crash_at(monkeypatch, args(root, tiny_model_dir, out, "--ckpt_every=3"), 7)
    saved = torch.load(next((out / "save").glob(f"CKPT+*/{STATE_FILE}")), weights_only=False)
    assert saved["cursor"] == 6 and saved["audio_time"] > 0 and saved["wall_time"] == 3.0
    decode.main(args(root, tiny_model_dir, out, "--ckpt_every=3"))
    got, want = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    assert got["audio_s"] == pytest.approx(want["audio_s"], rel=1e-9)     # every row counted once
    assert got["wall_time_s"] == 5.0           # the 6 utterances before the crash count too
    assert got["counts"] == want["counts"]               # the method's passes before it too
    for name in ("transcripts.csv", "resets.csv", "wer.txt"):
        assert (out / name).read_text() == (ref / name).read_text(), name
    env_log = (out / "env.log").read_text()     # both starts' environments (one was written over)
    assert env_log.count("tta-brain run") == 2 and env_log.count("resumed: the environment") == 1


class _Method:
    batch = None

    def __init__(self):
        self.w = 0

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, sd):
        self.w = sd["w"]


def test_a_checkpoint_restores_every_random_generator(tmp_path):
    state = StreamState(_Method(), fingerprint={"stream_sha1": "x"})
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    state._save(tmp_path / STATE_FILE)
    want = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    torch.manual_seed(9), np.random.seed(9), random.seed(9)        # a new process's generators
    StreamState(_Method(), fingerprint={"stream_sha1": "x"})._load(tmp_path / STATE_FILE)
    got = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    assert got == want


def test_a_save_killed_mid_write_leaves_no_state_file(tmp_path, monkeypatch):
    """The state file is what makes a checkpoint directory complete: a save interrupted while
    writing (a kill, a full disk) leaves only its temporary file, never a partial stream.ckpt
    that recover() would take for a complete checkpoint (mutation audit: written in place, it
    passed every fast test)."""
    from tta_brain.run import checkpoint
    path = tmp_path / STATE_FILE
    real = torch.save

    def cut(obj, f):
        real(obj, f)
        f.truncate(100)                     # half written, then the process is gone
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint.torch, "save", cut)
    with pytest.raises(KeyboardInterrupt):
        StreamState(_Method(), fingerprint=None)._save(path)
    assert not path.exists()
    monkeypatch.setattr(checkpoint.torch, "save", real)
    StreamState(_Method(), fingerprint=None)._save(path)       # the next save is whole
    assert path.exists() and not path.with_name(STATE_FILE + ".tmp").exists()


def test_the_saved_fingerprint_is_the_newest_complete_checkpoints(tmp_path):
    """decode asks the folder's checkpoint for its fingerprint: the newest complete one (a save
    keeps the older until the newer is whole), never a state file still being written
    (mutation audit: the oldest, or a ``.tmp`` listed, passed every fast test)."""
    from tta_brain.run.checkpoint import checkpoint_files, saved_fingerprint
    for name, sha in (("CKPT+2024-01-01+00-00-00+00", "old"),
                      ("CKPT+2024-01-02+00-00-00+00", "new")):
        (tmp_path / "save" / name).mkdir(parents=True)
        StreamState(_Method(), fingerprint={"stream_sha1": sha})._save(
            tmp_path / "save" / name / STATE_FILE)
    newest = tmp_path / "save" / "CKPT+2024-01-02+00-00-00+00" / STATE_FILE
    newest.with_name(STATE_FILE + ".tmp").write_bytes(b"PK half a save")
    assert [p.parent.name[5:15] for p in checkpoint_files(tmp_path)] == ["2024-01-01",
                                                                         "2024-01-02"]
    assert saved_fingerprint(tmp_path) == {"stream_sha1": "new"}


# ----------------------------------------------------------- RecordWriter reopened
def transcript(position, n_err, n_words=5):
    return Transcript(position, f"u{position}", "A", 0, 1.0, "a b", "a", n_words, n_err,
                      n_err, 0, 0)


def test_a_resumed_writer_counts_the_kept_records_and_keeps_a_pending_reset(tmp_path):
    w = RecordWriter(tmp_path)
    for p in range(3):
        w.transcript(transcript(p, n_err=p))
    w.reset(Reset(3, "u3", "lii", 2))                  # taken: transcript 3 has reset = 1
    w.transcript(transcript(3, n_err=3))
    w.reset(Reset(5, "u5", "lii", 3))                  # announced for row 5, not decoded yet
    offsets = w.sync()
    counts = (w.n_err, w.n_words, w.n_resets)
    w.transcript(transcript(4, n_err=9))               # after the checkpoint: dropped
    w.reject(Reject(5, "u5", "x.wav", "too short"))
    w.close()
    r = RecordWriter(tmp_path, offsets, cursor=4)
    assert (r.n_err, r.n_words, r.n_resets) == counts == (6, 20, 2)
    r.transcript(transcript(4, n_err=0))               # row 4: before the reset's row
    r.reject(Reject(5, "u5", "x.wav", "too short"))    # the reset's row is skipped
    r.transcript(transcript(6, n_err=0))               # the first decoded after it
    r.transcript(transcript(7, n_err=0))
    r.close()
    ts = records.read_transcripts(tmp_path)
    assert [(t.position, t.reset) for t in ts] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 0),
                                                   (6, 1), (7, 0)]
    assert [x.position for x in records.read_rejects(tmp_path)] == [5]
    assert records.rows_done(tmp_path) == 8


def test_a_writer_without_offsets_starts_every_record_file_anew(tmp_path):
    """A run stopped before its first checkpoint decodes its stream again: the records of the
    first start are written over, not appended to (a second header, every row twice)."""
    w = RecordWriter(tmp_path)
    w.transcript(transcript(0, n_err=1))
    w.reject(Reject(1, "u1", "x.wav", "too short"))
    w.reset(Reset(2, "u2", "lii", 0))
    w.close()
    w = RecordWriter(tmp_path)
    w.transcript(transcript(0, n_err=2))
    w.close()
    assert [(t.position, t.n_err) for t in records.read_transcripts(tmp_path)] == [(0, 2)]
    assert records.read_rejects(tmp_path) == [] and records.read_resets(tmp_path) == []
    assert records.rows_done(tmp_path) == 1


# ----------------------------------------------------------- StreamState's check at load
def test_a_checkpoint_of_another_stream_is_refused_at_load(tmp_path):
    mine = {"stream_sha1": "aaa", "n_rows": 20, "method": "suta"}
    saved = StreamState(_Method(), fingerprint=mine)
    saved.cursor = 8
    saved._save(tmp_path / STATE_FILE)
    other = StreamState(_Method(), fingerprint={**mine, "stream_sha1": "bbb"})
    with pytest.raises(ResumeError, match="another run .*stream_sha1: 'aaa' != 'bbb'"):
        other._load(tmp_path / STATE_FILE)
    assert other.cursor == 0
    same = StreamState(_Method(), fingerprint=dict(mine))
    same._load(tmp_path / STATE_FILE)
    assert same.cursor == 8


def test_a_checkpoint_without_a_fingerprint_loads(tmp_path):
    old = StreamState(_Method(), fingerprint=None)
    old.cursor = 5
    old._save(tmp_path / STATE_FILE)
    new = StreamState(_Method(), fingerprint={"stream_sha1": "aaa", "n_rows": 20})
    new._load(tmp_path / STATE_FILE)
    assert new.cursor == 5


def test_a_file_that_is_no_checkpoint_of_a_run_is_refused_at_load(tmp_path):
    """Another torch.save file in a checkpoint's place, or a checkpoint from before the record
    offsets were kept: refused, each with its own reason, nothing loaded (mutation audit)."""
    path = tmp_path / STATE_FILE
    old = StreamState(_Method(), fingerprint=None)
    old.cursor, old.method.w = 3, 7
    old._save(path)
    before_offsets = {k: v for k, v in torch.load(path, weights_only=False).items()
                      if k != "offsets"}
    for saved, said in (([1, 2], "not a checkpoint of a tta_brain run"),
                        ({"w": 7}, "not a checkpoint of a tta_brain run"),
                        (before_offsets, r"checkpoint written by an older version \(no record "
                                         r"offsets\)")):
        torch.save(saved, path)
        state = StreamState(_Method(), fingerprint={"stream_sha1": "x"})
        with pytest.raises(ResumeError, match=f"{STATE_FILE}: {said}; delete .* to start over"):
            state._load(path)
        assert (state.cursor, state.method.w) == (0, 0)


def test_a_resumed_runs_progress_bar_counts_the_records_kept(tmp_path, tiny_model_dir,
                                                             monkeypatch, capfd):
    """The bar's running WER and reset count after a resume are those of the whole run (the
    rows decoded before the crash included), not of the rows decoded since, and its count goes
    on from the checkpoint's row; ``--noprogressbar`` shows none (mutation audit)."""
    import re
    root = write_stream(tmp_path / "data", n=10)
    out = tmp_path / "exp"
    crash_at(monkeypatch, args(root, tiny_model_dir, out, "--ckpt_every=3"), 7)
    assert not re.search(r"\d+/10 \[", capfd.readouterr().err)      # --noprogressbar: no bar
    decode.main([a for a in args(root, tiny_model_dir, out, "--ckpt_every=3")
                 if a != "--noprogressbar"])
    err = capfd.readouterr().err
    shown = re.findall(r"resets=([0-9]+), wer=([0-9.]+)", err)
    ts = records.read_transcripts(out)
    assert len(ts) == 10 and shown
    n_err, n_words = sum(t.n_err for t in ts), sum(t.n_words for t in ts)
    assert n_err != n_words                       # (a bar of words / errors would show the same)
    counts = re.findall(r"(\d+)/10 \[", err)        # from the checkpoint's row 6 to the end
    assert counts[0] == "6" and counts[-1] == "10", counts
    assert shown[-1] == (str(len(records.read_resets(out))), f"{100 * n_err / n_words:.1f}")
