"""The layers of diag, in one place: which room may import which, inside the agent and the
trainer which sub-room may import which, and which modules are pure.

`importgraph.py` reads every module's imports from its source and checks them against these
tables; `test_layers.py` runs the check, and docs/architecture.md draws the rooms from the same
graph (`python tests/architecture/diagram.py --write` redraws it).

What counts as an import: every `import` and `from ... import` anywhere in a module, at the top,
inside a function (a lazy import is still a dependency, only a later one) and under
`if TYPE_CHECKING:` (a type-only import still ties one room to another's names, and mypy follows
it). Relative imports are resolved against the importing module.
"""

from __future__ import annotations

# A room is a top-level package of diag: its folder `diag/<room>/`.
ROOMS = ("formats", "proto", "collector", "trainer", "viewer", "agent", "launch", "cli")

# Which rooms each room may import (its own modules always). Anything not listed is forbidden.
MAY_IMPORT: dict[str, frozenset[str]] = {
    # Shared by the trainer, the agent and the viewer, so it can depend on none of them.
    "formats": frozenset(),
    # Generated gRPC stubs and their generator.
    "proto": frozenset(),
    # Runs inside every rank: never the agent, whose code must not ride in the trainer's process.
    "collector": frozenset({"formats", "proto"}),
    "trainer": frozenset({"collector", "formats", "proto"}),
    # `diag merge` runs anywhere incident directories are copied to: formats only (proto for
    # xpu_timer's stack format).
    "viewer": frozenset({"formats", "proto"}),
    # The node agent: never the code that runs in the ranks, nor the viewer.
    "agent": frozenset({"formats", "proto"}),
    # `diag launch`: torchrun's agent with warm spares, next to the ranks (it may import torch;
    # a spare preloads the trainer, and the launcher reads the keys in-place recovery writes).
    "launch": frozenset({"formats", "trainer"}),
    # Every entry point; nothing imports it.
    "cli": frozenset({"formats", "proto", "collector", "trainer", "viewer", "agent", "launch"}),
}

# Imports across rooms that the table forbids but that are allowed all the same:
# (importing module, imported module) -> why. None today.
EXCEPTIONS: dict[tuple[str, str], str] = {}

# The pure cores: plain data in, verdicts and actions out, `now` passed in. No files, processes,
# sockets, clocks or logging. A name ending in `.*` stands for every module of that package.
PURE = (
    "diag.agent.detect.*",
    "diag.agent.drain.plan",
    "diag.agent.evidence.parallelism",
    "diag.agent.job.assembly",
    "diag.agent.job.decisions",
    "diag.agent.job.fallback",  # the claimant of a fallback: when it concludes
    "diag.agent.job.jobstop",  # whether a node stops its ranks for another node's incident
    "diag.agent.job.nodeview",  # the node's view as plain data, parsed by checkedjson
    "diag.agent.job.silence",  # a peer silent at a death: the suspect
    "diag.agent.job.waiters",  # the compact rows of a view's waiting ranks
    "diag.agent.metrics.collectives",
    "diag.agent.metrics.rankstate",
    "diag.agent.observe.containerlimits",
    "diag.agent.precheck.classify",
    "diag.agent.precheck.grading",
    "diag.agent.precheck.keys",
    "diag.agent.precheck.liveness",
    "diag.agent.precheck.measurements",
    "diag.agent.precheck.rounds",
    "diag.agent.node.linkstate",
    "diag.agent.node.units",
    "diag.agent.privilege.stance",
    "diag.agent.replica.admission",  # whom the replica server keeps waiting, whom it serves
    "diag.agent.replica.auth",  # the proofs of the replica token
    "diag.agent.replica.handover",
    "diag.agent.replica.pace",
    "diag.agent.replica.ring",
    "diag.agent.retention.policy",  # what the agent keeps of its own output
    "diag.agent.taint.model",
    "diag.agent.taint.planner",
    "diag.trainer.elastic.search",
    "diag.trainer.flash.resume",
    "diag.trainer.flash.replicarounds",
    "diag.trainer.resilient.recovery",
    "diag.trainer.resilient.storekeys",  # names in the store: in-place recovery and diag launch
    "diag.launch.workerpolicy",  # diag launch: replace one worker, restart all, fail or done
    # The formats the cores work on: types and value checks, no I/O.
    "diag.formats.checkedjson",
    "diag.formats.exitcodes",
    "diag.formats.records",
    "diag.formats.refusals",
    "diag.formats.worlds",
)

# The standard library a pure module may import: computation on values only. `module.Name`
# allows `from module import Name` and nothing else of that module. Not here, on purpose: os,
# sys, io, pathlib (Path reads files; PurePosixPath is allowed), subprocess, socket, select,
# signal, threading, multiprocessing, time (a clock), random (hidden state), logging, tempfile,
# shutil, mmap, fcntl; and every third-party package (psutil, grpc, kubernetes, torch, ...).
PURE_STDLIB = frozenset(
    {
        "__future__",
        "abc",
        "bisect",
        "builtins",  # the types only, named where a method shadows one (Fields.int)
        "collections",
        "collections.abc",
        "copy",
        "dataclasses",
        # datetime's types and arithmetic; a core is handed `now`, never asks for it.
        "datetime",
        "enum",
        "fractions",
        "functools",
        "heapq",
        # keyed hashes of bytes given to them (the replica token's proofs); no state, no I/O
        "hashlib",
        "hmac",
        "itertools",
        # text to values and back, no files: json.load/dump take a file the caller opened.
        "json",
        "math",
        "numbers",
        "operator",
        "os.PathLike",
        "pathlib.PurePosixPath",
        "re",
        "statistics",
        "string",
        "struct",
        "textwrap",
        "types",
        "typing",
    }
)

# Inside a room: its sub-rooms, checked like the rooms (an import between two sub-rooms must be
# allowed, and no sub-rooms import each other in a cycle). A sub-room is a sub-package
# (`diag.agent.detect.*`) or a group of the room's top-level modules; every module of a room
# listed here belongs to exactly one of its sub-rooms.
SUB_ROOMS: dict[str, dict[str, tuple[str, ...]]] = {
    "agent": {
        "detect": ("diag.agent.detect.*",),
        "observe": ("diag.agent.observe.*",),
        "evidence": ("diag.agent.evidence.*",),
        "job": ("diag.agent.job.*",),
        "taint": ("diag.agent.taint.*",),
        "health": ("diag.agent.health.*",),
        "drain": ("diag.agent.drain.*",),
        "checkpoint": ("diag.agent.checkpoint.*",),
        "replica": ("diag.agent.replica.*",),
        "metrics": ("diag.agent.metrics.*",),
        "precheck": ("diag.agent.precheck.*",),
        # The node's own probes (NIC, NVML device health, units) that precheck, health, taint
        # and the options stand on.
        "node": ("diag.agent.node.*",),
        # Who the agent is: the privilege drop, the root dump helper, the agent's own directory.
        "privilege": ("diag.agent.privilege.*",),
        # Option tables: flag > environment > TOML, parsed into typed values.
        "optiontable": ("diag.agent.optiontable.*",),
        # How much of its own output the agent keeps: the decision and the pruning.
        "retention": ("diag.agent.retention.*",),
        # The agent's configuration, gathered from every sub-room's settings.
        "config": ("diag.agent.config.*",),
        # The loop that ties the sub-rooms together, and its executor of the core's actions.
        "loop": ("diag.agent", "diag.agent.loop.*"),
    },
    "trainer": {
        "control": ("diag.trainer.control.*",),
        "flash": ("diag.trainer.flash.*",),
        "graceful": ("diag.trainer.graceful.*",),
        "elastic": ("diag.trainer.elastic.*",),
        # In-place recovery: the training function run again in the same process after a fault.
        "resilient": ("diag.trainer.resilient.*",),
        # The one patch of a DeepSpeed engine's `step` that attach, flash and graceful run in.
        "stephooks": ("diag.trainer.stephooks",),
        # attach, steps and phases: the collector installed in the rank.
        "attach": ("diag.trainer.attach",),
        # The package itself: the API a training script imports (re-exports).
        "api": ("diag.trainer",),
        # Integrations that use the API as a training script does.
        "hf": ("diag.trainer.hf",),
        "demo_job": ("diag.trainer.demo_job",),
    },
}

# Which sub-rooms each sub-room may import (its own modules always); the rooms it may import
# are its room's (MAY_IMPORT). Each sub-package's docstring says the same in its "May import:"
# line, and a test holds the two together.
SUB_MAY_IMPORT: dict[str, dict[str, frozenset[str]]] = {
    "agent": {
        # The hang core, precheck and the retention decision stand on formats alone.
        "detect": frozenset(),
        "node": frozenset(),
        "precheck": frozenset({"node"}),
        "retention": frozenset(),
        "optiontable": frozenset({"node"}),  # sizes parse as the node's units do
        "observe": frozenset({"detect"}),
        "evidence": frozenset({"detect", "observe"}),
        "checkpoint": frozenset({"observe"}),
        # Replicas across nodes: slots and snapshots (formats) only.
        "replica": frozenset(),
        "drain": frozenset({"observe", "checkpoint"}),
        # The dump helper proves ranks (observe) and runs py-spy as evidence does.
        "privilege": frozenset({"observe", "evidence"}),
        # job, metrics and taint hear of incidents through evidence's IncidentReport.
        "job": frozenset({"detect", "evidence"}),
        "metrics": frozenset({"detect", "evidence", "precheck"}),
        "taint": frozenset(
            {"detect", "evidence", "job", "precheck", "node", "optiontable", "retention"}
        ),
        # Health monitors are evidence sources of taint, read with taint's settings.
        "health": frozenset({"taint", "node"}),
        "config": frozenset(
            {
                "detect",
                "observe",
                "checkpoint",
                "replica",
                "drain",
                "metrics",
                "taint",
                "health",
                "precheck",
                "node",
                "optiontable",
                "retention",
            }
        ),
        # The loop may import every other sub-room; nothing imports it.
        "loop": frozenset(
            {
                "detect",
                "observe",
                "evidence",
                "job",
                "taint",
                "health",
                "drain",
                "checkpoint",
                "replica",
                "metrics",
                "precheck",
                "optiontable",
                "retention",
                "config",
                "privilege",
                "node",
            }
        ),
    },
    "trainer": {
        "stephooks": frozenset(),
        "control": frozenset(),
        "graceful": frozenset({"control", "stephooks"}),
        "attach": frozenset({"control", "graceful", "stephooks"}),
        "elastic": frozenset({"attach", "graceful"}),
        "flash": frozenset({"attach", "control", "elastic", "graceful", "stephooks"}),
        "resilient": frozenset({"attach", "control", "flash"}),
        # The re-exports: nothing of the trainer imports the package itself.
        "api": frozenset({"attach", "flash", "graceful"}),
        "hf": frozenset({"control", "elastic", "graceful"}),
        "demo_job": frozenset({"api", "graceful"}),
    },
}
