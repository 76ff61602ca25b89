"""How long a rank may go without progress before the agent calls it hung.

The limit adapts to the job: a multiple of the slowest recent step (a rank makes progress at least
once per step), clamped to a floor (noise on tiny steps) and a ceiling (the user's
`--hang-timeout`), and the ceiling stays below torch's collective timeout so evidence is on disk
before the process group aborts. The first steps (compilation, data loading, allocator warm-up)
and declared phases (eval, checkpoint) have limits of their own. A rank that marks no steps at
all leaves warm-up once its ops complete at a steady pace (cadence.py) and is then judged on the
longest pause between them.

The pace is the job's steady one: warm-up counts the steps of this launch (a restarted rank
resumes at its checkpoint's step but starts up as slowly as the first launch), and only steps
and ops that began once every rank of the node had warmed up count. Before that, waits are
start-up skew (a peer still importing, initialising or making its first save), not the job's
pace: counted, they would lift the limit to the ceiling until they left the history.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from diag.agent.detect.observation import Observation, OpView, Paced, RankSnapshot

# Stay this far below torch's collective timeout: evidence needs a moment, and once torch aborts
# the group the stacks no longer show where the ranks were stuck.
PG_TIMEOUT_MARGIN = 0.8


@dataclass(frozen=True)
class TimeoutPolicy:
    ceiling: float = 300.0  # --hang-timeout
    floor: float = 10.0
    factor: float = 5.0  # NVRx uses the same safety factor over observed intervals
    # The factor for a wait on ranks that sit idle outside any collective (overdue.py): a rank
    # that uses no CPU and does no I/O while others wait for it is stuck, not slow, so a smaller
    # multiple of the same pace tells it apart. 0: such waits get `factor` too.
    idle_factor: float = 2.0
    warmup_steps: int = 2
    warmup_timeout: float = 900.0
    # Seconds of steady op pace that end warm-up for a rank that marks no steps (cadence.py);
    # 0: such a rank keeps the warm-up limit.
    warmup_cadence: float = 30.0
    phase_timeouts: Mapping[str, float] = field(default_factory=dict)
    default_phase_timeout: float = 1800.0

    def __post_init__(self) -> None:
        if self.floor <= 0 or self.ceiling <= 0:
            raise ValueError("hang timeouts must be positive")
        if self.floor > self.ceiling:
            raise ValueError(
                f"the hang timeout floor ({self.floor:g} s) is above the ceiling "
                f"({self.ceiling:g} s); lower --hang-floor or raise --hang-timeout"
            )
        if self.factor < 1:
            raise ValueError(f"--hang-factor must be >= 1, got {self.factor:g}")
        if self.idle_factor != 0 and self.idle_factor < 1:
            raise ValueError(f"--idle-factor must be 0 (off) or >= 1, got {self.idle_factor:g}")
        if self.warmup_cadence < 0:
            raise ValueError(f"--warmup-cadence must be >= 0, got {self.warmup_cadence:g}")


@dataclass(frozen=True)
class Limit:
    seconds: float
    basis: str  # why this limit: "5.0 x slowest recent step 0.42 s", "phase eval", ...


def effective_ceiling(policy: TimeoutPolicy, pg_timeout: float) -> float:
    if pg_timeout > 0:
        return min(policy.ceiling, pg_timeout * PG_TIMEOUT_MARGIN)
    return policy.ceiling


def warmed_up_at(rank: RankSnapshot, policy: TimeoutPolicy) -> float | None:
    """When the rank ended the last warm-up step of this launch; None: not yet, or unknown."""
    n = policy.warmup_steps
    if rank.launch_steps is None or rank.launch_steps < n:
        return None
    if n <= 0:
        return float("-inf")
    ends = rank.launch_step_ends
    # A warm-up longer than the ends kept: the newest kept one is as early as we can tell.
    return ends[min(n, len(ends)) - 1] if ends else None


def settled_at(ranks: Iterable[RankSnapshot], policy: TimeoutPolicy) -> float | None:
    """From when the ranks run at the job's pace: the latest end of warm-up among the live ranks
    that report their launch's steps; inf while one of them still warms up (a rank without
    steps whose ops keep a steady pace does not hold the others back); None when none reports
    them (then all recent history counts)."""
    ends = []
    for r in ranks:
        if not r.alive or r.launch_steps is None or stepless(r):
            continue
        w = warmed_up_at(r, policy)
        if w is None:
            return float("inf")
        ends.append(w)
    return max(ends) if ends else None


def rank_limit(
    rank: RankSnapshot,
    policy: TimeoutPolicy,
    pg_timeout: float = 0.0,
    settled: float | None = None,
    now: float | None = None,
) -> Limit:
    """`settled`: from when the node's ranks run at the job's pace (`settled_at`); `now`: to say
    in the basis how long ago the interval that set the limit began."""
    if rank.phase:
        return phase_limit(rank.phase, policy)
    ceiling = effective_ceiling(policy, pg_timeout)
    launched = rank.step if rank.launch_steps is None else rank.launch_steps
    if launched < policy.warmup_steps:
        if stepless(rank) and rank.cadence is not None:
            return _adaptive(
                rank.cadence.typical,
                "longest pause between ops",
                policy,
                ceiling,
                "; no step marked, ops at a steady pace",
            )
        if launched == rank.step:
            return Limit(
                policy.warmup_timeout, f"warm-up (step {rank.step} < {policy.warmup_steps})"
            )
        return Limit(
            policy.warmup_timeout,
            f"warm-up ({launched} steps since this launch at step {rank.step - launched} "
            f"< {policy.warmup_steps})",
        )
    if rank.pace:
        return _paced(rank, policy, ceiling, settled, now)
    typical = max(max(rank.step_durations, default=0.0), rank.max_op_seconds)
    if typical <= 0:
        return Limit(ceiling, "ceiling (no step timing yet)")
    return _adaptive(typical, "slowest recent step/op", policy, ceiling)


def _paced(
    rank: RankSnapshot,
    policy: TimeoutPolicy,
    ceiling: float,
    settled: float | None,
    now: float | None,
) -> Limit:
    since = settled if settled is not None else warmed_up_at(rank, policy)
    counted = [p for p in rank.pace if since is None or p.start >= since]
    if not counted:
        return Limit(ceiling, "ceiling (no step or op since the ranks warmed up yet)")
    slowest: Paced = max(counted, key=lambda p: p.seconds)
    when = f", began {now - slowest.start:.1f} s ago" if now is not None else ""
    return _adaptive(
        slowest.seconds,
        "slowest step/op since warm-up",
        policy,
        ceiling,
        f"; {slowest.what}{when}",
    )


def stepless(rank: RankSnapshot) -> bool:
    """The rank marked no step but its ops show that it trains: out of warm-up (cadence.py)."""
    return rank.step == 0 and rank.cadence is not None and rank.cadence.steady


def _adaptive(
    typical: float, what: str, policy: TimeoutPolicy, ceiling: float, note: str = ""
) -> Limit:
    floor = min(policy.floor, ceiling)
    adaptive = policy.factor * typical
    if adaptive <= floor:
        return Limit(floor, f"floor ({policy.factor:g} x {what} {typical:.3g} s is below it{note})")
    if adaptive >= ceiling:
        return Limit(
            ceiling, f"ceiling ({policy.factor:g} x {what} {typical:.3g} s is above it{note})"
        )
    return Limit(adaptive, f"{policy.factor:g} x {what} {typical:.3g} s{note}")


def phase_limit(phase: str, policy: TimeoutPolicy) -> Limit:
    seconds = policy.phase_timeouts.get(phase, policy.default_phase_timeout)
    return Limit(seconds, f"phase {phase!r}")


def waits_outside_phases(
    r: RankSnapshot, op: OpView, members: tuple[int, ...], obs: Observation
) -> bool:
    """Every member that has not joined `r`'s op is known and outside any phase."""
    others = [m for m in members if m != r.rank]
    if not others:
        return False
    for m in others:
        other = obs.find(m)
        if other is None:
            return False  # its phase is unknown: the waiter's own phase limit stands
        joined = any(p.group == op.group and p.group_seq == op.group_seq for p in other.pending)
        if other.phase and not joined:
            return False
    return True
