"""How fast replicas may leave a node: a token bucket over the bytes sent.

Replication shares the node's network with the training's own collectives; `--replica-max-rate`
caps what pushes take of it. Pure: the caller passes the time and sleeps for the delay it gets.
Pulls are never paced: a node pulls its replica while its job is down, and every second counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Pace:
    """At most `rate` bytes per second on average, `burst` bytes at once."""

    rate: float  # bytes per second, > 0
    burst: float  # bytes that may leave at once (the bucket's size)
    _tokens: float = field(default=0.0, init=False)
    _at: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.rate > 0 or not self.burst > 0:
            raise ValueError(f"a pace needs a positive rate and burst ({self.rate}, {self.burst})")
        self._tokens = self.burst

    def take(self, nbytes: int, now: float) -> float:
        """Takes `nbytes` from the bucket at `now`; the seconds to wait before sending them."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= nbytes
        if self._tokens >= 0:
            return 0.0
        return -self._tokens / self.rate  # the debt, paid by waiting


def pace_for(rate: int, chunk: int) -> Pace | None:
    """The pace of `--replica-max-rate` bytes per second (0: none); a burst of a tenth of a
    second's worth, at least one `chunk` (what is sent at once), so the link sees no long
    bursts at full speed."""
    if rate <= 0:
        return None
    return Pace(float(rate), float(max(rate / 10, chunk)))
