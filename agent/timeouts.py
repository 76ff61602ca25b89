"""How long a rank may go without progress before the agent calls it hung.

The limit adapts to the job: a multiple of the slowest recent step (a rank makes progress at least
once per step), clamped to a floor (noise on tiny steps) and a ceiling (the user's
`--hang-timeout`), and the ceiling stays below torch's collective timeout so evidence is on disk
before the process group aborts. The first steps (compilation, data loading, allocator warm-up)
and declared phases (eval, checkpoint) have limits of their own. A rank that marks no steps at
all leaves warm-up once its ops complete at a steady pace (cadence.py) and is then judged on the
longest pause between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from diag.agent.observation import RankSnapshot

# Stay this far below torch's collective timeout: evidence needs a moment, and once torch aborts
# the group the stacks no longer show where the ranks were stuck.
PG_TIMEOUT_MARGIN = 0.8


@dataclass(frozen=True)
class TimeoutPolicy:
    ceiling: float = 300.0  # --hang-timeout
    floor: float = 10.0
    factor: float = 5.0  # NVRx uses the same safety factor over observed intervals
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


def rank_limit(rank: RankSnapshot, policy: TimeoutPolicy, pg_timeout: float = 0.0) -> Limit:
    if rank.phase:
        return phase_limit(rank.phase, policy)
    ceiling = effective_ceiling(policy, pg_timeout)
    if rank.step < policy.warmup_steps:
        if stepless(rank) and rank.cadence is not None:
            return _adaptive(
                rank.cadence.typical,
                "longest pause between ops",
                policy,
                ceiling,
                "; no step marked, ops at a steady pace",
            )
        return Limit(policy.warmup_timeout, f"warm-up (step {rank.step} < {policy.warmup_steps})")
    typical = max(max(rank.step_durations, default=0.0), rank.max_op_seconds)
    if typical <= 0:
        return Limit(ceiling, "ceiling (no step timing yet)")
    return _adaptive(typical, "slowest recent step/op", policy, ceiling)


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
