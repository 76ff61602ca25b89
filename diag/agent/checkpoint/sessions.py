"""The ranks connected over the control channel, and the commands sent to them.

Each rank registers (again after every reconnect) and keeps one stream open; messages for it
(commands, persist acknowledgements) wait in its outbox until the stream sends them. Reports of
carried-out commands are collected by command id. This is the API other parts of the agent use to
talk to ranks: `send_command` and `wait_reports`.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast


class CommandKind:
    """The values of control.proto's CommandKind."""

    FLUSH = 1  # save a flash checkpoint at the next step boundary and persist it
    EXIT = 2  # flush, then leave the training loop (all ranks at the same step)
    DUMP = 3  # write the rank's own Python stacks into a directory
    RECOVER = 4  # recover in place: abort the process groups, run the function again


@dataclass(frozen=True)
class RankKey:
    job: str  # the safe job name (collector.meta.safe_job_name)
    rank: int


@dataclass(frozen=True)
class CommandReport:
    command_id: str
    rank: int
    ok: bool
    detail: str = ""
    step: int = -1  # FLUSH/EXIT: the step saved
    path: str = ""  # DUMP: the file written


@dataclass
class RankSession:
    key: RankKey
    pid: int
    start_time: float = 0.0  # the process's create time (0: not said)
    world_size: int = 0
    node: str = ""
    journal: str = ""
    save_dir: str = ""
    outbox: queue.Queue = field(default_factory=queue.Queue)  # AgentMessage; None ends the stream
    streaming: bool = False


class Sessions:
    def __init__(self) -> None:
        self._by_key: dict[RankKey, RankSession] = {}
        self._reports: dict[str, list[CommandReport]] = defaultdict(list)
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)
        self._ids = itertools.count(1)

    def register(self, key: RankKey, pid: int, **info: Any) -> RankSession:
        with self._lock:
            s = self._by_key.get(key)
            if s is None or s.pid != pid:
                if s is not None:
                    s.outbox.put(None)  # an older process of this rank: end its stream
                s = self._by_key[key] = RankSession(key, pid)
            for name, value in info.items():
                setattr(s, name, value)
            return s

    def set_streaming(self, session: RankSession, streaming: bool) -> None:
        with self._lock:
            session.streaming = streaming

    def of_job(self, job: str) -> dict[int, RankSession]:
        with self._lock:
            return {k.rank: s for k, s in self._by_key.items() if k.job == job}

    def jobs(self) -> list[str]:
        with self._lock:
            return sorted({k.job for k in self._by_key})

    def connected(self, job: str) -> list[int]:
        return sorted(r for r, s in self.of_job(job).items() if s.streaming)

    def post(self, key: RankKey, message: Any) -> bool:
        with self._lock:
            s = self._by_key.get(key)
        if s is None:
            return False
        s.outbox.put(message)
        return True

    def send_command(
        self,
        job: str,
        kind: int,
        ranks: list[int] | None = None,
        *,
        reason: str = "",
        dump_dir: str = "",
        exit_code: int = 0,
        verdict_time: float = 0.0,
    ) -> dict[int, str]:
        """Queues a command for the listed ranks of `job` that are connected (all when None);
        returns rank -> command id of those it was queued for."""
        from diag.proto import control_pb2 as pb

        sent = {}
        for rank, s in sorted(self.of_job(job).items()):
            if (ranks is not None and rank not in ranks) or not s.streaming:
                continue  # a rank that is gone or not listening would never see it
            cid = f"c{next(self._ids)}-r{rank}"
            cmd = pb.Command(
                id=cid,
                # The stub types kind as the enum class; its values are the plain ints here.
                kind=cast(pb.CommandKind, kind),
                reason=reason,
                dump_dir=dump_dir,
                exit_code=exit_code,
                verdict_time=verdict_time,
            )
            s.outbox.put(pb.AgentMessage(command=cmd))
            sent[rank] = cid
        return sent

    def report(self, r: CommandReport) -> None:
        with self._reported:
            self._reports[r.command_id].append(r)
            self._reported.notify_all()

    def wait_reports(self, ids: list[str], timeout: float) -> dict[str, CommandReport]:
        """The reports of the given commands that arrive within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._reported:
            while True:
                got = {i: self._reports[i][-1] for i in ids if self._reports.get(i)}
                left = deadline - time.monotonic()
                if len(got) == len(ids) or left <= 0:
                    return got
                self._reported.wait(left)

    def close(self) -> None:
        with self._lock:
            for s in self._by_key.values():
                s.outbox.put(None)
