"""The checkpoint directory on storage, as the agent maintains it (several nodes share it):

    <save_dir>/global_step{N}/...           DeepSpeed's own files, each written to a temporary
                                            name, fsynced, then renamed
    <save_dir>/zero_to_fp32.py ...          DeepSpeed's recovery scripts
    <save_dir>/.diag/global_step{N}/rank{R:05d}.done
                                            rank R's part of step N is on storage (JSON)
    <save_dir>/latest                       "global_step{N}", written last, and only once every
                                            rank's marker of step N exists
    <save_dir>/dlrover_latest.txt           "N": the tracker DLRover and ms-swift resume from
    <save_dir>/.diag/commit.lock            held while a commit checks and writes the two above

`should_commit` and `prune_plan` are the pure rules; the rest are thin file operations.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from diag.agent.checkpoint.savedir import (
    AS_CONFIGURED,
    Base,
    SaveDirRule,
    beneath,
    open_save_dir,
)
from diag.formats.locks import EXCLUSIVE, UNLOCK, ofd_lock
from diag.formats.snapshot import (
    LATEST_FILE,
    TRACKER_FILE,
    read_latest_step,
    step_tag,
    tag_step,
)
from diag.formats.untrusted import (
    KIB,
    UntrustedInput,
    create_new,
    read_bounded,
    read_json,
)

log = logging.getLogger(__name__)

MARKER_DIR = ".diag"
COMMIT_LOCK = "commit.lock"
FILE_MODE = 0o644  # every file the agent writes there; never a mode named by a slot
MARKER_MAX_BYTES = 64 * KIB
COMMIT_LOCK_TIMEOUT_S = 30.0  # a commit holds it for milliseconds; longer is a wedged holder
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_warned_no_locks: set[str] = set()


def should_commit(
    step: int, world_size: int, done: set[int], latest: int | None, runs: int = 1
) -> bool:
    """Every rank's part of `step` is on storage, all from one launch of the trainer (`runs` the
    number of launches among them), and `latest` would move forward. Parts of one step from two
    launches (a rank's part left by a run that died, the others' from the run that restarted
    before that step) are not one checkpoint."""
    return (
        world_size > 0
        and done >= set(range(world_size))
        and runs <= 1
        and (latest is None or step > latest)
    )


def prune_plan(steps: Iterable[int], committed: int | None, keep: int) -> list[int]:
    """Steps to delete so that only the `keep` newest committed ones remain. Steps newer than the
    committed one may still be in progress on other nodes: never touched. keep <= 0 keeps all."""
    if keep <= 0 or committed is None:
        return []
    done = sorted((s for s in set(steps) if s <= committed), reverse=True)
    return sorted(done[keep:])


def marker_path(save_dir: Path, step: int, rank: int) -> Path:
    return save_dir / MARKER_DIR / step_tag(step) / f"rank{rank:05d}.done"


def _marker_parts(step: int, rank: int) -> tuple[str, str, str]:
    return (MARKER_DIR, step_tag(step), f"rank{rank:05d}.done")


# -- the save directory, through directory descriptors -------------------------------------------
# The save directory is the base (named by the operator or the trainer); everything beneath it is
# reached one component at a time without following a symlink, so a link planted in it (a step
# directory pointing at /etc, a marker pointing at a FIFO) cannot redirect a write or a read.
# What the agent creates there goes to the save directory's owner where its rule says so
# (savedir.py): each new file and directory is given away through its own descriptor.


@contextlib.contextmanager
def opened(
    save_dir: Path, *, create: bool = False, rule: SaveDirRule = AS_CONFIGURED
) -> Iterator[Base]:
    """The save directory itself, open (made first when `create` and its rule allows)."""
    with open_save_dir(save_dir, rule, create=create) as base:
        yield base


def _names(base: Base, parts: Sequence[str]) -> list[str]:
    try:
        with beneath(base, parts) as d:
            return os.listdir(d)
    except (OSError, UntrustedInput):
        return []


def _read_marker(base: Base, step: int, rank: int) -> dict | None:
    parts = _marker_parts(step, rank)
    try:
        with beneath(base, parts[:-1]) as d:
            doc = read_json(parts[-1], max_bytes=MARKER_MAX_BYTES, dir_fd=d)
    except (OSError, UntrustedInput):
        return None
    return doc if isinstance(doc, dict) else None


def _done_ranks(base: Base, step: int) -> set[int]:
    out = set()
    for name in _names(base, (MARKER_DIR, step_tag(step))):
        if name.startswith("rank") and name.endswith(".done"):
            with contextlib.suppress(ValueError):
                out.add(int(name[4:-5]))
    return out


def done_ranks(save_dir: Path, step: int, rule: SaveDirRule = AS_CONFIGURED) -> set[int]:
    try:
        with opened(save_dir, rule=rule) as base:
            return _done_ranks(base, step)
    except (OSError, UntrustedInput):
        return set()


def _marker_runs(base: Base, step: int) -> dict[int, str]:
    out = {}
    for rank in _done_ranks(base, step):
        doc = _read_marker(base, step, rank)
        if doc is not None:
            out[rank] = str(doc.get("run", ""))
    return out


def marker_runs(save_dir: Path, step: int, rule: SaveDirRule = AS_CONFIGURED) -> dict[int, str]:
    """Rank -> the trainer launch whose part of `step` its marker records."""
    try:
        with opened(save_dir, rule=rule) as base:
            return _marker_runs(base, step)
    except (OSError, UntrustedInput):
        return {}


def has_part(
    save_dir: Path, step: int, rank: int, run: str, rule: SaveDirRule = AS_CONFIGURED
) -> bool:
    """Rank `rank`'s part of `step` from launch `run` is on storage (a part from another launch
    is stale: it is written again)."""
    try:
        with opened(save_dir, rule=rule) as base:
            doc = _read_marker(base, step, rank)
    except (OSError, UntrustedInput):
        return False
    return doc is not None and str(doc.get("run", "")) == run


def marked_steps(save_dir: Path, rule: SaveDirRule = AS_CONFIGURED) -> set[int]:
    """Steps with at least one marker: the ones we wrote."""
    try:
        with opened(save_dir, rule=rule) as base:
            return _marked_steps(base)
    except (OSError, UntrustedInput):
        return set()


def _marked_steps(base: Base) -> set[int]:
    return {s for s in map(tag_step, _names(base, (MARKER_DIR,))) if s is not None}


def fsync_dir(base: Base, parts: Sequence[str] = ()) -> None:
    with beneath(base, parts) as d:
        os.fsync(d)


def write_atomic(base: Base, parts: Sequence[str], fill: Callable[[int], object]) -> None:
    """Writes base/parts through `fill(fd)` under a temporary name, fsyncs it, renames it into
    place; missing directories are made. Readers see the old file or the complete new one, never
    a part. Modes are ours (FILE_MODE, DIR_MODE), whatever asked for the file."""
    *dirs, name = parts
    with beneath(base, dirs, create=True) as d:
        # Unique per writer: the persist workers of one agent (threads) and the agents of other
        # nodes may write the same file at the same time; each renames a complete file of its own.
        tmp = f".{name}.tmp-{os.getpid()}-{threading.get_native_id()}-{secrets.token_hex(4)}"
        fd = create_new(tmp, dir_fd=d, mode=FILE_MODE)
        try:
            try:
                base.give(fd)
                fill(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)  # replaces a link, never follows it
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=d)
            raise


def write_bytes_atomic(base: Base, parts: Sequence[str], data: bytes | memoryview) -> None:
    def fill(fd: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]

    write_atomic(base, parts, fill)


def write_marker(
    save_dir: Path, step: int, rank: int, doc: dict, rule: SaveDirRule = AS_CONFIGURED
) -> None:
    parts = _marker_parts(step, rank)
    with opened(save_dir, create=True, rule=rule) as base:
        write_bytes_atomic(base, parts, json.dumps(doc, indent=1).encode())
        fsync_dir(base, parts[:-1])


def same_content(base: Base, parts: Sequence[str], data: memoryview | bytes) -> bool:
    """base/parts is a regular file holding exactly `data` (no symlink followed)."""
    try:
        with beneath(base, parts[:-1]) as d:
            return read_bounded(parts[-1], max_bytes=len(data), dir_fd=d) == bytes(data)
    except (OSError, UntrustedInput):
        return False


def remove_beneath(base: Base, parts: Sequence[str]) -> None:
    with contextlib.suppress(OSError, UntrustedInput), beneath(base, parts[:-1]) as d:
        os.unlink(parts[-1], dir_fd=d)


@contextlib.contextmanager
def commit_lock(
    save_dir: Path, timeout: float = COMMIT_LOCK_TIMEOUT_S, rule: SaveDirRule = AS_CONFIGURED
) -> Iterator[bool]:
    """Holds the save directory's commit lock; yields False when its filesystem has no locks.

    Why a lock: the check (every marker there, `latest` older) and the writes must be one step
    for every committer at once, the persist threads of this agent as well as the agents of
    other nodes sharing the directory; renames alone cannot order them (an older step's rename
    may land after a newer one's). Why a lock file with an OFD lock (collector.locks): it
    excludes threads and processes alike (a classic POSIX lock would not exclude two threads of
    one process), it works across nodes on filesystems with POSIX locks (NFS, CephFS, Lustre),
    taking it makes NFS revalidate its cached view of `latest`, and the kernel (or NFS lock
    recovery) drops it when its holder dies, so a crash never leaves it taken (an O_EXCL lock
    file would stay behind a killed holder)."""
    path = save_dir / MARKER_DIR / COMMIT_LOCK
    deadline = time.monotonic() + timeout
    # The threads of this process first take a lock in memory: it alone still orders them where
    # the filesystem has no file locks (some FUSE and object-store mounts).
    threads = _thread_lock(path)
    if not threads.acquire(timeout=timeout):
        raise TimeoutError(
            f"the commit lock {path} stayed held for {timeout:.0f} s by another thread of this "
            "agent; the step is committed by the next persist"
        )
    try:
        with _file_lock(path, save_dir, deadline, timeout, rule) as locked:
            yield locked
    finally:
        threads.release()


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _thread_lock(path: Path) -> threading.Lock:
    key = os.path.realpath(path)
    with _thread_locks_guard:
        return _thread_locks.setdefault(key, threading.Lock())


@contextlib.contextmanager
def _file_lock(
    path: Path, save_dir: Path, deadline: float, timeout: float, rule: SaveDirRule
) -> Iterator[bool]:
    with (
        opened(save_dir, create=True, rule=rule) as base,
        beneath(base, (MARKER_DIR,), create=True) as d,
    ):
        fd = _open_lock_file(base, d)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "the commit lock is not a regular file", str(path))
        try:
            while not ofd_lock(fd, EXCLUSIVE, wait=False):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the commit lock {path} stayed held for {timeout:.0f} s (another agent "
                        "stuck in a commit?); the step is committed by the next persist"
                    )
                time.sleep(0.005)
            locked = True
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            locked = False
            if str(save_dir) not in _warned_no_locks:
                _warned_no_locks.add(str(save_dir))
                log.warning(
                    "the filesystem of %s has no file locks (%s): this agent's commits stay in "
                    "order, but agents of several nodes committing at once could move `latest` "
                    "backwards; mount it with locking",
                    save_dir, os.strerror(e.errno),
                )  # fmt: skip
        try:
            yield locked
        finally:
            if locked:
                ofd_lock(fd, UNLOCK, wait=False)
    finally:
        os.close(fd)


def _open_lock_file(base: Base, d: int) -> int:
    """The commit lock file, created (and given to the save directory's owner) when missing."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    while True:
        try:
            fd = os.open(COMMIT_LOCK, flags | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=d)
        except FileExistsError:
            try:
                return os.open(COMMIT_LOCK, flags, dir_fd=d)
            except FileNotFoundError:
                continue  # removed in between: create it again
        try:
            base.give(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd


def try_commit(
    save_dir: Path, step: int, world_size: int, keep: int, rule: SaveDirRule = AS_CONFIGURED
) -> bool:
    """Writes `latest` and the tracker file when every rank's part of `step` is on storage and
    `latest` names an older step, then prunes old steps. The check and the writes happen under
    the commit lock, so concurrent commits (threads, other nodes' agents) apply in step order:
    `latest` only ever moves forward."""
    with commit_lock(save_dir, rule=rule) as locked, opened(save_dir, rule=rule) as base:
        if locked:
            _remove_dead_commit_files(base)
        latest = read_latest_step(save_dir)
        runs = _marker_runs(base, step)
        if not should_commit(step, world_size, set(runs), latest, len(set(runs.values()))):
            return False
        # Every rank's files and their directory entries were fsynced before its marker.
        write_bytes_atomic(base, (LATEST_FILE,), step_tag(step).encode())
        write_bytes_atomic(base, (TRACKER_FILE,), str(step).encode())
        fsync_dir(base)
    # Outside the lock (removing big steps takes a while): only steps older than this commit
    # are touched, and removing twice is harmless. Removed beneath the open save directory, so
    # a path swapped meanwhile cannot point the removal elsewhere.
    with contextlib.suppress(OSError, UntrustedInput), opened(save_dir, rule=rule) as base:
        for old in prune_plan(_marked_steps(base), step, keep):
            shutil.rmtree(step_tag(old), ignore_errors=True, dir_fd=base.fd)
            with contextlib.suppress(OSError, UntrustedInput), beneath(base, (MARKER_DIR,)) as d:
                shutil.rmtree(step_tag(old), ignore_errors=True, dir_fd=d)
    return True


def _remove_dead_commit_files(base: Base) -> None:
    """Temporary files of `latest` and the tracker are written only under the commit lock: the
    ones found while holding it belong to a committer killed in the middle (they would pile up)."""
    prefixes = tuple(f".{name}.tmp-" for name in (LATEST_FILE, TRACKER_FILE))
    for name in os.listdir(base.fd):
        if name.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=base.fd)


def committed_step(save_dir: Path) -> int | None:
    return read_latest_step(save_dir)
