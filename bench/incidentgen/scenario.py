"""An incident: what goes wrong where (odd, missing, corrupt, timed-out ranks, whole silent
nodes), each rank's plan, and the files written for them with `truth.json`."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from diag.proto import hosting_service_pb2 as xpu_pb2

from .formats import (
    Addresses,
    diag_dump,
    folded_lines,
    gdb_frames,
    pyspy_dump,
    rank_threads,
    xpu_dump,
)
from .model import RankPlan

FORMATS = ("diag", "xpu", "pyspy", "mixed")
SCENARIOS = ("odd", "agree")
TRUTH_FILE = "truth.json"


@dataclass(frozen=True)
class Truth:
    world_size: int
    local_world_size: int
    scenario: str
    format: str
    seed: int
    odd_ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]  # no dump file at all
    missing_nodes: tuple[int, ...]  # node index: ranks node*local .. node*local+local-1
    corrupt_ranks: tuple[int, ...]  # a file that does not decode
    timed_out_ranks: tuple[int, ...]  # a file saying the dump timed out, without stacks
    extra_feeder_ranks: tuple[int, ...]  # one queue feeder more than the others
    fewer_feeder_ranks: tuple[int, ...]
    renumbered_ranks: int  # ranks whose helper threads carry other counter numbers
    python_threads: int  # per ordinary rank
    native_threads: int
    deepest_native: int
    formats: dict[str, int] = field(default_factory=dict)  # files per format

    @property
    def unanswered(self) -> tuple[int, ...]:
        """Ranks without a usable dump: missing, corrupt or timed out."""
        return tuple(sorted({*self.missing_ranks, *self.corrupt_ranks, *self.timed_out_ranks}))

    def node_ranks(self, node: int) -> range:
        return range(node * self.local_world_size, (node + 1) * self.local_world_size)

    @classmethod
    def load(cls, directory: Path) -> Truth:
        raw = json.loads((Path(directory) / TRUTH_FILE).read_text())
        for k, v in raw.items():
            if isinstance(v, list):
                raw[k] = tuple(v)
        return cls(**raw)


# -- the incident --------------------------------------------------------------------------------


def _pick(rng: random.Random, pool: list[int], n: int) -> list[int]:
    out = sorted(rng.sample(pool, min(n, len(pool))))
    for r in out:
        pool.remove(r)
    return out


def plan_incident(
    world: int,
    *,
    local: int = 8,
    scenario: str = "odd",
    fmt: str = "diag",
    seed: int = 1,
    odd: int = 1,
    missing_nodes: int = 1,
    missing_ranks: int = 2,
    corrupt: int = 2,
    timed_out: int = 1,
) -> Truth:
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    if world % local:
        raise ValueError(f"world size {world} is no multiple of the local world size {local}")
    rng = random.Random(seed)
    nodes = world // local
    dead_nodes = sorted(rng.sample(range(1, nodes), min(missing_nodes, max(nodes - 1, 0))))
    pool = [r for r in range(world) if r // local not in dead_nodes]
    odd_ranks = _pick(rng, pool, odd) if scenario == "odd" else []
    gone = _pick(rng, pool, missing_ranks)
    bad = _pick(rng, pool, corrupt)
    late = _pick(rng, pool, timed_out)
    more = _pick(rng, pool, max(1, world // 1000))
    fewer = _pick(rng, pool, max(1, world // 2000))
    missing = sorted({*gone, *(r for n in dead_nodes for r in range(n * local, (n + 1) * local))})
    return Truth(
        world_size=world,
        local_world_size=local,
        scenario=scenario,
        format=fmt,
        seed=seed,
        odd_ranks=tuple(odd_ranks),
        missing_ranks=tuple(missing),
        missing_nodes=tuple(dead_nodes),
        corrupt_ranks=tuple(bad),
        timed_out_ranks=tuple(late),
        extra_feeder_ranks=tuple(more),
        fewer_feeder_ranks=tuple(fewer),
        renumbered_ranks=0,
        python_threads=0,
        native_threads=0,
        deepest_native=0,
    )


FEEDERS = 4


def rank_plan(truth: Truth, rank: int) -> RankPlan:
    rng = random.Random(truth.seed * 1_000_003 + rank)
    odd = 0
    if rank in truth.odd_ranks:
        odd = 1 + truth.odd_ranks.index(rank) % 2
    # Most ranks start their helpers in one order; some started one or five threads more first
    # (an extra loader, a retry), which shifts every `Thread-N` number: Thread-9 vs Thread-10.
    x = rng.random()
    shift = 0 if x < 0.7 else 1 if x < 0.9 else 5
    feeders = FEEDERS + (rank in truth.extra_feeder_ranks) - (rank in truth.fewer_feeder_ranks)
    return RankPlan(rank, odd, shift, feeders, truth.seed * 7919 + rank)


def file_format(truth: Truth, rank: int) -> str:
    if truth.format != "mixed":
        return truth.format
    return ("diag", "xpu", "pyspy")[rank % 3]


SUFFIX = {"diag": ".stack.json", "xpu": ".stacktrace", "pyspy": ".pyspy.json"}


def rank_file(
    truth: Truth, rank: int, folded: tuple[list[str], list[str]] | None = None
) -> tuple[str, bytes] | None:
    """The file name and content of one rank's dump, None when it has none. `folded`: lists the
    rank's folded lines are added to (py view, native view) when its dump is readable."""
    if rank in truth.missing_ranks:
        return None
    fmt = file_format(truth, rank)
    name = f"{rank:05d}-{truth.world_size:05d}{SUFFIX[fmt]}"
    plan = rank_plan(truth, rank)
    rng = random.Random(plan.seed)
    state = "S (sleeping)"
    if rank in truth.timed_out_ranks:
        return name, _timed_out(truth, rank, fmt)
    rt = rank_threads(plan, rng)
    addr = Addresses(rng)
    if fmt == "diag":
        data = orjson.dumps(diag_dump(rt, rank, truth.world_size, truth.local_world_size, state))
    elif fmt == "pyspy":
        data = orjson.dumps(pyspy_dump(rt, addr))
    else:
        data = xpu_dump(rt, rank, state, addr)
    if rank in truth.corrupt_ranks:
        data = _corrupt(data, fmt)
    elif folded is not None:
        py, cpp = folded_lines(rt, state)
        folded[0].extend(py)
        folded[1].extend(cpp)
    return name, data


def _timed_out(truth: Truth, rank: int, fmt: str) -> bytes:
    why = "py-spy dump timed out after 30 s"
    if fmt == "diag":
        return orjson.dumps(
            {
                "rank": rank,
                "world_size": truth.world_size,
                "pid": 4242,
                "node": f"node-{rank // truth.local_world_size:04d}",
                "local_rank": rank % truth.local_world_size,
                "process_state": "S (sleeping)",
                "native": False,
                "threads": [],
                "error": why,
                "format": "diag.stack/1",
            }
        )
    if fmt == "pyspy":
        return b"[]"  # what a py-spy that gave up in the middle leaves: no thread
    return xpu_pb2.Stacktrace(
        pid=4242,
        rank=rank,
        process_state="S (sleeping)",
        pyspy_stderr=f"Error: {why}",
        pstack_stderr="gdb: timeout after 30 s, killed",
    ).SerializeToString()


def _corrupt(data: bytes, fmt: str) -> bytes:
    if fmt == "xpu":
        # cut inside a length-delimited field: the protobuf runtime refuses it
        return data[: len(data) // 2]
    return data[: len(data) // 3]


def _counts(truth: Truth) -> tuple[int, int, int]:
    plan = RankPlan(0, 0, 0, FEEDERS, 0)
    rt = rank_threads(plan, random.Random(0))
    py = sum(1 for m, _, _ in rt.threads if m.py)
    deepest = max(len(gdb_frames(m.frames)) for m, _, _ in rt.threads)
    return py, len(rt.threads), deepest


def _shifted(truth: Truth) -> int:
    return sum(1 for r in range(truth.world_size) if rank_plan(truth, r).counter_shift)


def write_incident(
    directory: Path, truth: Truth, workers: int = 1, folded: Path | None = None
) -> Truth:
    """Writes every rank's dump and `truth.json` into `directory`; returns the truth completed
    with what it counted. `folded`: a directory to write the readable ranks' stacks into as
    flamegraph.pl's folded input, `py.N.folded` and `cpp.N.folded` (one pair per worker)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if folded is not None:
        Path(folded).mkdir(parents=True, exist_ok=True)
    ranks = list(range(truth.world_size))
    if workers > 1 and len(ranks) > 256:
        import multiprocessing

        chunks = [ranks[i::workers] for i in range(workers)]
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers) as pool:
            parts = pool.starmap(
                _write_ranks, [(directory, truth, ch, folded, i) for i, ch in enumerate(chunks)]
            )
    else:
        parts = [_write_ranks(directory, truth, ranks, folded, 0)]
    formats: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            formats[k] = formats.get(k, 0) + v
    py, native, deepest = _counts(truth)
    done = Truth(
        **{
            **asdict(truth),
            "renumbered_ranks": _shifted(truth),
            "python_threads": py,
            "native_threads": native,
            "deepest_native": deepest,
            "formats": dict(sorted(formats.items())),
        }
    )
    (directory / TRUTH_FILE).write_text(json.dumps(asdict(done), indent=1) + "\n")
    return done


def _write_ranks(
    directory: Path, truth: Truth, ranks: list[int], folded: Path | None, part: int
) -> dict[str, int]:
    formats: dict[str, int] = {}
    lines: tuple[list[str], list[str]] | None = ([], []) if folded is not None else None
    outs = []
    if folded is not None:
        outs = [open(Path(folded) / f"{v}.{part}.folded", "w") for v in ("py", "cpp")]  # noqa: SIM115
    try:
        for r in ranks:
            found = rank_file(truth, r, lines)
            if found is None:
                continue
            name, data = found
            with open(os.path.join(directory, name), "wb") as fh:
                fh.write(data)
            fmt = file_format(truth, r)
            formats[fmt] = formats.get(fmt, 0) + 1
            if lines is not None:
                for out, got in zip(outs, lines, strict=True):
                    out.writelines(got)
                    got.clear()
    finally:
        for out in outs:
            out.close()
    return formats


def iter_sizes(directory: Path) -> Iterator[int]:
    for e in os.scandir(directory):
        if e.name != TRUTH_FILE:
            yield e.stat().st_size
