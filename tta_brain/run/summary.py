"""The end of a run: ``wer.txt`` and ``summary.json`` computed from the written records (never from
memory, so a resumed run summarises exactly like an uninterrupted one)."""
import logging
from typing import Dict, List

from tta_brain.data.loader import boundaries
from tta_brain.run.envinfo import describe_device, versions
from tta_brain.asr.metrics import error_rate
from tta_brain.run.records import (Summary, read_rejects, read_resets, read_transcripts,
                               write_summary, write_wer_file)

logger = logging.getLogger(__name__)

__all__ = ["summarise"]


def summarise(folder, rows: List[Dict], state, method, tag: str, stream: str, seed,
              hparams: Dict, device: str, fingerprint: Dict = None,
              warnings: List[str] = ()) -> Summary:
    """Write ``wer.txt`` and ``summary.json`` of the run in ``folder``; return the summary.

    ``rows``: the stream manifest's rows (true boundaries); ``state``: the run's
    :class:`~tta_brain.run.checkpoint.StreamState` (time spent); ``method``: its pass counts.
    """
    transcripts = read_transcripts(folder)
    write_wer_file(folder, transcripts)
    per_dom: Dict[str, List[int]] = {}
    for t in transcripts:
        e = per_dom.setdefault(t.domain, [0, 0])
        e[0], e[1] = e[0] + t.n_err, e[1] + t.n_words
    n_err = sum(t.n_err for t in transcripts)
    n_words = sum(t.n_words for t in transcripts)
    rejects = read_rejects(folder)
    wall, audio = state.wall_time, state.audio_time
    summary = Summary(
        method=tag, stream=stream, seed=seed, wer=error_rate(n_err, n_words),
        wer_per_domain={d: error_rate(e, w) for d, (e, w) in per_dom.items()},
        n_utts=len(transcripts), n_words=n_words, n_err=n_err, n_skipped=len(rejects),
        skipped=[{"position": r.position, "ID": r.ID, "reason": r.reason} for r in rejects],
        resets=[r.position for r in read_resets(folder)], boundaries=boundaries(rows),
        counts=dict(method.counts), wall_time_s=wall, audio_s=audio,
        time_per_audio_s=wall / max(audio, 1e-9), num_adapted_params=method.num_adapted,
        hparams=dict(hparams), device=describe_device(device), versions=versions(),
        fingerprint=dict(fingerprint or {}), warnings=list(warnings))
    write_summary(folder, summary)
    wer = "-" if summary.wer is None or summary.wer != summary.wer else f"{summary.wer:.2f}%"
    logger.info("%s on %s: WER %s (%d utterances, %d skipped, %d resets)", tag, stream, wer,
                len(transcripts), len(rejects), len(summary.resets))
    if rejects:
        logger.warning("%d utterance(s) skipped, listed with the reasons in %s", len(rejects),
                       f"{folder}/rejects.csv")
    return summary
