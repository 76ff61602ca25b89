"""The agent's commands that run at once on the control thread, with no step boundary: the
training thread may be stuck (in a collective, in a Python loop) and cannot reach one.

- DUMP: the rank writes its own Python stacks (diag.trainer.control.selfdump).
- RECOVER: the rank's in-place recovery is told of a fault (the agent's hang verdict). The
  recovery registers its entry point here while it runs (`recover_with`); without one the rank
  says it cannot, and the agent stops it instead.

Neither runs while another thread holds the GIL (a rank stuck in C code): the agent then hears
nothing back and acts as it would without the rank's help.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from diag.formats.untrusted import UntrustedInput
from diag.trainer.control.dumpbase import DumpBases
from diag.trainer.control.identity import ClientIdentity
from diag.trainer.control.message import AgentCommand, CommandKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoverAnswer:
    taken: bool  # the rank recovers (or has recovered since the verdict); False: it cannot
    detail: str


# (the fault's reason, when the agent reached its verdict in Unix seconds) -> the answer
RecoverHandler = Callable[[str, float], RecoverAnswer]

_lock = threading.Lock()
_recover: RecoverHandler | None = None
NOT_RESILIENT = "not under diag.trainer.resilient: this rank cannot recover in place"


class Reporter(Protocol):
    def report(
        self, command_id: str, ok: bool, *, detail: str = "", step: int = -1, path: str = ""
    ) -> None: ...


def recover_with(handler: RecoverHandler | None) -> None:
    """The in-place recovery's entry point for RECOVER while it runs (None when it ends)."""
    global _recover
    with _lock:
        _recover = handler


def is_immediate(cmd: AgentCommand) -> bool:
    return cmd.kind in (CommandKind.DUMP, CommandKind.RECOVER)


def run(cmd: AgentCommand, ident: ClientIdentity, bases: DumpBases, out: Reporter) -> None:
    if cmd.kind is CommandKind.DUMP:
        _dump(cmd, ident, bases, out)
    elif cmd.kind is CommandKind.RECOVER:
        _recover_now(cmd, out)


def _recover_now(cmd: AgentCommand, out: Reporter) -> None:
    with _lock:
        handler = _recover
    reason = f"the agent's verdict: {cmd.reason}" if cmd.reason else "the agent's verdict"
    if handler is None:
        out.report(cmd.id, False, detail=NOT_RESILIENT)
        return
    try:
        answer = handler(reason, cmd.verdict_time)
    except Exception as e:  # the recovery's own failure: the agent stops the rank instead
        log.warning("diag: the agent's RECOVER could not start the recovery: %s", e)
        out.report(cmd.id, False, detail=f"recovery failed: {type(e).__name__}: {e}"[:300])
        return
    out.report(cmd.id, answer.taken, detail=answer.detail)


def _dump(cmd: AgentCommand, ident: ClientIdentity, bases: DumpBases, out: Reporter) -> None:
    from diag.trainer.control.selfdump import write_own_dump

    try:
        path = write_own_dump(
            cmd.dump_dir, bases, rank=ident.rank, world_size=ident.world_size,
            local_rank=ident.local_rank, node=ident.node,
        )  # fmt: skip
        out.report(cmd.id, True, path=str(path))
    except UntrustedInput as e:
        log.warning("diag: refused to write a stack dump: %s", e)
        out.report(cmd.id, False, detail=f"refused: {e}")
    except OSError as e:
        out.report(cmd.id, False, detail=f"cannot write the dump: {e}")
