"""What a method is told about an utterance (:class:`UttInfo`) and what it leaves for the driver
to record (:class:`Event`)."""
from dataclasses import dataclass

__all__ = ["UttInfo", "Event"]


@dataclass
class UttInfo:
    """What a method may know about an utterance besides its audio."""
    id: str = ""
    position: int = 0          # 0-based position in the stream
    domain: str = ""
    segment: int = 0           # contiguous-block index (only oracle reset may look at it)


@dataclass(frozen=True)
class Event:
    """Something the driver records: ``reset`` (``position`` = first utterance decoded from the
    reset model), ``lii`` (``value`` at ``position``, ``reason`` = stage) or ``skip`` (an
    adaptation step skipped at utterance index ``position``, ``reason`` = why)."""
    kind: str
    position: int
    reason: str = ""
    value: float = float("nan")
