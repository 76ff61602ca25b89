"""Writes one rank's snapshot from shared memory to storage, in DeepSpeed's own layout.

The slot is held with a shared lock for the whole write, so the trainer cannot overwrite it
meanwhile (it writes its next snapshot into another slot). A slot that is torn (its writer died
mid-copy), or that no longer holds the requested step, is refused.

Where each file goes comes from the slot's validated description (relative paths, no `..`):
every file is created beneath the save directory through directory descriptors, never following
a symlink, with modes the agent picks. A slot not owned by a trusted user is not read at all.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from diag.agent.checkpoint import storage
from diag.agent.checkpoint.savedir import Base, SaveDirRefused, SaveDirRule, advice, rule_for
from diag.agent.checkpoint.torchzip import write_torch_file
from diag.formats.slotfile import SlotFile, run_dir_owners, warn_once
from diag.formats.snapshot import FileEntry, SnapshotError, step_tag
from diag.formats.untrusted import Owners, UntrustedInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersistResult:
    job: str
    rank: int
    step: int
    save_dir: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    nbytes: int = 0
    files: tuple[str, ...] = ()
    committed: bool = False
    skipped: bool = False  # already on storage: nothing written


def persist_slot(
    path: Path,
    *,
    step: int | None = None,
    save_dir: Path | None = None,
    keep: int = 0,
    lock_timeout: float = 10.0,
    owners: Owners | None = None,
    rule: SaveDirRule | None = None,
) -> PersistResult:
    """Persists the complete snapshot in slot file `path` (of `step`, when given) under its save
    directory (or `save_dir`), marks this rank's part done, and commits the step when every rank's
    part is there. `owners`: who may write slots (default: run_dir_owners of its directory).
    `rule`: whose save directory may be written (default: from who wrote the slot; a peer's
    replica, written by this agent, is given the rule of this node's own ranks' slots)."""
    t0 = time.monotonic()
    try:
        slot = SlotFile.open(path, owners=run_dir_owners(path.parent) if owners is None else owners)
    except UntrustedInput as e:
        warn_once(path, e.problem if e.path == str(path) else str(e))
        return PersistResult("", -1, step or -1, "", False, f"refused {path}: {e.problem}")
    except (OSError, SnapshotError, ValueError) as e:
        return PersistResult("", -1, step or -1, "", False, f"cannot open {path}: {e}")
    try:
        h = slot.header()
        if not slot.lock_shared(lock_timeout):
            return PersistResult(
                h.job, h.rank, step or h.step, "", False, f"{path.name} stays locked by its writer"
            )
        h = slot.header()
        if not h.complete:
            return PersistResult(h.job, h.rank, step or -1, "", False, f"{path.name} is torn")
        if step is not None and h.step != step:
            return PersistResult(
                h.job, h.rank, step, "", False, f"{path.name} holds step {h.step}, not {step}"
            )
        try:
            meta = slot.meta()
        except UntrustedInput as e:
            warn_once(path, e.problem if e.path == str(path) else str(e))
            return PersistResult(h.job, h.rank, step or h.step, "", False, f"refused {e}")
        target = save_dir or Path(meta.save_dir)
        if rule is None:
            rule = rule_for(
                from_operator=save_dir is not None,
                slot_owner=slot.owner_uid,
                agent_euid=os.geteuid(),
            )
        refused = _refusal(path, target, rule)
        if refused is not None:
            return PersistResult(
                meta.job, meta.rank, meta.step, str(target), False, refused,
                seconds=time.monotonic() - t0,
            )  # fmt: skip
        if storage.has_part(target, meta.step, meta.rank, meta.run, rule):
            committed = _commit(target, meta.step, meta.world_size, keep, rule)
            return PersistResult(
                meta.job, meta.rank, meta.step, str(target), True,
                seconds=time.monotonic() - t0, committed=committed, skipped=True,
            )  # fmt: skip
        written: list[str] = []
        nbytes = 0
        try:
            with storage.opened(target, create=True, rule=rule) as base:
                for f in meta.files:
                    if f.persist:
                        written.append(f.path)  # before: a part written when it fails is removed
                        nbytes += _write_file(slot, base, f)
                for parent in {f.parts[:-1] for f in meta.files if f.persist}:
                    storage.fsync_dir(base, parent)
            storage.write_marker(
                target,
                meta.step,
                meta.rank,
                {
                    "job": meta.job,
                    "rank": meta.rank,
                    "world_size": meta.world_size,
                    "node": meta.node,
                    "agent_host": socket.gethostname(),
                    "run": meta.run,
                    "files": written,
                    "bytes": nbytes,
                    "written_at": time.time(),
                },
                rule,
            )
        except UntrustedInput as e:
            # Something planted in the save directory (a symlink where a step directory goes):
            # nothing is written through it, and this part is not committed.
            _remove_part(target, meta.step, written, rule)
            log.warning("not persisting %s step %d into %s: %s", path, meta.step, target, e)
            return PersistResult(
                meta.job, meta.rank, meta.step, str(target), False, f"refused: {e}",
                seconds=time.monotonic() - t0,
            )  # fmt: skip
        except OSError as e:
            # No marker: this rank's part of the step is incomplete and nobody reads it. What it
            # wrote of it goes, or a full disk would stay full of parts that never commit; unless
            # another agent's marker says its copy of the same files is complete (a lost peer's
            # replica written by its holder while the peer still wrote its own).
            if not storage.has_part(target, meta.step, meta.rank, meta.run, rule):
                _remove_part(target, meta.step, written, rule)
            return PersistResult(
                meta.job, meta.rank, meta.step, str(target), False,
                write_error(e, target, meta.step, meta.rank, meta.nbytes),
                seconds=time.monotonic() - t0,
            )  # fmt: skip
        slot.unlock()  # the bytes are on storage; the trainer may reuse the slot
        committed = _commit(target, meta.step, meta.world_size, keep, rule)
        seconds = time.monotonic() - t0
        return PersistResult(
            meta.job, meta.rank, meta.step, str(target), True, seconds=seconds, nbytes=nbytes,
            files=tuple(written), committed=committed,
        )  # fmt: skip
    except (OSError, SnapshotError, ValueError) as e:
        log.exception("persisting %s failed", path)
        return PersistResult("", -1, step or -1, "", False, f"{type(e).__name__}: {e}")
    finally:
        slot.close()


def _refusal(path: Path, save_dir: Path, rule: SaveDirRule) -> str | None:
    """Why the slot's save directory is not written into (warned once per slot and problem), or
    None when it may be."""
    try:
        with storage.opened(save_dir, rule=rule):
            return None
    except SaveDirRefused as e:
        problem = f"its save directory {save_dir} {e.problem}; {advice(rule)}"
        warn_once(path, problem)
        return f"refused {path}: {problem}"
    except OSError as e:
        return None if rule.owner is None else f"cannot open the save directory {save_dir}: {e}"


def _commit(save_dir: Path, step: int, world_size: int, keep: int, rule: SaveDirRule) -> bool:
    """Commits `step` if complete; a failure to write `latest` leaves the previous one in place
    (the part is on storage: the next step's persist commits a newer one)."""
    try:
        return storage.try_commit(save_dir, step, world_size, keep, rule)
    except OSError as e:
        log.warning("could not commit step %d: %s", step, write_error(e, save_dir, step, -1, 0))
        return False
    except UntrustedInput as e:
        log.warning("could not commit step %d: %s", step, e)
        return False


def write_error(e: OSError, save_dir: Path, step: int, rank: int, needed: int) -> str:
    """What went wrong writing a rank's part of a step, and what to do about it."""
    committed = storage.committed_step(save_dir)
    kept = (
        f"step {step} stays in shared memory; `latest` still names step {committed}"
        if committed is not None
        else f"step {step} stays in shared memory; nothing is committed yet"
    )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(save_dir)
        return (
            f"the save directory {save_dir} is full: step {step} needs about "
            f"{needed / 1e6:.1f} MB more, {free / 1e6:.1f} MB is free. Free space there, keep "
            f"fewer steps (--keep-last) or give it a larger volume; {kept}"
        )
    if e.errno == errno.EROFS:
        return (
            f"the save directory {save_dir} is on a read-only filesystem: mount it read-write; "
            f"{kept}"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return (
            f"no permission to write rank {rank}'s part of step {step} under {save_dir} "
            f"({e.filename or save_dir}): give the agent's user write access; {kept}"
        )
    return f"cannot write rank {rank}'s part of step {step} under {save_dir}: {e}; {kept}"


def _free_bytes(path: Path) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _remove_part(save_dir: Path, step: int, written: list[str], rule: SaveDirRule) -> None:
    tag = step_tag(step)
    with contextlib.suppress(OSError, UntrustedInput), storage.opened(save_dir, rule=rule) as base:
        for name in written:
            parts = tuple(name.split("/"))
            if parts[:1] == (tag,):  # the recovery scripts at the top are shared
                storage.remove_beneath(base, parts)


def _write_file(slot: SlotFile, base: Base, f: FileEntry) -> int:
    """Writes one file of the snapshot beneath the save directory `base`; f.parts were validated
    as relative, without `..` (collector.slotmeta)."""
    if f.kind == "raw":
        data = slot.view(f.data.offset, f.data.length) if f.data else b""
        if not storage.same_content(base, f.parts, data):  # the recovery scripts rarely change
            storage.write_bytes_atomic(base, f.parts, data)
        return len(data)
    if f.pickle is None:
        raise SnapshotError(f"{f.path}: no pickled structure")
    pickle = slot.view(f.pickle.offset, f.pickle.length)
    storages = [(s.key, slot.view(s.offset, s.nbytes)) for s in f.storages]
    sizes = [0]

    def fill(fd: int) -> None:
        sizes[0] = write_torch_file(fd, f.parts[-1], pickle, storages)

    storage.write_atomic(base, f.parts, fill)
    return sizes[0]
