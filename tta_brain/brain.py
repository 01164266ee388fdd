"""TTABrain: walks a stream manifest in order, one utterance at a time, and records everything.

``speechbrain.core.Brain`` gives us run options (device, ``--noprogressbar``), the hparams
namespace and the checkpointer. ``evaluate`` is replaced by a resumable stream loop: Brain's own
runs under ``torch.no_grad()``, recovers a "best" checkpoint and batches a shuffled dataset, none
of which suits continual TTA. ``evaluate_batch`` adapts with gradients enabled.

Outputs (see ARCHITECTURE.md): transcripts.csv, rejects.csv, resets.csv, lii.csv (written as the
stream goes), then wer.txt and summary.json. A checkpoint (stream cursor, method state, RNG
state) is written every ``ckpt_every`` utterances; rerunning the same command resumes from it and
drops any record written after it, so the output equals that of an uninterrupted run.
"""
import csv
import json
import logging
import os
import re
import time
from pathlib import Path

import speechbrain as sb
import torch
from speechbrain.utils.checkpoints import (mark_as_loader, mark_as_saver,
                                          register_checkpoint_hooks)
from speechbrain.utils.edit_distance import wer_details_for_batch
from speechbrain.utils.metric_stats import ErrorRateStats
from tqdm import tqdm

from tta_brain.data.audio import AudioError, load_audio
from tta_brain.data.manifest import read_manifest, validate_manifest
from tta_brain.methods.base import UttInfo

logger = logging.getLogger(__name__)

STREAM_COLUMNS = ("ID", "duration", "wav", "wrd")
TRANSCRIPT_FIELDS = ["position", "ID", "domain", "segment", "duration", "ref", "hyp", "n_words",
                     "n_err", "n_sub", "n_del", "n_ins", "reset"]
FILES = {"transcripts": TRANSCRIPT_FIELDS, "rejects": ["position", "ID", "wav", "reason"],
         "resets": ["position", "ID", "reason", "trigger"], "lii": ["position", "lii", "stage"]}


def normalize_text(text: str) -> str:
    """Upper case, punctuation other than apostrophes removed, white space collapsed."""
    text = re.sub(r"[^A-Z0-9' ]+", " ", str(text).upper())
    return " ".join(text.split())


@register_checkpoint_hooks
class StreamState:
    """What a resumed run needs: the cursor, the method's state, RNG state, time spent."""

    def __init__(self, method):
        self.method = method
        self.cursor = 0                 # stream rows consumed (decoded or rejected)
        self.wall_time = 0.0
        self.audio_time = 0.0

    @mark_as_saver
    def _save(self, path):
        torch.save({"cursor": self.cursor, "wall_time": self.wall_time,
                    "audio_time": self.audio_time, "method": self.method.state_dict(),
                    "rng": torch.get_rng_state()}, path)

    @mark_as_loader
    def _load(self, path, end_of_epoch=False):
        sd = torch.load(path, map_location="cpu", weights_only=False)
        self.cursor, self.wall_time, self.audio_time = sd["cursor"], sd["wall_time"], sd["audio_time"]
        self.method.load_state_dict(sd["method"])
        torch.set_rng_state(sd["rng"])


class TTABrain(sb.Brain):
    """Continual TTA over a stream manifest.

    hparams used: ``method`` (a ``TTAMethod``), ``output_folder``, ``max_duration`` (s, default
    20), ``ckpt_every`` (utterances, default 200; 0 disables), ``sample_rate`` (16000),
    ``method_tag``, ``stream_name``, ``seed``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.method = self.hparams.method
        self.out = Path(self.hparams.output_folder)
        self.state = StreamState(self.method)
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("stream", self.state)

    def _hp(self, name, default=None):
        return getattr(self.hparams, name, default)

    # ------------------------------------------------------------- one utterance
    def evaluate_batch(self, batch, stage=sb.Stage.TEST):
        """Adapt on one utterance (``batch`` = (wav, UttInfo)) and return the hypothesis."""
        wav, info = batch
        with torch.enable_grad():
            return self.method.process(wav, info)

    # ------------------------------------------------------------- the stream
    def evaluate(self, test_set, data_root=None, progressbar=None, **_):
        """Decode the stream manifest ``test_set`` (a CSV path) in order; returns the summary."""
        validate_manifest(test_set, required=STREAM_COLUMNS)
        rows = read_manifest(test_set, replacements={"data_root": data_root or ""})
        if progressbar is None:
            progressbar = not self.noprogressbar
        self.out.mkdir(parents=True, exist_ok=True)
        if self.checkpointer is not None and self.checkpointer.recover_if_possible():
            logger.info("Resuming %s at stream row %d / %d", self.out, self.state.cursor, len(rows))
        writers, handles = self._open_outputs(self.state.cursor)
        max_dur = float(self._hp("max_duration", 20.0) or 0)
        ckpt_every = int(self._hp("ckpt_every", 200) or 0)
        sr = int(self._hp("sample_rate", 16000))
        n_err = n_words = n_resets = 0
        bar = tqdm(total=len(rows), initial=self.state.cursor, disable=not progressbar,
                   dynamic_ncols=True, desc=f"{self._hp('method_tag', self.method.name)}")
        try:
            for pos in range(self.state.cursor, len(rows)):
                row = rows[pos]
                info = UttInfo(id=row["ID"], position=int(row.get("position") or pos),
                               domain=row.get("domain", ""), segment=int(row.get("segment") or 0))
                reason = self._check_row(row, max_dur)
                wav = None
                if reason is None:
                    try:
                        wav = load_audio(row["wav"], sr)
                    except AudioError as e:
                        reason = str(e)
                if reason is not None:
                    logger.warning("Skipping %s: %s", row["ID"], reason)
                    writers["rejects"].writerow([info.position, row["ID"], row["wav"], reason])
                else:
                    t0 = time.perf_counter()
                    hyp = self.evaluate_batch((wav, info))
                    self.state.wall_time += time.perf_counter() - t0
                    self.state.audio_time += wav.shape[-1] / sr
                    rec = self._record(row, info, hyp)
                    n_resets += self._drain_events(writers, rows, info)
                    rec["reset"] = int(info.position in self._pending_resets)
                    self._pending_resets.discard(info.position)
                    writers["transcripts"].writerow([rec[k] for k in TRANSCRIPT_FIELDS])
                    n_err += rec["n_err"]
                    n_words += rec["n_words"]
                self.state.cursor = pos + 1
                bar.update(1)
                if progressbar:
                    bar.set_postfix(wer=f"{100 * n_err / max(n_words, 1):.1f}", resets=n_resets,
                                    refresh=False)
                if ckpt_every and self.checkpointer is not None and self.state.cursor % ckpt_every == 0:
                    self._checkpoint(handles)
        finally:
            bar.close()
            for h in handles.values():
                h.close()
        if self.checkpointer is not None:
            self._checkpoint({})
        return self._finish(rows, test_set)

    def _check_row(self, row, max_dur):
        if not str(row.get("wrd", "")).strip():
            return "empty transcript (wrd)"
        try:
            dur = float(row.get("duration") or 0)
        except ValueError:
            return f"bad duration {row.get('duration')!r}"
        if max_dur and dur > max_dur:
            return f"longer than max_duration ({dur:.1f} s > {max_dur:.1f} s)"
        return None

    def _record(self, row, info, hyp):
        ref = normalize_text(row["wrd"])
        hyp = normalize_text(hyp)
        d = wer_details_for_batch([row["ID"]], [ref.split()], [hyp.split()])[0]
        return {"position": info.position, "ID": row["ID"], "domain": info.domain,
                "segment": info.segment, "duration": row.get("duration", ""), "ref": ref,
                "hyp": hyp, "n_words": d["num_ref_tokens"], "n_err": d["num_edits"],
                "n_sub": d["substitutions"], "n_del": d["deletions"], "n_ins": d["insertions"]}

    def _drain_events(self, writers, rows, info):
        """Write the method's events; a reset is tagged with the utterance that triggered it."""
        events, self.method.events = self.method.events, []
        n = 0
        for ev in events:
            if ev[0] == "reset":
                pos = ev[1]
                rid = rows[pos]["ID"] if 0 <= pos < len(rows) else ""
                writers["resets"].writerow([pos, rid, ev[2], info.position])
                self._pending_resets.add(pos)
                n += 1
            elif ev[0] == "lii":
                writers["lii"].writerow([ev[1], f"{ev[2]:.6g}", ev[3]])
        return n

    # ------------------------------------------------------------- files
    def _open_outputs(self, cursor):
        """Open the per-utterance CSVs for appending, dropping rows past the checkpoint."""
        writers, handles = {}, {}
        self._pending_resets = set()
        for name, fields in FILES.items():
            path = self.out / f"{name}.csv"
            kept = []
            if cursor > 0 and path.exists():
                with open(path, newline="", encoding="utf-8") as f:
                    kept = [r for r in csv.DictReader(f) if self._before(name, r, cursor)]
            f = open(path, "w", newline="", encoding="utf-8")
            w = csv.writer(f)
            w.writerow(fields)
            for r in kept:
                w.writerow([r[k] for k in fields])
                if name == "resets" and int(r["position"]) >= cursor:
                    self._pending_resets.add(int(r["position"]))
            handles[name], writers[name] = f, w
        return writers, handles

    @staticmethod
    def _before(name, row, cursor):
        """Was this record produced by an utterance before the cursor?"""
        return int(row["trigger" if name == "resets" else "position"]) < cursor

    def _checkpoint(self, handles):
        for h in handles.values():
            h.flush()
            os.fsync(h.fileno())
        self.checkpointer.save_and_keep_only(meta={"cursor": self.state.cursor}, num_to_keep=1)

    def _finish(self, rows, stream_csv):
        """wer.txt (SpeechBrain ErrorRateStats) and summary.json from the written records."""
        with open(self.out / "transcripts.csv", newline="", encoding="utf-8") as f:
            recs = list(csv.DictReader(f))
        stats = ErrorRateStats()
        if recs:
            stats.append([r["ID"] for r in recs], [r["hyp"].split() for r in recs],
                         [r["ref"].split() for r in recs])
        with open(self.out / "wer.txt", "w", encoding="utf-8") as f:
            stats.write_stats(f)
        per_dom = {}
        for r in recs:
            e, w = per_dom.get(r["domain"], (0, 0))
            per_dom[r["domain"]] = (e + int(r["n_err"]), w + int(r["n_words"]))
        n_err = sum(int(r["n_err"]) for r in recs)
        n_words = sum(int(r["n_words"]) for r in recs)
        with open(self.out / "resets.csv", newline="", encoding="utf-8") as f:
            resets = [int(r["position"]) for r in csv.DictReader(f)]
        with open(self.out / "rejects.csv", newline="", encoding="utf-8") as f:
            n_skipped = sum(1 for _ in csv.DictReader(f))
        segs = [int(r.get("segment") or 0) for r in rows]
        boundaries = [int(rows[i].get("position") or i) for i in range(1, len(rows))
                      if segs[i] != segs[i - 1]]
        wall, audio = self.state.wall_time, self.state.audio_time
        summary = {
            "method": self._hp("method_tag", self.method.name),
            "stream": self._hp("stream_name") or Path(stream_csv).stem,
            "seed": self._hp("seed"),
            "wer": 100.0 * n_err / max(n_words, 1),
            "wer_per_domain": {d: 100.0 * e / max(w, 1) for d, (e, w) in per_dom.items()},
            "n_utts": len(recs), "n_words": n_words, "n_err": n_err, "n_skipped": n_skipped,
            "resets": resets, "boundaries": boundaries,
            "counts": dict(self.method.counts),
            "wall_time_s": wall, "audio_s": audio, "time_per_audio_s": wall / max(audio, 1e-9),
            "num_adapted_params": getattr(self.method, "num_adapted", 0),
            "hparams": dict(self._hp("summary_hparams", {}) or {}),
            "device": str(self.device),
            "versions": versions(),
        }
        with open(self.out / "summary.json", "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        logger.info("%s on %s: WER %.2f%% (%d utterances, %d skipped, %d resets)",
                    summary["method"], summary["stream"], summary["wer"], len(recs), n_skipped,
                    len(resets))
        return summary


def versions():
    import platform

    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "speechbrain": sb.__version__, "transformers": transformers.__version__}
    try:
        import torchaudio
        out["torchaudio"] = torchaudio.__version__
    except Exception:  # pragma: no cover - torchaudio is a dependency, but be robust
        pass
    return out
