"""A RecordWriter reopened at a checkpoint's offsets (mutation audit): the running counts come
from the records kept, a reset announced for a row not decoded yet marks the first transcript
decoded at or after it (once), and what was written after the checkpoint is gone."""
from tta_brain.run import records
from tta_brain.run.records import Reject, Reset, RecordWriter, Transcript


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
