"""TTABrain: the glue that walks a stream manifest with a method, one utterance at a time.

What it glues, each owned by its own module: the stream's utterances (``data.loader``), the method
(``methods``), the run record (``records``), the checkpoint protocol (``checkpoint``) and the
summary (``summary``). ``speechbrain.core.Brain`` gives the device, ``--noprogressbar``, the
hparams namespace and the checkpointer; ``evaluate`` is a resumable stream loop instead of
Brain's (which runs under ``torch.no_grad()``, recovers a "best" checkpoint and batches a
shuffled dataset, none of which suits continual TTA).

Resume: every ``ckpt_every`` utterances the records are fsync'ed and a checkpoint saved; rerunning
the same command (even after ``kill -9``) cuts the records back to that checkpoint and goes on
from its cursor, so the output equals that of an uninterrupted run.
"""
import logging
import time
from itertools import islice
from pathlib import Path

from tta_brain import quirks  # noqa: F401  (first: SpeechBrain without its torch quirks)
import speechbrain as sb
from tqdm import tqdm

from tta_brain.run import checkpoint, identity
from tta_brain.asr import metrics
from tta_brain.data.loader import StreamLoader, boundaries, load_stream, too_short
from tta_brain.methods.base import UttInfo
from tta_brain.run.records import Memory, RecordWriter, Reject, Reset, Transcript, decoded_rows
from tta_brain.lobes.runtime import release_freed_memory
from tta_brain.run.summary import summarise

logger = logging.getLogger(__name__)

TRIM_EVERY = 25      # utterances between returns of freed heap memory to the OS
MEMORY_EVERY = 50    # utterances between samples of the process memory (memory.csv; after a trim)
PREFETCH = 2         # rows read ahead by a background thread while one adapts (0: none)


class TTABrain(sb.Brain):
    """Continual TTA over a stream manifest.

    hparams used: ``method`` (a ``TTAMethod``), ``output_folder``, ``max_duration`` (s, default
    20), ``ckpt_every`` (utterances, default 200; 0: only at the end), ``method_tag``,
    ``stream_name``, ``seed``. ``fingerprint``: the run's identity (checkpoint and summary);
    ``record_hparams``: the values recorded in the summary.
    """

    def __init__(self, *args, fingerprint=None, record_hparams=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.record_hparams = dict(record_hparams or {})
        self.method = self.hparams.method
        self.out = Path(self.hparams.output_folder)
        self.state = checkpoint.StreamState(self.method, fingerprint)
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("stream", self.state)

    def _hp(self, name, default=None):
        return getattr(self.hparams, name, default)

    @property
    def tag(self):
        return self._hp("method_tag") or self.method.name

    def evaluate_batch(self, batch, stage=sb.Stage.TEST):
        """Adapt on one utterance (``batch`` = (wav, UttInfo)) and return the hypothesis."""
        wav, info = batch
        return self.method.process(wav, info)

    def evaluate(self, test_set, data_root=None, progressbar=None, rows=None, **_):
        """Decode the stream manifest ``test_set`` (a CSV path) in order; returns the summary.
        ``rows``: its rows when the caller read them already (``decode.plan``), else they are
        read here.

        Raises ``ManifestError`` for a bad manifest, :class:`~tta_brain.run.checkpoint.ResumeError`
        when the folder holds a checkpoint of another run.
        """
        cursor = self.start_stream(test_set, data_root, progressbar, rows)
        # the next rows are read (audio decoded and checked) while this one adapts, from the cursor
        utts = self.stream_loader.prefetch(cursor, PREFETCH)
        try:
            for utt in utts:
                self.decode_row(utt)
            self.end_stream()
        finally:
            utts.close()                            # stops and joins the prefetch thread
            self.close_stream()
        return self.stream_summary()

    # The stream loop in parts (``evaluate`` runs them in order; ``tta_brain.sweep`` runs several
    # Brains over one stream in lock-step): start_stream -> decode_row(utt) per row from the
    # cursor -> end_stream -> close_stream (always) -> stream_summary.
    def start_stream(self, test_set, data_root=None, progressbar=None, rows=None) -> int:
        """Open the run: the stream's rows, the checkpoint (if any), the records, the loader; the
        stream row to go on from."""
        rows = load_stream(test_set, data_root) if rows is None else rows
        self.out.mkdir(parents=True, exist_ok=True)
        if self.state.fingerprint is None:
            self.state.fingerprint = identity.stream_fingerprint(test_set, len(rows), self.tag)
        logger.info("Decoding %s (%d utterances) with %s, seed %s", test_set, len(rows), self.tag,
                    self._hp("seed"))
        self._warnings = self.method.warnings(len(rows), boundaries(rows)) + self._unwritable(rows)
        for text in self._warnings:
            logger.warning("%s", text)
        resumed = checkpoint.recover(self.checkpointer)
        if resumed:
            logger.info("Resuming %s at stream row %d / %d", self.out, self.state.cursor, len(rows))
            self._warnings = self._warnings + self._numerics_warning()
        cursor = self.state.cursor if resumed else 0
        if not resumed:                          # stopped before its first checkpoint?
            n = decoded_rows(self.out)
            every = int(self._hp("ckpt_every", 200) or 0)
            if n:
                logger.warning("%s: no checkpoint yet (%s): the %d utterance(s) decoded before "
                               "it stopped are decoded again from the start", self.out,
                               f"the first is saved after ckpt_every = {every} utterances"
                               if every else "ckpt_every = 0: only the end of the stream is "
                               "saved", n)
        self._test_set, self._rows = test_set, rows
        self._writer = RecordWriter(self.out, self.state.offsets if resumed else None, cursor)
        # the audio at the rate the model takes: its lobe's (a yaml's HFCTCLobe(sample_rate=8000)
        # for an 8 kHz checkpoint was fed 16 kHz audio)
        rate = getattr(getattr(self.method, "lobe", None), "sample_rate", None)
        self.stream_loader = StreamLoader(rows, float(self._hp("max_duration", 20.0) or 0),
                                   int(rate or self._hp("sample_rate", 16000)),
                                   too_short(self.method))
        self._ckpt_every = int(self._hp("ckpt_every", 200) or 0)
        self._show = not self.noprogressbar if progressbar is None else progressbar
        self._bar = tqdm(total=len(rows), initial=cursor, disable=not self._show,
                         dynamic_ncols=True, desc=self.tag)
        return cursor

    def _unwritable(self, rows) -> list:
        """A warning where the references hold characters the model cannot write (a vocabulary
        of another language, or without digits): every word holding one is an error whatever
        the method, a floor under its WER that no adaptation lowers."""
        alphabet = getattr(getattr(self.method, "lobe", None), "alphabet", lambda: None)()
        if alphabet is None:                  # (a lobe of one's own; a byte-fallback vocabulary)
            return []
        chars, n = metrics.unwritable((r.get("wrd", "") for r in rows), alphabet)
        if not chars:
            return []
        shown = " ".join(chars[:12]) + (f" and {len(chars) - 12} more" if len(chars) > 12 else "")
        return [f"{n} of {len(rows)} references hold characters the model cannot write ({shown}): "
                f"each word that holds one is an error whatever the method"]

    def _numerics_warning(self) -> list:
        """A warning (logged, and in the summary's warnings) when the run's rows were decoded under
        more than one of ``envinfo.numerics`` (another thread count or library version after a
        resume): its numbers need not be an uninterrupted run's (the LII values, rarely a
        transcript), which the fingerprint cannot tell."""
        seen = getattr(self.state, "numerics", None) or []
        if len(seen) < 2:
            return []
        from tta_brain.run.envinfo import numerics_changes
        changes = sorted({c for a, b in zip(seen, seen[1:]) for c in numerics_changes(a, b)})
        text = (f"resumed under other numerics than it started with ({'; '.join(changes)}): its "
                f"rounding may differ from an uninterrupted run's (LII values, rarely a "
                f"transcript); rerun with --overwrite under one setting for exact records")
        logger.warning("%s", text)
        return [text]

    def decode_row(self, utt) -> None:
        """One stream row (``data.loader`` utterance) at the cursor: decoded or rejected, the
        records flushed, a checkpoint when one is due."""
        writer, rows = self._writer, self._rows
        self._decode(utt, writer, rows, self.stream_loader.sr)
        writer.flush()                      # a crash loses nothing written so far
        self.state.cursor = done = utt.index + 1
        if done % TRIM_EVERY == 0:
            release_freed_memory()
        if done % MEMORY_EVERY == 0:
            writer.memory(Memory.sample(utt.position, self.device))
        self._bar.update(1)
        if self._show:
            self._bar.set_postfix(wer=f"{100 * writer.n_err / max(writer.n_words, 1):.1f}",
                                  resets=writer.n_resets, refresh=False)
        if (self._ckpt_every and self.checkpointer is not None and done % self._ckpt_every == 0
                and done < len(rows)):
            checkpoint.save(self.checkpointer, self.state, self._writer)

    def end_stream(self) -> None:
        """The stream is done: the CUDA graphs' counts logged (where the step had graphs), the
        last checkpoint."""
        counts = getattr(getattr(self.method, "step", None), "describe", None)
        counts = counts() if callable(counts) else None
        if counts:
            logger.info("CUDA graphs: %s", counts)
        if self.checkpointer is not None:
            checkpoint.save(self.checkpointer, self.state, self._writer)

    def close_stream(self) -> None:
        """Close the progress bar and the records (also after an error)."""
        self._bar.close()
        self._writer.close()

    def stream_summary(self):
        """summary.json of the finished run (``run.summary``)."""
        test_set = self._test_set
        return summarise(self.out, self._rows, self.state, self.method, self.tag,
                         self._hp("stream_name") or Path(test_set).stem, self._hp("seed"),
                         self.record_hparams, self.device,
                         self.state.fingerprint,
                         self._warnings + list(getattr(self.method, "end_warnings", list)()))

    def _decode(self, utt, writer, rows, sr):
        """One row: a reject record, or adapt + predict and the transcript and event records."""
        if utt.reason is not None:
            logger.warning("Skipping %s (position %d): %s", utt.id, utt.position, utt.reason)
            writer.reject(Reject(utt.position, utt.id, utt.row.get("wav", ""), utt.reason))
            return
        info = UttInfo(id=utt.id, position=utt.position, domain=utt.domain, segment=utt.segment)
        t0 = time.perf_counter()
        hyp = self.evaluate_batch((utt.wav, info))
        self.state.wall_time += time.perf_counter() - t0
        self.state.audio_time += utt.wav.shape[-1] / sr
        self._events(writer, rows, info)
        ref, hyp = metrics.normalize_text(utt.row["wrd"]), metrics.normalize_text(hyp)
        e = metrics.errors(ref.split(), hyp.split())
        writer.transcript(Transcript(info.position, utt.id, info.domain, info.segment,
                                     utt.duration, ref, hyp, e.n_ref, e.n_err, e.n_sub, e.n_del,
                                     e.n_ins))

    def _events(self, writer, rows, info):
        """The method's events: resets (tagged with the utterance that triggered them), LII."""
        events, self.method.events = self.method.events, []
        skips = [ev.reason for ev in events if ev.kind == "skip"]
        if skips:   # the method logged each one; name the utterance once
            logger.warning("%s (position %d): %d adaptation step(s) skipped (%s); the skipped "
                           "steps did not change the parameters (a model whose every step is "
                           "skipped has diverged: the run's warnings say so)", info.id,
                           info.position, len(skips), "; ".join(sorted(set(skips))))
        for ev in events:
            if ev.kind == "reset":
                after = islice(rows, ev.position, None)    # (no copy of the rest a reset)
                if ev.position >= len(rows) or all(      # after the last utterance, or the
                        self.stream_loader.manifest_reason(r) for r in after):  # rest skipped
                    logger.info("%s reset after the last utterance (%s): not recorded, no "
                                "utterance is decoded from it", self.tag, ev.reason)
                    continue
                rid = rows[ev.position]["ID"]
                logger.info("%s reset: position %d (%s) starts from the source model (%s)",
                            self.tag, ev.position, rid, ev.reason)
                writer.reset(Reset(ev.position, rid, ev.reason, info.position))
            elif ev.kind == "lii":
                writer.lii(ev.position, ev.value, ev.reason)

