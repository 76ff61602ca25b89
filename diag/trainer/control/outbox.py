"""What the rank's control client sends, one gRPC call per item of its outbox: registration,
persist requests (again, all pending ones, after a reconnect), command reports and the notes of
a completed snapshot and of a resume. The client's sending thread takes the items in order and
calls `deliver` while it is connected."""

from __future__ import annotations

import logging
from typing import Any, Protocol

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 3.0


class Sender(Protocol):
    """The client, as the calls need it."""

    def rank_id(self, pb: Any, job: str | None = None) -> Any: ...

    def register_request(self, pb: Any) -> Any: ...

    def pending(self) -> list[tuple[int, tuple[str, str]]]: ...  # step -> (save dir, job)

    def acknowledged(self, step: int) -> None: ...


def deliver(stub: Any, pb: Any, kind: str, arg: Any, client: Sender) -> None:
    """One item of the outbox as its call to the agent (grpc.RpcError when the call fails)."""
    if kind == "register":
        stub.Register(client.register_request(pb), timeout=CALL_TIMEOUT_S)
    elif kind in ("persist", "resend"):
        todo = client.pending()
        if kind == "persist":
            todo = [(s, d) for s, d in todo if s == arg]
        for step, (save_dir, job) in todo:
            reply = stub.Persist(
                pb.PersistRequest(id=client.rank_id(pb, job), step=step, save_dir=save_dir),
                timeout=CALL_TIMEOUT_S,
            )
            if not reply.accepted:
                log.warning("diag: agent refused to persist step %d: %s", step, reply.reason)
                client.acknowledged(step)
    elif kind == "saved":
        stub.Saved(pb.SavedNote(id=client.rank_id(pb), step=arg), timeout=CALL_TIMEOUT_S)
    elif kind == "resumed":
        n = arg
        stub.Resumed(
            pb.ResumeNote(
                id=client.rank_id(pb), source=n.source, step=n.step, reason=n.reason,
                memory_offered=n.memory_offered, held=n.held, run=n.run,
            ),
            timeout=CALL_TIMEOUT_S,
        )  # fmt: skip
    elif kind == "report":
        command_id, ok, detail, step, path = arg
        stub.Report(
            pb.CommandReport(
                id=client.rank_id(pb), command_id=command_id, ok=ok, detail=detail, step=step,
                path=path,
            ),
            timeout=CALL_TIMEOUT_S,
        )  # fmt: skip
