"""What a method is told about an utterance (:class:`UttInfo`) and what it leaves for the driver
to record (:class:`Event`)."""
import math
from dataclasses import dataclass

__all__ = ["UttInfo", "Event"]


@dataclass
class UttInfo:
    """What a method may know about an utterance besides its audio."""
    id: str = ""
    position: int = 0          # 0-based position in the stream
    domain: str = ""
    segment: int = 0           # contiguous-block index (only oracle reset may look at it)


@dataclass(frozen=True, eq=False)
class Event:
    """Something the driver records: ``reset`` (``position`` = first utterance decoded from the
    reset model), ``lii`` (``value`` at ``position``, ``reason`` = stage) or ``skip`` (an
    adaptation step skipped at utterance index ``position``, ``reason`` = why).

    Two events are equal when their fields are, a nan ``value`` (no value) equal to a nan: the
    same on every Python (3.13's dataclass ``__eq__`` compares field by field, so nan != nan made
    two identical resets unequal; before, a tuple compare let only the same nan object pass)."""
    kind: str
    position: int
    reason: str = ""
    value: float = float("nan")

    def _key(self) -> tuple:
        return (self.kind, self.position, self.reason,
                None if math.isnan(self.value) else self.value)

    def __eq__(self, other):
        return self._key() == other._key() if isinstance(other, Event) else NotImplemented

    def __hash__(self):
        return hash(self._key())
