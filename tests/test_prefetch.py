"""StreamLoader.prefetch: the decode loop's background reader.

It yields exactly what ``iterate`` yields (good rows and every kind of skip reason), from any
start row (a resumed run), reads ahead while the consumer works, re-raises a reading error at its
row, stops its thread when the consumer stops, and never hangs when the thread dies. The decode
loop with prefetching writes the same records as without (tests/test_brain.py's resume tests run
with it too).
"""
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fake_corpora import write_stream
from tta_brain.run import brain
from tta_brain import decode
from tta_brain.data import loader as loader_mod
from tta_brain.data.loader import StreamLoader, load_stream


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tta-prefetch") and t.is_alive()]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = write_stream(tmp_path_factory.mktemp("stream"), n=10)
    rows = load_stream(root / "stream.csv", str(root))
    rows[3]["wav"] = str(root / "wav" / "missing.wav")          # file not found
    rows[5]["wrd"] = ""                                          # empty transcript
    rows[7]["duration"] = "99"                                   # longer than max_duration
    return rows


def same(a, b):
    assert (a.index, a.position, a.reason, a.duration, a.id) == \
           (b.index, b.position, b.reason, b.duration, b.id)
    assert (a.wav is None) == (b.wav is None)
    if a.wav is not None:
        assert torch.equal(a.wav, b.wav)


@pytest.mark.parametrize("start", [0, 4, 9, 10])
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_prefetch_yields_what_iterate_yields(rows, start, depth):
    ld = StreamLoader(rows, max_duration=20.0)
    ref = list(ld.iterate(start))
    got = list(ld.prefetch(start, depth))
    assert len(got) == len(ref) == len(rows) - start
    for a, b in zip(ref, got):
        same(a, b)
    assert {u.reason is not None for u in got if u.index in (3, 5, 7)} <= {True}
    assert not prefetch_threads()


def test_depth_zero_is_the_plain_loop(rows, monkeypatch):
    monkeypatch.setattr(loader_mod.threading, "Thread", None)      # no thread may be started
    assert [u.index for u in StreamLoader(rows).prefetch(2, 0)] == list(range(2, len(rows)))


def test_rows_are_read_while_the_consumer_works(rows, monkeypatch):
    ld = StreamLoader(rows)
    read_at = {}
    orig = StreamLoader.load

    def load(self, pos):
        read_at[pos] = time.perf_counter()
        return orig(self, pos)

    monkeypatch.setattr(StreamLoader, "load", load)
    gen = ld.prefetch(0, 2)
    next(gen)
    asked = time.perf_counter()
    time.sleep(0.3)                                  # "adapting" on row 0
    next(gen)
    assert read_at[1] < asked + 0.3 and 2 in read_at  # read ahead, not when asked
    gen.close()
    assert not prefetch_threads()


def test_a_reading_error_is_raised_at_its_row(rows, monkeypatch):
    orig = StreamLoader.load

    def load(self, pos):
        if pos == 4:
            raise OSError("disk on fire")
        return orig(self, pos)

    monkeypatch.setattr(StreamLoader, "load", load)
    got = []
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="disk on fire") as e:
        for u in StreamLoader(rows).prefetch(1, 2):
            got.append(u.index)
    assert got == [1, 2, 3]
    assert time.perf_counter() - t0 < 10
    if sys.version_info >= (3, 11):                  # add_note
        assert "stream row 4" in e.value.__notes__[0]
    assert not prefetch_threads()


def test_leaving_the_loop_stops_the_thread(rows, monkeypatch):
    orig = StreamLoader.load
    monkeypatch.setattr(StreamLoader, "load",
                        lambda self, pos: (time.sleep(0.05), orig(self, pos))[1])
    gen = StreamLoader(rows).prefetch(0, 1)
    assert next(gen).index == 0
    time.sleep(0.2)                                  # the producer now waits on a full queue
    t0 = time.perf_counter()
    gen.close()
    assert time.perf_counter() - t0 < 5 and not prefetch_threads()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_thread_is_an_error_not_a_hang(rows, monkeypatch):
    class Broken(loader_mod.queue.Queue):
        def put(self, item, block=True, timeout=None):
            raise RuntimeError("producer crashed")      # not queue.Full: the thread dies

    monkeypatch.setattr(loader_mod.queue, "Queue", Broken)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="prefetch thread stopped before row 0"):
        list(StreamLoader(rows).prefetch(0, 2))
    assert time.perf_counter() - t0 < 10


def test_decode_with_prefetch_writes_the_same_records(tiny_model_dir, tmp_path, monkeypatch):
    root = write_stream(tmp_path / "stream", n=8)
    (root / "wav" / "u005.wav").write_bytes(b"not audio")        # a reject on the way

    def go(out):
        decode.main(["csuta", f"--source={tiny_model_dir}", f"--stream_csv={root / 'stream.csv'}",
                     f"--output_folder={out}", f"--data_root={root}", "--noprogressbar",
                     "--lr=0.01", "--ckpt_every=3"])
        return {n: (Path(out) / n).read_text() for n in
                ("transcripts.csv", "rejects.csv", "resets.csv", "lii.csv")}

    with_prefetch = go(tmp_path / "a")
    monkeypatch.setattr(brain, "PREFETCH", 0)
    without = go(tmp_path / "b")
    assert with_prefetch == without
    assert "u005" in with_prefetch["rejects.csv"]
    assert not prefetch_threads()


def test_an_empty_duration_is_the_audios_own_length(tmp_path):
    """A manifest's empty ``duration`` cell was read as 0 s (transcripts.csv said 0.0, the rates
    per audio second counted nothing); now the utterance's duration is its audio's length. A
    written duration stays the manifest's."""
    root = write_stream(tmp_path, n=3)
    rows = load_stream(root / "stream.csv", str(root))
    written = rows[1]["duration"]
    rows[0]["duration"] = ""
    got = list(StreamLoader(rows).iterate(0))
    assert got[0].reason is None and got[0].duration == got[0].wav.shape[-1] / 16000 > 0
    assert got[1].duration == float(written)


def test_segments_from_domains_start_at_zero_and_boundaries_include_the_second_row(tmp_path):
    """A manifest with domains but no segment column: segment = index of the contiguous domain
    block, from 0 whatever the last row's domain; a boundary right after the first row is one."""
    from tta_brain.data.loader import boundaries
    csv = tmp_path / "own.csv"
    csv.write_text("ID,duration,wav,wrd,domain\n" + "".join(
        f"u{i},1.0,/x/u{i}.wav,HELLO,{d}\n" for i, d in enumerate("ABBC")))
    rows = load_stream(csv)
    assert [r["segment"] for r in rows] == ["0", "1", "1", "2"]
    assert boundaries(rows) == [1, 3]


def test_audio_giving_exactly_the_frames_needed_is_not_too_short():
    """One output frame is enough; in train mode with SpecAugment time masks (mask_time_prob >
    0), one mask's frames (transformers refuses fewer)."""
    from types import SimpleNamespace
    from tta_brain.data.loader import too_short
    lobe = SimpleNamespace(output_lengths=lambda n: torch.div(n, 320, rounding_mode="floor"),
                           model=None)
    why = too_short(SimpleNamespace(lobe=lobe))
    assert why(320) is None and why(640) is None
    assert why(319) == "319 samples give no output frame"
    # in train mode with SpecAugment: one time mask's frames, only where masks are drawn
    cfg = SimpleNamespace(apply_spec_augment=True, mask_time_prob=0.05, mask_time_length=10)
    lobe.model = SimpleNamespace(config=cfg)
    train = too_short(SimpleNamespace(lobe=lobe, train_mode=True))
    assert train(3200) is None and "fewer than the 10 of one SpecAugment" in train(3199)
    assert too_short(SimpleNamespace(lobe=lobe))(320) is None           # eval mode
    cfg.mask_time_prob = 0.0
    assert too_short(SimpleNamespace(lobe=lobe, train_mode=True))(320) is None


def test_the_reader_stays_at_most_depth_rows_ahead(rows, monkeypatch):
    """Read-ahead is bounded by ``depth`` (queue) plus the row in the thread's hands: a slow
    consumer never has the whole stream's audio in memory."""
    ld = StreamLoader(rows)
    read = []
    orig = StreamLoader.load
    monkeypatch.setattr(StreamLoader, "load", lambda self, pos: read.append(pos) or orig(self, pos))
    gen = ld.prefetch(0, 2)
    next(gen)                                       # row 0 handed over
    time.sleep(0.5)                                 # the consumer "adapts" for a while
    assert max(read) <= 1 + 2 + 1, read             # rows 1, 2 queued, row 3 waiting to be put
    gen.close()
    assert not prefetch_threads()
