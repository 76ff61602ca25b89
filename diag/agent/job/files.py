"""The job verdict's files on the shared timeline: its directories opened without following a
symlink, and what other nodes wrote there read back into our types.

Every node's agent writes into `<timeline>/.jobs/`, and so can anything else that can write
there: a report, a claim or a verdict is outside data. Each is read as a regular file under a
size cap (no FIFO, no symlink), and its fields are checked for type and range before the
verdict uses them: rank numbers and node counts within bounds, strings bounded and without
control characters, and the incident directories it names reduced to a name in this node's
timeline (a path in a report never leads anywhere else). A file that fails raises
`UntrustedInput` naming it; the caller leaves that one file out.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from diag.agent.job.decisions import JOB_VERDICT_FORMAT, JobVerdict, NodeReport, ReportName, Where
from diag.agent.job.nodeview import MAX_RANKS, check_view
from diag.formats import fastjson
from diag.formats.checkedjson import NAME, Fields
from diag.formats.untrusted import MIB, UntrustedInput, read_bounded

# A report is a few KiB (a node of 8 ranks: 5 KiB with its view); a verdict names the
# first-hand nodes, 16,000 of them at most in a real job (a cascade of deaths): about 4 MiB.
MAX_REPORT_BYTES = 16 * MIB
MAX_VERDICT_BYTES = 64 * MIB
MAX_CLAIM_BYTES = 4096
MAX_NODES = 1 << 17
SUMMARY = 1 << 16  # a verdict's summary or basis may list many ranks

_EVIDENCE = re.compile(r"^[A-Za-z0-9_.@~-]+$")


def evidence_in(timeline: Path, path: object, source: str, what: str = "evidence") -> str:
    """An incident directory named by another node, as a directory of this node's timeline:
    every node's incident directories sit directly in the shared timeline, so only the last
    component of what it wrote counts, and it must be a plain name."""
    if not isinstance(path, str) or len(path) > 4096:
        raise UntrustedInput(source, f"{what} must be a path of at most 4096 characters")
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name in ("", ".", "..") or _EVIDENCE.match(name) is None:
        raise UntrustedInput(source, f"{what} {path[:200]!r} does not end in an incident directory")
    return os.path.join(timeline, name)


def report_from(doc: object, source: str, timeline: Path) -> NodeReport:
    """A node's report as `json.loads` gave it, checked (its view too)."""
    return _report(Fields(doc, source), timeline, with_view=True)


def _report(f: Fields, timeline: Path, *, with_view: bool) -> NodeReport:
    view = f.d.get("view")
    return NodeReport(
        node=f.str("node"),
        culprit=f.opt_int("culprit", 0, MAX_RANKS - 1),
        where=f.enum("where", Where),
        evidence=evidence_in(timeline, f.d.get("evidence"), f.source, f"{f.where}.evidence"),
        kind=f.str("kind", ""),
        summary=f.str("summary", "", SUMMARY),
        wall=f.float("wall", 0.0),
        view=check_view(view, f.source) if with_view and view is not None else None,
        first_sign_wall=f.float("first_sign_wall", 0.0),
    )


def read_report(d: int, n: ReportName, path: str | Path, timeline: Path) -> tuple[NodeReport, int]:
    """The report named `n` in the directory `d` (at `path`), and its size. A report whose
    content blames another rank than its name does is refused with the rest."""
    try:
        raw = read_bounded(n.file, max_bytes=MAX_REPORT_BYTES, dir_fd=d)
    except UntrustedInput as e:
        raise UntrustedInput(path, e.problem) from None
    try:
        doc = fastjson.loads(raw)  # orjson: a claimant of a fallback reads thousands
    except (ValueError, RecursionError) as e:
        raise UntrustedInput(path, f"is not valid JSON: {e}") from None
    r = report_from(doc, str(path), timeline)
    if (r.culprit, r.where) != (n.culprit, n.where):
        raise UntrustedInput(path, "blames another rank than its name says")
    return r, len(raw)


def verdict_bytes(verdict: JobVerdict) -> bytes:
    doc = {"format": JOB_VERDICT_FORMAT, **asdict(verdict)}
    if verdict.first_hand is not None:
        doc["first_hand"]["where"] = verdict.first_hand.where.value
    return json.dumps(doc, indent=1).encode()


def verdict_from(doc: object, source: str, timeline: Path) -> JobVerdict:
    f = Fields(doc, source)
    if f.d.get("format") != JOB_VERDICT_FORMAT:
        raise f.fail("format", f"is not {JOB_VERDICT_FORMAT}")
    nodes = f.strs("nodes", MAX_NODES, NAME)
    evidence = tuple(
        evidence_in(timeline, e, source, f"evidence[{i}]")
        for i, e in enumerate(f.list("evidence", MAX_NODES))
    )
    if len(evidence) != len(nodes):
        raise f.fail("evidence", f"has {len(evidence)} entries for {len(nodes)} nodes")
    first = f.opt_obj("first_hand")
    return JobVerdict(
        incident_id=f.str("incident_id"),
        job=f.str("job"),
        culprit=f.opt_int("culprit", 0, MAX_RANKS - 1),
        culprit_node=f.str("culprit_node", ""),
        basis=f.str("basis", "", SUMMARY),
        nodes=nodes,
        evidence=evidence,
        first_hand=_report(first, timeline, with_view=False) if first is not None else None,
        decided_wall=f.float("decided_wall"),
        evidence_glob=f.str("evidence_glob", "", 4096),
        reports=f.int("reports", 0, MAX_NODES, len(nodes)),
        lost_nodes=f.strs("lost_nodes", MAX_NODES, NAME) if "lost_nodes" in f.d else (),
    )


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _open_dir(name: str, dir_fd: int, base: Path, parts: list[str], create: bool) -> int:
    """A directory beneath `dir_fd`, never through a symlink (one planted on the shared volume
    would send the verdict's files elsewhere); FileNotFoundError passes for a missing one.
    `base` and `parts`: its path, joined only for a message (thousands of nodes' filings open
    these)."""
    try:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o777, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            where = base.joinpath(*parts)
            raise UntrustedInput(where, "is a symlink or not a directory; not followed") from None
        raise


@contextlib.contextmanager
def beneath(base_fd: int, base: Path, parts: list[str], create: bool = False) -> Iterator[int]:
    fds: list[int] = []
    cur = base_fd
    try:
        for i, part in enumerate(parts):
            cur = _open_dir(part, cur, base, parts[: i + 1], create)
            fds.append(cur)
        yield cur
    finally:
        for fd in fds:
            os.close(fd)


class IOCount:
    """File operations on the shared volume, by kind (what a network filesystem charges)."""

    def __init__(self) -> None:
        self.writes = 0  # files created or replaced, directories made
        self.reads = 0  # files read
        self.listings = 0  # directories listed
        self.stats = 0  # existence and time checks
        self.bytes_written = 0
        self.bytes_read = 0  # file contents, and the names a listing returns

    def add(self, other: IOCount) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)
