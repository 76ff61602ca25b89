"""How many stack dumps may run at once: a pure decision from the container's limits.

Inside a container `os.cpu_count()` is the host's core count, so one py-spy per core would start
every rank's native dump at once (~300 MB each while py-spy loads libtorch's symbols) and get the
agent OOM-killed at the moment it is needed. The container's budget is its cgroup's CPU quota and
memory limit; `observe.cgroup` reads them, this module decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diag.agent.observe.containerlimits import ContainerLimits

MiB = 1 << 20


@dataclass(frozen=True)
class DumpCost:
    """Memory one py-spy dump takes while it runs."""

    each: int  # its own (anonymous) memory: parsed symbol tables, unwinding state
    shared: int = 0  # mapped library files: page cache, counted once however many dumps run


# Measured with bench/dump_memory.py on CPU ranks blocked in gloo collectives (BENCHMARKS.md,
# "Stack dumps"): --native peaked at 158 MiB anonymous and 191 MiB of mapped files (the largest
# of 8 dumps; +10% and rounded up here); a Python-only dump at 23 MiB in all. Images with CUDA
# libraries load more symbols: measure yours with the bench, cap it with --dump-parallel.
NATIVE_DUMP = DumpCost(each=176 * MiB, shared=192 * MiB)  # py-spy dump --native
PYTHON_DUMP = DumpCost(each=24 * MiB)  # py-spy dump: Python frames only
RESERVE_BYTES = 64 * MiB  # the agent's own growth while it parses and writes the dumps
# Native dumps started before one of them has been measured: the figures above hold for the
# images they were measured on; the first dumps' own peak decides how many run after them.
NATIVE_RAMP = 2


@dataclass(frozen=True)
class Parallelism:
    count: int  # dumps to run at once; 0: not even one fits in memory
    reason: str  # the limit that decided it


def dump_parallelism(
    dumps: int,
    limits: ContainerLimits,
    cost: DumpCost,
    *,
    override: int = 0,
    reserve: int = RESERVE_BYTES,
) -> Parallelism:
    """At most `dumps`, at most one per core of the CPU quota (or per usable CPU without one; an
    `override` > 0 replaces that CPU bound), and only as many as fit in the memory left under the
    tightest cgroup limit and on the host, less `reserve`: `cost.shared` once, `cost.each` per
    dump."""
    if dumps <= 0:
        return Parallelism(0, "nothing to dump")
    bounds: list[tuple[int, str]] = [(dumps, f"{dumps} rank(s)")]
    if override > 0:
        bounds.append((override, f"--dump-parallel {override}"))
    elif limits.cpu_quota is not None:
        cores = max(1, math.ceil(limits.cpu_quota - 1e-9))
        bounds.append((cores, f"CPU quota of {limits.cpu_quota:g} core(s)"))
    else:
        bounds.append((max(1, limits.cpus), f"{max(1, limits.cpus)} usable CPU(s)"))
    rooms = [
        (m.free, f"{_mib(m.free)} free under the {_mib(m.limit)} limit of {m.where or 'a cgroup'}")
        for m in limits.memory
    ]
    if limits.available is not None:
        rooms.append((limits.available, f"{_mib(limits.available)} available on the host"))
    if rooms:
        room, where = min(rooms, key=lambda r: r[0])
        fit = (room - reserve - cost.shared) // cost.each if cost.each > 0 else dumps
        if fit < 1:
            need = cost.each + cost.shared + reserve
            return Parallelism(0, f"{where}: one dump needs {_mib(need)}")
        bounds.append(
            (fit, f"memory: {where}, {_mib(cost.each)} per dump + {_mib(cost.shared)} shared")
        )
    count, reason = min(bounds, key=lambda b: b[0])  # the first of equal bounds names it
    return Parallelism(count, reason)


def learned_cost(model: DumpCost, peak_rss: int) -> DumpCost:
    """The cost of a dump once one was measured at `peak_rss` (its resident set: its own memory
    and the library pages it touched, which `model.shared` counts apart): never below the model.
    """
    return DumpCost(each=max(model.each, peak_rss - model.shared), shared=model.shared)


def first_wave(p: Parallelism, ramp: int = NATIVE_RAMP) -> Parallelism:
    """How many native dumps start before one has been measured."""
    if p.count <= ramp:
        return p
    return Parallelism(ramp, f"{ramp} first, then as their measured size allows ({p.reason})")


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB"
