"""TTABrain: walks a stream manifest in order, one utterance at a time, and records everything.

``speechbrain.core.Brain`` gives us run options (device, ``--noprogressbar``), the hparams
namespace and the checkpointer. ``evaluate`` is replaced by a resumable stream loop: Brain's own
runs under ``torch.no_grad()``, recovers a "best" checkpoint and batches a shuffled dataset, none
of which suits continual TTA. ``evaluate_batch`` adapts with gradients enabled.

Outputs (see ARCHITECTURE.md): transcripts.csv, rejects.csv, resets.csv, lii.csv (written and
flushed utterance by utterance), then wer.txt and summary.json.

Resume. Every ``ckpt_every`` utterances the record CSVs are flushed and fsync'ed and a SpeechBrain
checkpoint is saved with the stream cursor, the method's whole state (adapted and meta-parameters,
optimiser moments, buffer, reset-detector statistics, pass counters), every RNG state and the
byte length of each record CSV. Rerunning the same command (even after ``kill -9``) loads the
newest *complete* checkpoint, cuts the CSVs back to those lengths (dropping the records written
after it, partial lines included) and goes on from the cursor, so the output equals that of an
uninterrupted run. The records themselves stay in the CSVs: nothing per utterance is kept in
memory or in the checkpoint.

Bad input inside a stream (missing / empty / corrupt audio, NaN or inf samples, an empty
transcript, a too long or too short utterance) is skipped, logged and listed in rejects.csv with
the reason; ``summary.json`` counts it (``n_skipped``). Several channels and other sample rates
are converted by :func:`tta_brain.data.audio.load_audio`.
"""
import csv
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import speechbrain as sb
import torch
from speechbrain.utils.checkpoints import (mark_as_loader, mark_as_saver,
                                          register_checkpoint_hooks)
from speechbrain.utils.edit_distance import wer_details_for_batch
from speechbrain.utils.metric_stats import ErrorRateStats
from tqdm import tqdm

from tta_brain.data.audio import AudioError, load_audio
from tta_brain.data.manifest import read_header, read_manifest, validate_manifest
from tta_brain.methods.base import UttInfo

logger = logging.getLogger(__name__)

#: Columns a stream manifest must have (``domain``, ``segment``, ``position`` are optional; when
#: ``position`` is there, rows must be in order 0..n-1).
STREAM_COLUMNS = ("ID", "duration", "wav", "wrd")
TRANSCRIPT_FIELDS = ["position", "ID", "domain", "segment", "duration", "ref", "hyp", "n_words",
                     "n_err", "n_sub", "n_del", "n_ins", "reset"]
FILES = {"transcripts": TRANSCRIPT_FIELDS, "rejects": ["position", "ID", "wav", "reason"],
         "resets": ["position", "ID", "reason", "trigger"], "lii": ["position", "lii", "stage"]}
STATE_FILE = "stream.ckpt"          # written last and atomically: its presence = complete ckpt
TRIM_EVERY = 25                     # utterances between returns of freed heap memory to the OS


def _libc_malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        import ctypes
        import ctypes.util
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_malloc_trim()


def release_freed_memory():
    """Give freed heap pages back to the OS.

    Utterances of varying length make the CPU kernels (oneDNN) allocate and free buffers of
    ever new sizes; glibc keeps the freed pages, so the RSS of a long stream creeps up although
    nothing is kept (tools/bench_memory.py). A ``malloc_trim`` every few utterances keeps it flat
    at the cost of well under a millisecond per utterance.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


class ResumeError(RuntimeError):
    """The output folder's checkpoint does not fit this run (another stream or method, records
    missing or shorter than the checkpoint says)."""


def normalize_text(text: str) -> str:
    """Upper case, punctuation other than apostrophes removed, white space collapsed."""
    text = re.sub(r"[^A-Z0-9' ]+", " ", str(text).upper())
    return " ".join(text.split())


def load_stream(path, data_root=None):
    """Validate a stream manifest and read it (``$data_root`` replaced).

    Raises :class:`ManifestError` naming the file and the problem: missing file or columns
    (``ID, duration, wav, wrd``), no rows, positions out of order, ``$data_root`` without a value.
    """
    header = read_header(path)
    required = STREAM_COLUMNS + (("position",) if "position" in header else ())
    validate_manifest(path, required=required)
    return read_manifest(path, replacements={"data_root": data_root or ""})


def stream_fingerprint(path, n_rows, method_tag):
    """What a checkpoint must agree with to be resumed: the manifest's content and the method."""
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"stream_sha1": h.hexdigest(), "n_rows": n_rows, "method": method_tag}


def get_rng_state():
    """Every RNG a method may draw from: torch (CPU and CUDA), numpy, Python."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


@register_checkpoint_hooks
class StreamState:
    """What a resumed run needs: the cursor, the method's state, RNG states, the record CSVs'
    lengths at the checkpoint, the time spent, and a fingerprint of the stream and method."""

    def __init__(self, method):
        self.method = method
        self.cursor = 0                 # stream rows consumed (decoded or rejected)
        self.wall_time = 0.0
        self.audio_time = 0.0
        self.offsets = {}               # record CSV name -> bytes at the checkpoint
        self.fingerprint = None

    @mark_as_saver
    def _save(self, path):
        sd = {"cursor": self.cursor, "wall_time": self.wall_time, "audio_time": self.audio_time,
              "offsets": dict(self.offsets), "fingerprint": self.fingerprint,
              "method": self.method.state_dict(), "rng": get_rng_state()}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)           # a kill mid-save leaves no STATE_FILE: ckpt ignored

    @mark_as_loader
    def _load(self, path, end_of_epoch=False):
        # the method's tensors go straight to the model's device (the reset detector's phi_D,
        # DSUTA's buffer are used as they are loaded)
        device = getattr(getattr(self.method, "lobe", None), "device", "cpu")
        sd = torch.load(path, map_location=device, weights_only=False)
        old = sd.get("fingerprint")
        if self.fingerprint is not None and old is not None and old != self.fingerprint:
            what = [k for k in self.fingerprint if old.get(k) != self.fingerprint[k]]
            was = {k: old.get(k) for k in what}
            now = {k: self.fingerprint[k] for k in what}
            raise ResumeError(
                f"{path}: the checkpoint is from another run ({', '.join(what)} differ: {was} != "
                f"{now}). Use another --output_folder, or delete {Path(path).parent.parent} to "
                f"start over.")
        if "offsets" not in sd:
            raise ResumeError(f"{path}: checkpoint written by an older version (no record "
                              f"offsets); delete {Path(path).parent.parent} to start over")
        self.cursor, self.wall_time, self.audio_time = sd["cursor"], sd["wall_time"], sd["audio_time"]
        self.offsets = sd["offsets"]
        self.method.load_state_dict(sd["method"])
        set_rng_state(sd["rng"])


class TTABrain(sb.Brain):
    """Continual TTA over a stream manifest.

    hparams used: ``method`` (a ``TTAMethod``), ``output_folder``, ``max_duration`` (s, default
    20), ``ckpt_every`` (utterances, default 200; 0: only at the end), ``sample_rate`` (16000),
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

    @property
    def tag(self):
        return self._hp("method_tag") or self.method.name

    # ------------------------------------------------------------- one utterance
    def evaluate_batch(self, batch, stage=sb.Stage.TEST):
        """Adapt on one utterance (``batch`` = (wav, UttInfo)) and return the hypothesis."""
        wav, info = batch
        with torch.enable_grad():
            return self.method.process(wav, info)

    # ------------------------------------------------------------- the stream
    def evaluate(self, test_set, data_root=None, progressbar=None, **_):
        """Decode the stream manifest ``test_set`` (a CSV path) in order; returns the summary.

        Raises :class:`ManifestError` for a bad manifest and :class:`ResumeError` when the output
        folder holds a checkpoint of another run.
        """
        rows = load_stream(test_set, data_root)
        if progressbar is None:
            progressbar = not self.noprogressbar
        self.out.mkdir(parents=True, exist_ok=True)
        self.state.fingerprint = stream_fingerprint(test_set, len(rows), self.tag)
        logger.info("Decoding %s (%d utterances) with %s, seed %s", test_set, len(rows),
                    self.tag, self._hp("seed"))
        resumed = self._recover()
        if resumed:
            logger.info("Resuming %s at stream row %d / %d", self.out, self.state.cursor, len(rows))
        writers, handles, (n_err, n_words, n_resets) = self._open_outputs(
            self.state.cursor if resumed else 0)
        max_dur = float(self._hp("max_duration", 20.0) or 0)
        ckpt_every = int(self._hp("ckpt_every", 200) or 0)
        sr = int(self._hp("sample_rate", 16000))
        bar = tqdm(total=len(rows), initial=self.state.cursor, disable=not progressbar,
                   dynamic_ncols=True, desc=self.tag)
        try:
            for pos in range(self.state.cursor, len(rows)):
                row = rows[pos]
                info = UttInfo(id=row["ID"], position=int(row.get("position") or pos),
                               domain=row.get("domain", ""), segment=int(row.get("segment") or 0))
                wav, reason = self._load_row(row, max_dur, sr)
                if reason is not None:
                    logger.warning("Skipping %s (position %d): %s", row["ID"], info.position,
                                   reason)
                    writers["rejects"].writerow([info.position, row["ID"], row.get("wav", ""),
                                                 reason])
                else:
                    t0 = time.perf_counter()
                    hyp = self.evaluate_batch((wav, info))
                    self.state.wall_time += time.perf_counter() - t0
                    self.state.audio_time += wav.shape[-1] / sr
                    rec = self._record(row, info, hyp)
                    n_resets += self._drain_events(writers, rows, info)
                    rec["reset"] = int(info.position in self._pending_resets)
                    # (a reset due at a skipped row is in resets.csv only)
                    self._pending_resets = {p for p in self._pending_resets if p > info.position}
                    writers["transcripts"].writerow([rec[k] for k in TRANSCRIPT_FIELDS])
                    n_err += rec["n_err"]
                    n_words += rec["n_words"]
                for h in handles.values():  # a crash loses nothing written so far
                    h.flush()
                self.state.cursor = pos + 1
                if self.state.cursor % TRIM_EVERY == 0:
                    release_freed_memory()
                bar.update(1)
                if progressbar:
                    bar.set_postfix(wer=f"{100 * n_err / max(n_words, 1):.1f}", resets=n_resets,
                                    refresh=False)
                if (ckpt_every and self.checkpointer is not None
                        and self.state.cursor % ckpt_every == 0 and self.state.cursor < len(rows)):
                    self._checkpoint(handles)
            if self.checkpointer is not None:
                self._checkpoint(handles)
        finally:
            bar.close()
            for h in handles.values():
                h.close()
        return self._finish(rows, test_set)

    def _load_row(self, row, max_dur, sr):
        """The utterance's waveform, or None and the reason to skip it."""
        if not normalize_text(row.get("wrd") or ""):
            return None, "empty transcript (wrd)"
        if not str(row.get("wav") or "").strip():
            return None, "empty wav path"
        try:
            dur = float(row.get("duration") or 0)
        except ValueError:
            return None, f"bad duration {row.get('duration')!r}"
        if max_dur and dur > max_dur:
            return None, f"longer than max_duration ({dur:.1f} s > {max_dur:.1f} s)"
        try:
            wav = load_audio(row["wav"], sr)
        except AudioError as e:
            return None, str(e)
        n = wav.shape[-1]
        if max_dur and n / sr > max_dur:
            return None, (f"{row['wav']}: longer than max_duration ({n / sr:.1f} s > "
                          f"{max_dur:.1f} s; the manifest says {dur:.1f} s)")
        if dur > 0 and abs(n / sr - dur) > max(0.1, 0.1 * dur):
            # libsndfile reads a truncated file without complaint; the manifest knows better
            return None, (f"{row['wav']}: {n / sr:.2f} s of audio but the manifest says "
                          f"{dur:.2f} s (truncated or replaced file?)")
        frames = self._frames(n)
        if frames is not None and frames < 1:
            return None, f"{row['wav']}: too short for the model ({n} samples give no output frame)"
        return wav, None

    def _frames(self, n_samples):
        out_len = getattr(getattr(self.method, "lobe", None), "output_lengths", None)
        if out_len is None:
            return None
        try:
            return int(out_len(torch.tensor(n_samples)))
        except Exception:  # pragma: no cover - a lobe without the HF helper
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
        skips = [ev[2] for ev in events if ev[0] == "skip"]
        if skips:   # the method logged each one; name the utterance once
            logger.warning("%s (position %d): %d adaptation step(s) skipped (%s); the parameters "
                           "were left unchanged by them", info.id, info.position, len(skips),
                           "; ".join(sorted(set(skips))))
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

    # ------------------------------------------------------------- checkpoints
    def _recover(self):
        """Load the newest complete checkpoint; incomplete ones (killed mid-save) are removed."""
        if self.checkpointer is None:
            return False
        ckpt_dir = Path(self.checkpointer.checkpoints_dir)
        if ckpt_dir.is_dir():
            for d in ckpt_dir.glob("CKPT+*"):
                if d.is_dir() and not (d / STATE_FILE).is_file():
                    logger.warning("Removing incomplete checkpoint %s (interrupted while "
                                   "saving)", d)
                    shutil.rmtree(d, ignore_errors=True)
        ckpt = self.checkpointer.recover_if_possible(
            ckpt_predicate=lambda c: (Path(c.path) / STATE_FILE).is_file())
        return ckpt is not None

    def _checkpoint(self, handles):
        for h in handles.values():
            h.flush()
            os.fsync(h.fileno())
        self.state.offsets = {name: os.path.getsize(self.out / f"{name}.csv") for name in FILES}
        self.checkpointer.save_and_keep_only(meta={"cursor": self.state.cursor}, num_to_keep=1,
                                             verbosity=logging.DEBUG)

    # ------------------------------------------------------------- files
    def _open_outputs(self, cursor):
        """Open the record CSVs for appending.

        At a resume (``cursor`` > 0) each file is cut back to its length at the checkpoint, which
        drops every record written after it. Returns writers, handles and the (errors, words,
        resets) counts of the records kept.
        """
        writers, handles = {}, {}
        self._pending_resets = set()
        counts = [0, 0, 0]
        for name, fields in FILES.items():
            path = self.out / f"{name}.csv"
            if cursor > 0:
                size = self.state.offsets.get(name)
                have = path.stat().st_size if path.is_file() else -1
                if size is None or have < size:
                    raise ResumeError(
                        f"{path}: {'missing' if have < 0 else f'{have} bytes'}, but the checkpoint "
                        f"at row {cursor} recorded {size} bytes; the records cannot be resumed. "
                        f"Delete {self.out / 'save'} (or use another --output_folder) to restart.")
                with open(path, "r+b") as f:
                    f.truncate(size)
                self._scan_kept(name, path, cursor, counts)
                f = open(path, "a", newline="", encoding="utf-8")
                w = csv.writer(f)
            else:
                f = open(path, "w", newline="", encoding="utf-8")
                w = csv.writer(f)
                w.writerow(fields)
                f.flush()
            handles[name], writers[name] = f, w
        return writers, handles, counts

    def _scan_kept(self, name, path, cursor, counts):
        """Resets announced for rows at or after the cursor; counts for the progress bar."""
        if name not in ("transcripts", "resets"):
            return
        with open(path, newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                if name == "transcripts":
                    counts[0] += int(r["n_err"])
                    counts[1] += int(r["n_words"])
                else:
                    counts[2] += 1
                    if int(r["position"]) >= cursor:
                        self._pending_resets.add(int(r["position"]))

    # ------------------------------------------------------------- report
    def _finish(self, rows, stream_csv):
        """wer.txt (SpeechBrain ErrorRateStats) and summary.json from the written records."""
        stats = ErrorRateStats()
        per_dom = {}
        n_err = n_words = n_utts = 0
        with open(self.out / "transcripts.csv", newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                stats.append([r["ID"]], [r["hyp"].split()], [r["ref"].split()])
                e, w = per_dom.get(r["domain"], (0, 0))
                per_dom[r["domain"]] = (e + int(r["n_err"]), w + int(r["n_words"]))
                n_err += int(r["n_err"])
                n_words += int(r["n_words"])
                n_utts += 1
        with open(self.out / "wer.txt", "w", encoding="utf-8") as f:
            stats.write_stats(f)
        with open(self.out / "resets.csv", newline="", encoding="utf-8") as f:
            resets = [int(r["position"]) for r in csv.DictReader(f)]
        with open(self.out / "rejects.csv", newline="", encoding="utf-8") as f:
            rejects = list(csv.DictReader(f))
        segs = [int(r.get("segment") or 0) for r in rows]
        boundaries = [int(rows[i].get("position") or i) for i in range(1, len(rows))
                      if segs[i] != segs[i - 1]]
        wall, audio = self.state.wall_time, self.state.audio_time
        summary = {
            "method": self.tag,
            "stream": self._hp("stream_name") or Path(stream_csv).stem,
            "seed": self._hp("seed"),
            "wer": 100.0 * n_err / max(n_words, 1),
            "wer_per_domain": {d: 100.0 * e / max(w, 1) for d, (e, w) in per_dom.items()},
            "n_utts": n_utts, "n_words": n_words, "n_err": n_err, "n_skipped": len(rejects),
            "skipped": [{"position": int(r["position"]), "ID": r["ID"], "reason": r["reason"]}
                        for r in rejects],
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
                    summary["method"], summary["stream"], summary["wer"], n_utts, len(rejects),
                    len(resets))
        if rejects:
            logger.warning("%d utterance(s) skipped, listed with the reasons in %s", len(rejects),
                           self.out / "rejects.csv")
        return summary


def versions():
    """Versions of the libraries that decide the numbers (logged and written to summary.json)."""
    import platform

    import transformers

    import tta_brain
    out = {"python": platform.python_version(), "tta_brain": tta_brain.__version__,
           "torch": torch.__version__, "speechbrain": sb.__version__,
           "transformers": transformers.__version__, "numpy": np.__version__}
    for name in ("torchaudio", "soundfile"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # pragma: no cover - both are dependencies, but be robust
            pass
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version()
    return out
