"""Where a rank serves its flight recorder, and what it serves: the socket beside the journal and
the worker server's endpoints. The collector serves them (`diag.collector.frserver`), the agent
asks them (`diag.agent.evidence.frcapture`); both name the socket from the journal path alone, so
nothing read from a meta decides where the agent connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diag.formats.journalmeta import JOURNAL_SUFFIX

SOCKET_SUFFIX = ".fr.sock"


@dataclass(frozen=True)
class Handler:
    """One of the worker server's flight recorder endpoints, and the file its dump goes to."""

    name: str  # the path after /handler/
    backend: str  # what it records: "nccl" or "cpu" (gloo and the other CPU backends)
    suffix: str  # the incident file: {rank:05d}-{world:05d}<suffix>


# NCCL first: on a GPU job it holds the collectives that matter.
HANDLERS = (
    Handler("dump_nccl_trace_json", "nccl", ".nccl.json"),
    Handler("fr_trace_json", "cpu", ".json"),
)


def socket_path(journal: Path) -> Path:
    """Where the rank of `journal` serves its flight recorder."""
    name = journal.name
    stem = name[: -len(JOURNAL_SUFFIX)] if name.endswith(JOURNAL_SUFFIX) else name
    return journal.with_name(stem + SOCKET_SUFFIX)
