"""A PID is believed to be a rank only once the process shows it: a meta is a claim, and whoever
can write one could name any process (a root daemon, the agent's neighbour) to have it dumped or
signalled.

The process must
- be the one the meta names: the same start time (a reused PID is someone else);
- not be the agent, nor one of its descendants (its py-spy runs, its dump helper): the agent
  maps the journals it reads, and a meta naming the agent would have it stop itself;
- map the journal the meta belongs to (or one of the rank's slots) shared and writable: what
  only its writer has, for life (the agent, or anyone who merely opened the file, maps it
  read-only or not at all);
- run as a trusted user (root, the agent's user, the trainer's): real and effective uid;
- live in the agent's PID namespace (the PIDs the agent signals are of its own numbering), and in
  the one the meta names when it names one.

`judge` is the decision on plain facts; `RankProver` reads them from /proc, once per
(pid, start time, journal), and caches the verdict: a process cannot stop being what it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from diag.formats.rundir import pid_namespace
from diag.formats.untrusted import Owners

log = logging.getLogger(__name__)

_START_TIME_SLACK = 0.05  # psutil rounds create_time to 10 ms ticks
_MAPS_MAX_BYTES = 64 << 20  # a big trainer's maps run to a few MiB
_MAX_DEPTH = 256  # ancestors looked at: deeper trees are not how ranks are started
FileId = tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True)
class RankClaim:
    """What a meta says of its writer."""

    pid: int
    start_time: float
    files: frozenset[FileId]  # the journal (or slots) it must map or hold open
    pid_ns: int = 0  # the writer's PID namespace, 0 when the meta does not say


@dataclass(frozen=True)
class ProcFacts:
    """What the kernel says of the process behind a PID."""

    exists: bool
    start_time: float = 0.0
    uids: tuple[int, ...] = ()  # real, effective
    pid_ns: int = 0  # 0: unreadable
    files: frozenset[FileId] = frozenset()  # mapped shared and writable
    ancestors: tuple[int, ...] = ()  # its parent, the parent's parent, ... up to PID 1


@dataclass(frozen=True)
class RankProof:
    ok: bool
    reason: str = ""
    exists: bool = True  # False: the process the claim names is gone (not: someone else)

    def __bool__(self) -> bool:
        return self.ok


PROVEN = RankProof(True)


def judge(
    claim: RankClaim,
    facts: ProcFacts,
    owners: Owners,
    own_pid_ns: int,
    agent_pids: frozenset[int] = frozenset(),
) -> RankProof:
    """Whether `facts` show the process `claim` names; the reason when they do not.
    `agent_pids` are the agent's own processes (itself, its dump helper): neither they nor a
    descendant of theirs is ever a rank."""
    if not facts.exists:
        return RankProof(False, f"no process {claim.pid} is running", exists=False)
    if abs(facts.start_time - claim.start_time) > _START_TIME_SLACK:
        return RankProof(
            False, f"PID {claim.pid} is another process (it started at another time)", exists=False
        )
    if claim.pid in agent_pids or agent_pids & set(facts.ancestors):
        return RankProof(False, f"PID {claim.pid} is the agent's own process or its child")
    untrusted = [u for u in facts.uids if u not in owners.uids]
    if not facts.uids or untrusted:
        allowed = ", ".join(str(u) for u in sorted(owners.uids))
        return RankProof(
            False, f"PID {claim.pid} runs as uid {facts.uids or '?'}, not a trainer's ({allowed})"
        )
    if not facts.pid_ns or facts.pid_ns != own_pid_ns:
        return RankProof(False, f"PID {claim.pid} is not in the agent's PID namespace")
    if claim.pid_ns and claim.pid_ns != facts.pid_ns:
        return RankProof(False, f"PID {claim.pid} is not in the PID namespace the meta names")
    if not claim.files & facts.files:
        return RankProof(False, f"PID {claim.pid} does not map the journal shared and writable")
    return PROVEN


class RankProver:
    """Proves PIDs of metas against /proc, caching each verdict."""

    def __init__(
        self,
        owners: Owners,
        pid_ns: int | None = None,
        agent_pids: frozenset[int] | None = None,
    ) -> None:
        self.owners = owners
        self.pid_ns = pid_namespace() if pid_ns is None else pid_ns
        # This process, and the one that started it when that is a diag agent too (the dump
        # helper proves for its agent).
        self.agent_pids = agent_pids if agent_pids is not None else frozenset({os.getpid()})
        self._cache: dict[RankClaim, RankProof] = {}

    def check(self, claim: RankClaim) -> RankProof:
        """The verdict on `claim`; a cached proof still needs the process to be the one that
        started then (a PID reused since is not it)."""
        cached = self._cache.get(claim)
        if cached is not None:
            if cached.ok and not _same_start(claim.pid, claim.start_time):
                return RankProof(
                    False, f"PID {claim.pid} is no longer the rank's process", exists=False
                )
            return cached
        facts = read_facts(claim.pid, claim.files)
        proof = judge(claim, facts, self.owners, self.pid_ns, self.agent_pids)
        if facts.exists:  # "no such process" is not final: a claim may be read before its start
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[claim] = proof
        return proof

    def forget(self, pid: int) -> None:
        for claim in [c for c in self._cache if c.pid == pid]:
            del self._cache[claim]


def file_id(path: os.PathLike[str] | str) -> FileId | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def claim_of(
    pid: int, start_time: float, files: Iterable[FileId | None], pid_ns: int = 0
) -> RankClaim:
    return RankClaim(pid, start_time, frozenset(f for f in files if f is not None), pid_ns)


def _same_start(pid: int, start_time: float) -> bool:
    try:
        return abs(psutil.Process(pid).create_time() - start_time) <= _START_TIME_SLACK
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def read_facts(pid: int, want: frozenset[FileId] = frozenset()) -> ProcFacts:
    """The facts of `pid`; of its files, only which of those in `want` it maps shared and
    writable."""
    try:
        proc = psutil.Process(pid)
        start = proc.create_time()
        uids = proc.uids()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return ProcFacts(exists=False)
    return ProcFacts(
        exists=True,
        start_time=start,
        uids=(uids.real, uids.effective),
        pid_ns=pid_namespace(pid),
        files=_mapped_writable(pid, want),
        ancestors=_ancestors(pid),
    )


def _ancestors(pid: int) -> tuple[int, ...]:
    """Its parent, the parent's parent and so on (stat's ppid field), nearest first."""
    out: list[int] = []
    while pid > 1 and len(out) < _MAX_DEPTH:
        pid = _ppid(pid)
        if pid <= 0 or pid in out:
            break
        out.append(pid)
    return tuple(out)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return 0
    # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, the last ')' ends it.
    fields = raw[raw.rfind(b")") + 1 :].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return 0


def _mapped_writable(pid: int, want: frozenset[FileId]) -> frozenset[FileId]:
    """Those of `want` that /proc/PID/maps (`start-end perms offset MM:mm inode path`) shows
    mapped shared and writable (`rw?s`). Where a file system shows other numbers in maps than
    to stat (overlayfs), a mapping is looked up in /proc/PID/map_files too."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            data = f.read(_MAPS_MAX_BYTES)
    except OSError:
        return frozenset()
    out: set[FileId] = set()
    for line in data.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 5 or fields[4] == b"0" or fields[1][1:2] != b"w" or fields[1][3:4] != b"s":
            continue
        with contextlib.suppress(ValueError):
            major, minor = (int(x, 16) for x in fields[3].split(b":"))
            ident = (os.makedev(major, minor), int(fields[4]))
            if ident in want:
                out.add(ident)
            elif len(fields) == 6 and fields[5].rstrip().endswith(b".journal"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/map_files/{fields[0].decode()}")
                    if (st.st_dev, st.st_ino) in want:
                        out.add((st.st_dev, st.st_ino))
    return frozenset(out)
