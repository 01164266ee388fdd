"""StreamState's own check at load (mutation audit): a checkpoint of another run is refused
there too (a TTABrain used without decode has no folder check before it), naming the
difference; one written before fingerprints were kept loads."""
import pytest
import torch

from tta_brain.run.checkpoint import STATE_FILE, ResumeError, StreamState


class _Method:
    batch = None

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


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
