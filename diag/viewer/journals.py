"""What an incident's journal tails say about each rank's threads.

Next to each rank's dump the agent writes `{rank:05d}-{world:05d}.journal.json`: the last records
of the rank's op journal and the journal's meta. Two facts in it tell threads apart where their
stacks cannot:
- the thread that issued the last op is the training thread: a training loop may run in a
  worker thread, and at the moment of the dump be outside any collective (writing a checkpoint,
  waiting for data), where the stacks alone would take the main thread for it;
- the meta lists threads diag runs whose stacks hold no diag frame (the control channel's gRPC
  poller, which runs grpc's frames only): they are diag's, not the job's RPC.

And one about numbers: each group's last sequence number and op, so the flight recorder's
numbers can be shown as the journal's (diag.viewer.frsummary).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from diag.formats import fastjson
from diag.formats.incidentdir import JOURNAL_TAIL_SUFFIX
from diag.formats.inputcaps import JOURNAL_TAIL_MAX_BYTES, MAX_WORLD, clean, read_capped
from diag.formats.untrusted import UntrustedInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JournalThreads:
    """What a rank's journal says of its threads: which issued the last op, which are diag's."""

    issuer: int  # native id of the thread that issued the rank's last op; 0: unknown
    own: frozenset[int]  # native ids of diag's threads whose stacks do not say so

    @property
    def empty(self) -> bool:
        return not self.issuer and not self.own


def journal_threads(doc: object) -> JournalThreads | None:
    """The facts about threads in a journal tail document; None when it holds none (an error
    document, or a journal from before threads were recorded)."""
    if not isinstance(doc, dict):
        return None
    issuer = 0
    records = doc.get("records")
    if isinstance(records, list):
        best = -1
        for rec in records:
            if not isinstance(rec, dict) or rec.get("kind") != "op":
                continue
            seq, tid = rec.get("seq"), rec.get("tid")
            if isinstance(seq, int) and isinstance(tid, int) and tid > 0 and seq > best:
                best, issuer = seq, tid
    meta = doc.get("meta")
    own: frozenset[int] = frozenset()
    if isinstance(meta, dict) and isinstance(meta.get("own_threads"), list):
        own = frozenset(t for t in meta["own_threads"] if isinstance(t, int) and t > 0)
    found = JournalThreads(issuer, own)
    return None if found.empty else found


def read_tail(path: str | os.PathLike[str]) -> object:
    """A journal tail document: a regular file (never a FIFO or a symlink) under its cap."""
    try:
        return fastjson.loads(read_capped(path, JOURNAL_TAIL_MAX_BYTES))
    except RecursionError:
        raise UntrustedInput(path, "is not valid JSON: nested too deep") from None
    except ValueError as e:  # UntrustedInput is one
        if isinstance(e, UntrustedInput):
            raise
        raise UntrustedInput(path, f"is not valid JSON: {e}") from None


def read_journal_threads(path: str | os.PathLike[str]) -> JournalThreads | None:
    """`journal_threads` of a tail file; None when it cannot be read (the merge goes on with the
    stacks alone)."""
    try:
        doc = read_tail(path)
    except UntrustedInput as e:
        log.warning(
            "cannot read journal tail %s; its rank's threads are told by their stacks",
            clean(str(e)),
        )
        return None
    return journal_threads(doc)


def local_size(doc: object) -> int:
    """The local world size a journal tail's meta records; 0 when it says none."""
    meta = doc.get("meta") if isinstance(doc, dict) else None
    value = meta.get("local_world_size") if isinstance(meta, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_WORLD:
        return 0
    return value


def journal_local_sizes(dirs: Iterable[Path]) -> list[int]:
    """The local world size the journal tails of each directory record (one read per
    directory: the ranks of one job agree)."""
    out = []
    for d in dirs:
        try:
            first = next(
                (
                    e
                    for e in os.scandir(d)
                    if e.name.endswith(JOURNAL_TAIL_SUFFIX) and e.is_file(follow_symlinks=False)
                ),
                None,
            )
            if first is None:
                continue
            out.append(local_size(read_tail(first.path)))
        except (OSError, ValueError):
            continue
    return out


_TAIL_NAME = re.compile(r"^(\d{5,8})-\d{5,8}" + re.escape(JOURNAL_TAIL_SUFFIX) + "$")
MAX_GROUP_NAME = 200


def group_last(doc: object) -> dict[str, tuple[int, str]]:
    """Per process group: the sequence number and op of the last op the journal tail holds."""
    out: dict[str, tuple[int, str]] = {}
    records = doc.get("records") if isinstance(doc, dict) else None
    for rec in records if isinstance(records, list) else ():
        if not isinstance(rec, dict) or rec.get("kind") != "op":
            continue
        group, seq, op = rec.get("group"), rec.get("group_seq"), rec.get("op")
        if not (isinstance(group, str) and 0 < len(group) <= MAX_GROUP_NAME):
            continue
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 < seq < 1 << 63:
            continue
        if isinstance(op, str) and seq > out.get(group, (0, ""))[0]:
            out[group] = (seq, op[:MAX_GROUP_NAME])
    return out


def read_group_last(dirs: Iterable[Path], ranks: set[int]) -> dict[int, dict[str, tuple[int, str]]]:
    """`group_last` of the journal tails of `ranks` in the incident directories; a tail that
    cannot be read is left out (its rank's flight recorder keeps torch's numbers)."""
    out: dict[int, dict[str, tuple[int, str]]] = {}
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            m = _TAIL_NAME.match(e.name)
            if m is None or int(m.group(1)) not in ranks or not e.is_file(follow_symlinks=False):
                continue
            try:
                out[int(m.group(1))] = group_last(read_tail(e.path))
            except (OSError, UntrustedInput):
                continue
    return out
