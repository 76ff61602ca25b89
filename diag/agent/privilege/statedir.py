"""The agent's own directory: its lock (one agent per run directory) and the replicas it holds
for its peers. Nobody else writes it, so nothing there is input; it must stay so: it is opened
without following a symlink and checked through the descriptor to be a directory of the
agent's user that no one else may enter.

    <state dir>/                 the agent's user, 0700 (root's for a root agent)
        uid-<uid>/               a privilege-dropped agent's: the ranks' user, 0700
            agent-<key>.lock     held (flock) while an agent serves run directory <key>
            replicas-<key>/      the replica store of that run directory

A root agent that drops to the ranks' user makes `uid-<uid>` before it does, inside the root
directory the ranks' user cannot enter, and keeps it open: afterwards it reaches it only through
that descriptor (`/proc/self/fd/N`), so a process of that user can neither reach nor rename
anything in it. The ranks' user could not be kept out of a directory the agent writes as them by
any other means.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from diag.formats.exitcodes import UsageError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def default_state_dir(euid: int) -> Path:
    """/run/diag-agent for root; a non-root agent's in shared memory under its uid (a pod sets
    --state-dir to a volume of the agent's container alone)."""
    if euid == 0:
        return Path("/run/diag-agent")
    return Path(f"/dev/shm/diag-agent-{euid}")


def run_dir_key(run_dir: Path) -> str:
    """Names what belongs to one run directory (its lock, its replicas) in the state dir."""
    return hashlib.sha256(os.fsencode(os.path.abspath(run_dir))).hexdigest()[:16]


@dataclass
class StateDir:
    fd: int  # the directory, held for the agent's life
    shown: Path  # how it is named in messages

    @property
    def path(self) -> Path:
        """A path that reaches the directory through its descriptor, whatever its ancestors
        let this process reach (after a privilege drop) or a rename did meanwhile."""
        return Path(f"/proc/self/fd/{self.fd}")

    def lock(self, run_dir: Path) -> int:
        """Takes the lock of `run_dir`'s agent; a UsageError when another agent holds it. The
        descriptor returned holds it for as long as it is open."""
        name = f"agent-{run_dir_key(run_dir)}.lock"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o600, dir_fd=self.fd)
        except OSError as e:
            raise UsageError(
                f"cannot open the agent's lock {self.shown / name}: {e.strerror}"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(
                f"another agent already serves the run directory {run_dir} (it holds "
                f"{self.shown / name}); stop it, or give this one another --run-dir or --state-dir"
            ) from None
        return fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def open_state_dir(path: Path, euid: int) -> StateDir:
    """`path`, made 0700 if missing (its parents as the process may), opened and checked."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        raise UsageError(
            f"cannot open the agent's state directory {path}: {e.strerror}; set --state-dir to "
            "a directory of the agent's own"
        ) from e
    _check(fd, path, euid)
    return StateDir(fd, path)


def open_dropped(state: StateDir, uid: int, gid: int) -> StateDir:
    """As root, before the drop: `uid-<uid>` in `state`, the ranks' user's, 0700, held open."""
    name = f"uid-{uid}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=state.fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=state.fd)
    except OSError as e:
        raise UsageError(f"cannot open {state.shown / name}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if st.st_uid == 0 and (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)  # made just now by us, inside a directory only root enters
        os.fchmod(fd, 0o700)
    except OSError as e:
        os.close(fd)
        raise UsageError(f"cannot give {state.shown / name} to uid {uid}: {e.strerror}") from e
    _check(fd, state.shown / name, uid)
    return StateDir(fd, state.shown / name)


def _check(fd: int, path: Path, owner: int) -> None:
    st = os.fstat(fd)
    problem = ""
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != owner:
        problem = f"belongs to uid {st.st_uid}, not the agent's ({owner})"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        problem = f"is open to others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        os.close(fd)
        raise UsageError(
            f"the agent's state directory {path} {problem}: nobody but the agent may write it; "
            f"remove it, or chmod 0700 it, or set --state-dir"
        )
