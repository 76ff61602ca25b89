"""Evidence that a rank trains although it never marks a step: the pace of its ops. Pure.

A rank that marks steps (a DeepSpeed engine, `diag.trainer.step()`) leaves the warm-up limit after
`--warmup-steps` steps. A job that marks none (a plain torch.distributed loop, DDP or FSDP with
`attach()` alone) would keep the warm-up limit (900 s) forever. Its collectives still tell whether
it trains: a training loop completes ops at a steady pace, iteration after iteration, while
start-up (group set-up, parameter broadcasts, compilation, the first batches) comes in bursts
separated by long pauses.

The rank leaves warm-up at the first check where, over the last `span` seconds:
- it completed ops for the whole span: span = max(T, 6 x the longest pause between two of its
  completions in the last KEEP_S seconds). T (`--warmup-cadence`, 30 s) outlasts the start-up
  bursts; 6 x the longest pause gives each window below room for two pauses, so a slow iteration
  is seen several times before it is trusted (and a start-up pause of a minute keeps the rank in
  warm-up until it is KEEP_S old);
- split into WINDOWS (3) equal windows, each holds at least MIN_OPS (2) completions and the
  busiest at most MAX_RATE_RATIO (4) x the quietest: the pace neither stalls nor ramps up, as it
  does while a job starts (windows 10x apart, or empty). Windows of 10 s or more average out GC
  pauses and CPU contention, so 4x holds on a loaded node.
Once out of warm-up a rank stays out: its pace stops when it hangs, which is exactly when the
adaptive limit must hold. The stand-in for "the slowest recent step" is then the longest pause
between two completions, or the slowest op, in the last KEEP_S seconds: the longest a healthy
rank went without finishing a collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

KEEP_S = 300.0  # seconds of pace history kept per rank
WINDOWS = 3
MIN_OPS = 2
MAX_RATE_RATIO = 4.0
PAUSES_PER_WINDOW = 2


@dataclass(frozen=True)
class Bucket:
    """Completions within one second (of the monotonic clock)."""

    second: int
    ops: int
    longest_pause: float  # longest time since the previous completion, among these
    slowest_op: float  # longest enqueue-to-completion among these


@dataclass(frozen=True)
class Cadence:
    buckets: tuple[Bucket, ...] = ()  # oldest first; only seconds with completions
    last_end: float | None = None  # the newest completion
    steady_since: float | None = None  # when the evidence first held (it then stays)
    steady_over: float = 0.0  # the span it held over, seconds

    @property
    def steady(self) -> bool:
        return self.steady_since is not None

    @property
    def typical(self) -> float:
        """The longest pause between completions, or the slowest op, in the kept history."""
        return max((max(b.longest_pause, b.slowest_op) for b in self.buckets), default=0.0)

    @property
    def ops(self) -> int:
        return sum(b.ops for b in self.buckets)


def fold(c: Cadence, done: Iterable[tuple[float, float]], now: float, seconds: float) -> Cadence:
    """Adds completed ops, as (enqueue, end) times, and checks the evidence at `now`.
    `seconds` is T above; 0 turns the evidence off (the rank stays in warm-up)."""
    new = sorted(done, key=lambda d: d[1])
    if not new:
        # Without new completions the newest window only empties: nothing can change.
        return c
    buckets = {b.second: b for b in c.buckets}
    last = c.last_end
    for enq, end in new:
        pause = end - last if last is not None and end > last else 0.0
        last = end if last is None else max(last, end)
        sec = int(end // 1)
        b = buckets.get(sec)
        op_s = max(0.0, end - enq)
        if b is None:
            buckets[sec] = Bucket(sec, 1, pause, op_s)
        else:
            buckets[sec] = Bucket(
                sec, b.ops + 1, max(b.longest_pause, pause), max(b.slowest_op, op_s)
            )
    oldest = now - KEEP_S
    kept = tuple(buckets[s] for s in sorted(buckets) if s + 1 > oldest)
    out = replace(c, buckets=kept, last_end=last)
    if out.steady or seconds <= 0:
        return out
    span = steady_span(kept, now, seconds)
    if span is not None:
        out = replace(out, steady_since=now, steady_over=span)
    return out


def steady_span(buckets: tuple[Bucket, ...], now: float, seconds: float) -> float | None:
    """The span over which the pace is steady at `now` (see the module's text), else None."""
    if not buckets:
        return None
    longest = max(b.longest_pause for b in buckets)
    span = max(seconds, WINDOWS * PAUSES_PER_WINDOW * longest)
    start = now - span
    if span > KEEP_S or buckets[0].second > start:
        return None  # not running for the whole span yet (or too slow to judge)
    width = span / WINDOWS
    counts = [0] * WINDOWS
    for b in buckets:
        if b.second + 1 <= start:
            continue
        i = min(WINDOWS - 1, max(0, int((b.second - start) // width)))
        counts[i] += b.ops
    quietest, busiest = min(counts), max(counts)
    if quietest < MIN_OPS or busiest > MAX_RATE_RATIO * quietest:
        return None
    return span
