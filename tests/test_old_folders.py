"""Folders written by older tta_brain versions, read by today's report."""
import csv
import json

from tta_brain.run.folder import load_run
from tta_brain.run.records import CSV_FILES, _columns


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
