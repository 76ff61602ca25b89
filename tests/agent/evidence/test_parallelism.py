"""How many stack dumps run at once: the pure decision, table-driven, with plain numbers."""

from __future__ import annotations

import pytest

from diag.agent.evidence.parallelism import DumpCost, dump_parallelism
from diag.agent.observe.containerlimits import ContainerLimits, MemoryLimit

MiB = 1 << 20
GiB = 1 << 30
DUMP = DumpCost(each=250 * MiB, shared=100 * MiB)
RESERVE = 64 * MiB


def limits(cpus: int = 96, quota: float | None = None, *memory: MemoryLimit, avail=None):
    return ContainerLimits(cpus=cpus, cpu_quota=quota, memory=tuple(memory), available=avail)


@pytest.mark.parametrize(
    ("dumps", "lim", "override", "count", "bound"),
    [
        # No limits at all: one per usable CPU, never more than there are ranks.
        (8, limits(96), 0, 8, "8 rank(s)"),
        (8, limits(2), 0, 2, "2 usable CPU(s)"),
        # A CPU quota replaces the host's core count (a fraction rounds up: it is CPU time).
        (8, limits(96, 4.0), 0, 4, "CPU quota of 4 core(s)"),
        (8, limits(96, 1.5), 0, 2, "CPU quota of 1.5 core(s)"),
        (8, limits(96, 0.1), 0, 1, "CPU quota of 0.1 core(s)"),
        # The shipped sidecar before: 1 GiB, the agent using 60 MiB; three native dumps fit.
        (8, limits(96, None, MemoryLimit(1 * GiB, 60 * MiB)), 0, 3, "memory"),
        # The same node with room for all eight.
        (8, limits(96, None, MemoryLimit(3 * GiB, 60 * MiB)), 0, 8, "8 rank(s)"),
        # Mapped library files are shared by the dumps: counted once (2048 - 64 - 100) // 250.
        (8, limits(96, None, MemoryLimit(2 * GiB, 0)), 0, 7, "memory"),
        # The tightest level counts (a pod limit above a looser container limit).
        (
            8,
            limits(96, None, MemoryLimit(8 * GiB, 1 * GiB), MemoryLimit(2 * GiB, 1 * GiB)),
            0,
            3,
            "memory",
        ),
        # Host memory available bounds it too, without any cgroup limit.
        (8, limits(96, None, avail=1 * GiB), 0, 3, "available on the host"),
        # Not even one fits: none is started (the Python stacks are on disk already).
        (8, limits(96, None, MemoryLimit(1 * GiB, 900 * MiB)), 0, 0, "one dump needs"),
        (8, limits(96, None, MemoryLimit(1 * GiB, 2 * GiB)), 0, 0, "one dump needs"),
        # The override replaces the CPU bound, never the memory bound.
        (8, limits(2), 8, 8, "8 rank(s)"),
        (8, limits(2, 1.0), 6, 6, "--dump-parallel 6"),
        (8, limits(2, None, MemoryLimit(1 * GiB, 60 * MiB)), 8, 3, "memory"),
        # Nothing to dump.
        (0, limits(8), 0, 0, "nothing to dump"),
    ],
)
def test_dump_parallelism(
    dumps: int, lim: ContainerLimits, override: int, count: int, bound: str
) -> None:
    got = dump_parallelism(dumps, lim, DUMP, override=override, reserve=RESERVE)
    assert got.count == count, got.reason
    assert bound in got.reason


def test_a_measured_dump_replaces_the_assumed_cost_only_upwards() -> None:
    from diag.agent.evidence.parallelism import learned_cost

    model = DumpCost(each=176 * MiB, shared=192 * MiB)
    # As measured on CPU ranks: 349 MiB resident, of which the shared libraries' pages.
    assert learned_cost(model, 349 * MiB) == model
    # A CUDA image whose py-spy peaked at 700 MiB: 508 MiB of its own from then on.
    assert learned_cost(model, 700 * MiB) == DumpCost(each=508 * MiB, shared=192 * MiB)


@pytest.mark.parametrize(("planned", "first"), [(8, 2), (2, 2), (1, 1), (0, 0)])
def test_the_first_wave_of_native_dumps(planned: int, first: int) -> None:
    from diag.agent.evidence.parallelism import Parallelism, first_wave

    got = first_wave(Parallelism(planned, "memory"))
    assert got.count == first
    assert ("measured size" in got.reason) == (planned > 2)
