"""``summary.json``: its typed record (:class:`Summary`, the one reader and writer of the file) and
the end of a run: ``wer.txt`` and ``summary.json`` computed from the written records (never from
memory, so a resumed run summarises exactly like an uninterrupted one)."""
import json
import logging
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

from tta_brain.data.cache import replaced_when_written
from tta_brain.data.loader import boundaries
from tta_brain.data.manifest import ManifestError
from tta_brain.run.envinfo import describe_device, versions
from tta_brain.asr.metrics import char_errors, error_rate
from tta_brain.run.records import (RecordError, read_lii, read_rejects, read_resets,
                                   read_transcripts, write_wer_file)

logger = logging.getLogger(__name__)

__all__ = ["Summary", "read_summary", "write_summary", "summarise"]


@dataclass
class Summary:
    """``summary.json``: the run's result and what produced it."""
    method: str                             # tag, e.g. dsuta+dynamic
    stream: str
    seed: Optional[int]
    wer: Optional[float]                    # % (null without reference words)
    wer_per_domain: Dict[str, Optional[float]]
    n_utts: int
    n_words: int
    n_err: int
    n_skipped: int
    skipped: List[Dict]                     # [{position, ID, reason}]
    resets: List[int]
    boundaries: List[int]                   # positions where the manifest's segment changes
    counts: Dict[str, int]                  # passes: adapt_forward, adapt_backward, ...
    wall_time_s: float
    audio_s: float
    time_per_audio_s: float
    num_adapted_params: int
    hparams: Dict                           # the resolved scalar hparams of the run
    device: str
    versions: Dict[str, str]
    fingerprint: Dict = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)   # what the run could not do (e.g. reset)
    # character error rate (%), spaces counted (null in a summary written before it was added)
    cer: Optional[float] = None
    cer_per_domain: Dict[str, Optional[float]] = field(default_factory=dict)
    # rows of lii.csv (null in a summary written before it was added): checked as resets are
    n_lii: Optional[int] = None

    @property
    def steps(self) -> Optional[int]:
        value = self.hparams.get("steps")
        return None if value is None else int(value)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def percent(value) -> str:
    """A rate as the run's lines print it; "-" when there is none (no reference, or NaN)."""
    return "-" if value is None or value != value else f"{value:.2f}%"


def write_summary(folder, summary: Summary) -> None:
    """``summary.json``, written atomically (temporary file, fsync, rename: as the checkpoints,
    so a power loss does not leave an empty summary that marks the run finished)."""
    path = Path(folder) / "summary.json"
    with replaced_when_written(path, path.with_name(".summary.json.tmp")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({k: _json_safe(v) for k, v in asdict(summary).items()}, indent=2))
            f.flush()
            os.fsync(f.fileno())


def read_summary(folder) -> Summary:
    path = Path(folder) / "summary.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RecordError(f"{path}: cannot read ({err})") from None
    names = {f.name for f in fields(Summary)}
    required = {f.name for f in fields(Summary)
                if f.default is MISSING and f.default_factory is MISSING}
    if not isinstance(data, dict):           # (null or 5 was a TypeError below)
        raise RecordError(f"{path}: not a summary (a JSON {type(data).__name__}, not an object)")
    missing = sorted(n for n in required if n not in data)
    if missing:
        raise RecordError(f"{path}: not a summary of this tta_brain version (missing: "
                          f"{', '.join(missing)})")
    for key in ("wer_per_domain", "cer_per_domain"):   # an older run of a stream without
        data[key] = per_domain(data.get(key) or {})    # domains: its {"": rate} is no domain
    return Summary(**{k: v for k, v in data.items() if k in names})


def per_domain(rates: Dict[str, Optional[float]]) -> Dict[str, Optional[float]]:
    """A run's rates by domain; none for a stream without domains (a manifest of one's own
    without a ``domain`` column: each utterance's domain is ``""``), as the report has none."""
    return {} if set(rates) == {""} else rates


#: A run with at least this share of empty hypotheses (and two of them) gets a warning.
EMPTY_SHARE = 0.1


def health_warnings(transcripts, counts: Dict) -> List[str]:
    """What a finished run's records say about a model that went wrong, for ``summary.json``'s
    ``warnings`` and the report: skipped adaptation steps (a non-finite loss or gradient: a
    learning rate too high) and many empty hypotheses (a model collapsed to blank, or one whose
    outputs are NaN, decodes every utterance as nothing: a WER near 100 % that is no result of
    the method at its intended settings)."""
    out = []
    skipped = int(counts.get("skipped_steps", 0) or 0)
    if skipped:
        done = int(counts.get("adapt_backward", 0) or 0)
        out.append(f"{skipped} adaptation step(s) skipped for a non-finite loss or gradient "
                   f"({done} backward passes done): the adapted model may have diverged (a "
                   f"learning rate too high?); log.txt says at which utterances")
    empty = sum(1 for t in transcripts if not t.hyp.strip())
    if empty >= 2 and empty >= EMPTY_SHARE * len(transcripts):
        out.append(f"{empty} of {len(transcripts)} hypotheses are empty: a model that collapsed "
                   f"to blank outputs (or diverged to NaN) decodes every utterance as nothing")
    return out


def summarise(folder, rows: List[Dict], state, method, tag: str, stream: str, seed,
              hparams: Dict, device: str, fingerprint: Dict = None,
              warnings: List[str] = ()) -> Summary:
    """Write ``wer.txt`` and ``summary.json`` of the run in ``folder``; return the summary.

    ``rows``: the stream manifest's rows (true boundaries); ``state``: the run's
    :class:`~tta_brain.run.checkpoint.StreamState` (time spent); ``method``: its pass counts.
    """
    transcripts = read_transcripts(folder)
    rejects = read_rejects(folder)
    if not transcripts:          # every utterance skipped: no WER (was SpeechBrain's ZeroDivision)
        first = f" (first: {rejects[0].ID}: {rejects[0].reason})" if rejects else ""
        raise ManifestError(f"{stream}: none of its {len(rejects)} utterances was decoded{first}; "
                            f"every reason is in {Path(folder) / 'rejects.csv'}: fix what they "
                            f"name (audio, --data_root, the manifest), delete {folder} (it holds "
                            f"no transcript) and rerun")
    write_wer_file(folder, transcripts)
    per_dom: Dict[str, List[int]] = {}
    for t in transcripts:
        c = char_errors(t.ref, t.hyp)
        e = per_dom.setdefault(t.domain, [0, 0, 0, 0])
        e[0], e[1], e[2], e[3] = e[0] + t.n_err, e[1] + t.n_words, e[2] + c.n_err, e[3] + c.n_ref
    n_err = sum(t.n_err for t in transcripts)
    n_words = sum(t.n_words for t in transcripts)
    wall, audio = state.wall_time, state.audio_time
    health = health_warnings(transcripts, method.counts)
    for line in health:
        logger.warning("%s on %s: %s", tag, stream, line)
    summary = Summary(
        method=tag, stream=stream, seed=seed, wer=error_rate(n_err, n_words),
        wer_per_domain=per_domain({d: error_rate(e, w) for d, (e, w, _, _) in per_dom.items()}),
        n_utts=len(transcripts), n_words=n_words, n_err=n_err, n_skipped=len(rejects),
        skipped=[{"position": r.position, "ID": r.ID, "reason": r.reason} for r in rejects],
        resets=[r.position for r in read_resets(folder)], boundaries=boundaries(rows),
        n_lii=len(read_lii(folder)),
        counts=dict(method.counts), wall_time_s=wall, audio_s=audio,
        time_per_audio_s=wall / max(audio, 1e-9), num_adapted_params=method.num_adapted,
        hparams=dict(hparams), device=describe_device(device), versions=versions(),
        fingerprint=dict(fingerprint or {}), warnings=list(warnings) + health,
        cer=error_rate(sum(e[2] for e in per_dom.values()), sum(e[3] for e in per_dom.values())),
        cer_per_domain=per_domain({d: error_rate(ce, cr)
                                   for d, (_, _, ce, cr) in per_dom.items()}))
    write_summary(folder, summary)
    logger.info("%s on %s: WER %s, CER %s (%d utterances, %d skipped, %d resets)", tag, stream,
                percent(summary.wer), percent(summary.cer), len(transcripts), len(rejects),
                len(summary.resets))
    if rejects:
        logger.warning("%d utterance(s) skipped, listed with the reasons in %s", len(rejects),
                       f"{folder}/rejects.csv")
    return summary
