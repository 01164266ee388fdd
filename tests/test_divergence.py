"""A learning rate that diverges: the run says so (summary warnings, RESULTS.md), the dynamic reset
brings the model back, SGEM's beam search survives NaN scores (probed: each run wrote empty
transcripts, WER 100, ``warnings: []``, a report cell like any other; SGEM a traceback)."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_corpora import write_stream
from tta_brain import decode
from tta_brain.report.results import build_markdown, collect_runs
from tta_brain.run.summary import health_warnings

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "recipes" / "synthetic" / "source_model"   # a trained model: lr 1e3 diverges it


def test_health_warnings_from_counts_and_hypotheses():
    def hyps(*texts):
        return [SimpleNamespace(hyp=t) for t in texts]
    assert health_warnings(hyps("A B", "C", "", "D E"), {"skipped_steps": 0}) == []
    assert health_warnings(hyps(*["A"] * 19, ""), {}) == []      # one empty: no collapse
    assert health_warnings(hyps(*["A"] * 18, "", ""), {})[0].startswith("2 of 20 hypotheses")
    assert health_warnings(hyps(*["A"] * 19, "", ""), {}) == []  # (EMPTY_SHARE: at least 10 %)
    empty = health_warnings(hyps("A", "", " ", "B"), {"skipped_steps": 0})
    assert empty == ["2 of 4 hypotheses are empty: a model that collapsed to blank outputs (or "
                     "diverged to NaN) decodes every utterance as nothing"]
    skipped = health_warnings(hyps("A"), {"skipped_steps": 3, "adapt_backward": 7})
    assert skipped == ["3 adaptation step(s) skipped for a non-finite loss or gradient (7 "
                       "backward passes done): the adapted model may have diverged (a learning "
                       "rate too high?); log.txt says at which utterances"]


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return write_stream(tmp_path_factory.mktemp("div"), n=12, block=4)


def _run(method, stream, out, *opts):
    return decode.main([method, f"--source={MODEL}", f"--stream_csv={stream}/stream.csv",
                        f"--data_root={stream}", f"--output_folder={out}", "--noprogressbar",
                        "--ckpt_every=0", *opts])


def test_a_diverged_run_says_so_and_the_report_names_it(stream, tmp_path):
    exp = tmp_path / "exp"
    s = _run("suta", stream, exp / "stream" / "suta" / "seed0", "--lr=1e3", "--steps=2")
    assert s.wer == 100.0 and s.counts["skipped_steps"] > 0
    assert any("adaptation step(s) skipped for a non-finite loss" in w for w in s.warnings)
    assert any(w.startswith("12 of 12 hypotheses are empty") for w in s.warnings)
    recorded = json.loads((exp / "stream" / "suta" / "seed0" / "summary.json").read_text())
    assert recorded["warnings"] == s.warnings
    healthy = _run("source", stream, exp / "stream" / "source" / "seed0")
    assert healthy.warnings == []
    md = build_markdown(collect_runs(exp))
    warned = md.split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert "- stream/suta/seed0: 12 of 12 hypotheses are empty" in warned
    assert "stream/source" not in warned
    # SGEM: its beam search had no beam on NaN scores (IndexError, no summary); now the step
    # is skipped and said like the others
    s = _run("sgem", stream, tmp_path / "sgem", "--lr=1e3", "--lr_min=1", "--steps=2")
    assert s.counts["skipped_steps"] > 0 and s.warnings
    from tta_brain.methods.sgem import best_path    # a -inf score (a masked token) is no NaN
    import torch
    logits = torch.randn(1, 6, 5)
    logits[..., 3] = float("-inf")
    assert best_path(logits, 3, 0).shape == (1, 6)
    logits[0, 2, 1] = float("nan")
    assert torch.equal(best_path(logits, 3, 0), logits.argmax(-1))


def test_the_dynamic_reset_resets_a_diverged_model(stream, tmp_path):
    """phi went NaN at the first meta-update: every LII was non-finite and "ignored", the reset
    never fired, and the rest of the stream was decoded from the broken model."""
    s = _run("dsuta", stream, tmp_path / "dyn", "--lr=1e3", "--steps=1", "--reset=dynamic",
             "--reset_K=4", "--buffer_size=2")
    assert s.resets, s.warnings
    reasons = (tmp_path / "dyn" / "resets.csv").read_text()     # (2 in a row: patience)
    assert "non-finite loss: the adapted model diverged" in reasons
    log = (tmp_path / "dyn" / "log.txt").read_text()
    assert "the adapted model's loss is non-finite at utterance" in log
    # at a learning rate that does not diverge, nothing of this
    s = _run("dsuta", stream, tmp_path / "ok", "--steps=1", "--reset=dynamic", "--reset_K=4",
             "--buffer_size=2")
    assert "diverged" not in (tmp_path / "ok" / "log.txt").read_text()
    assert not any("non-finite" in w for w in s.warnings)
