"""Who may write the run directory. The agent believes what it finds there (journals, metas,
slots, the control socket) only as far as it knows who wrote it, so it refuses a directory that
someone other than the trainer's user (or root, or itself) can write, and ignores files in it
that such a user does not own.

The trainer's user is `--trainer-uid` when given. Else, for an agent started as root, it is root:
a root agent never takes a directory from a user it was not told of (anyone may create
/dev/shm/diag first and fill it), so it refuses one that is neither root's nor `--trainer-uid`'s.
An agent started as another user takes the directory's owner (in a pod the agent and the trainer
run as the same user).
A group-writable directory is accepted only when its group is `--trainer-gid`: its members are
then trainers by decision of whoever runs the agent, and a file one of them plants under another
uid is still ignored.

A missing directory is made 0700 through a descriptor (never chmod or chown by path).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from diag.formats.exitcodes import UsageError
from diag.formats.untrusted import Owners


@dataclass(frozen=True)
class TrainerUsers:
    """`--trainer-uid` / `--trainer-gid`, None when not given."""

    uid: int | None = None
    gid: int | None = None


@dataclass(frozen=True)
class RunDirStat:
    """What decides: the directory's own entry, not what a symlink points at."""

    is_symlink: bool
    is_dir: bool
    uid: int
    gid: int
    mode: int


def judge(
    path: Path, st: RunDirStat, users: TrainerUsers, euid: int, started_as_root: bool = False
) -> Owners:
    """The users whose files in `path` are believed; a UsageError saying what to do when the
    directory itself cannot be trusted. `started_as_root`: the agent was root (it may have
    become the ranks' user since)."""
    fix = (
        f"make it private to the trainer's user (chmod 0700 {path}; chown it to that user) or "
        "point --run-dir/DIAG_RUN_DIR at a directory only it can write"
    )
    if st.is_symlink:
        raise UsageError(
            f"the run directory {path} is a symlink; the agent does not follow one there: name "
            "the real directory with --run-dir/DIAG_RUN_DIR"
        )
    if not st.is_dir:
        raise UsageError(f"the run directory {path} is not a directory; set --run-dir")
    root_agent = started_as_root or euid == 0
    if root_agent and users.uid is None and st.uid not in (0, euid):
        raise UsageError(
            f"the run directory {path} belongs to uid {st.uid}, and the agent, started as root, "
            "was not told that its ranks run as that user: a root agent takes no directory from "
            f"a user it was not given. If the ranks run as uid {st.uid}, pass --trainer-uid "
            f"{st.uid}; else remove {path} (someone else may have made it first) or set --run-dir"
        )
    trainer = users.uid if users.uid is not None else (0 if root_agent else st.uid)
    owners = Owners.of(euid, trainer)
    if st.uid not in owners.uids:
        raise UsageError(
            f"the run directory {path} is owned by uid {st.uid}, not by the trainer's user "
            f"(--trainer-uid {trainer}), root or the agent's; {fix}"
        )
    if st.mode & stat.S_IWOTH:
        raise UsageError(
            f"the run directory {path} is writable by every user (mode {st.mode & 0o7777:04o}): "
            f"anyone could plant journals the agent would act on; {fix}"
        )
    if st.mode & stat.S_IWGRP and not (users.gid is not None and st.gid == users.gid):
        raise UsageError(
            f"the run directory {path} is writable by its group {st.gid} (mode "
            f"{st.mode & 0o7777:04o}); {fix}, or pass --trainer-gid {st.gid} if every member of "
            "that group is a trainer"
        )
    return owners


def prepare(path: Path, users: TrainerUsers, started_as_root: bool | None = None) -> Owners:
    """Creates a missing run directory private (0700; given to the trainer's user and group
    when named and the agent may), then judges it. `started_as_root` defaults to whether this
    process is root."""
    root = os.geteuid() == 0 if started_as_root is None else started_as_root
    try:
        os.lstat(path)
    except FileNotFoundError:
        _create(path, users)
    except OSError as e:
        raise UsageError(f"cannot look at the run directory {path}: {e.strerror}") from e
    try:
        raw = os.lstat(path)
    except OSError as e:
        raise UsageError(f"cannot look at the run directory {path}: {e.strerror}") from e
    st = RunDirStat(
        is_symlink=stat.S_ISLNK(raw.st_mode),
        is_dir=stat.S_ISDIR(raw.st_mode),
        uid=raw.st_uid,
        gid=raw.st_gid,
        mode=stat.S_IMODE(raw.st_mode),
    )
    return judge(path, st, users, os.geteuid(), started_as_root=root)


def _create(path: Path, users: TrainerUsers) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            return  # made meanwhile (a rank, another agent): judged as it is
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(
            f"cannot create the run directory {path}: {e.strerror}; set --run-dir or "
            "DIAG_RUN_DIR to a directory shared with the trainer"
        ) from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return  # not the one made just now (swapped meanwhile): judged as it is
        os.fchmod(fd, 0o700)  # the umask masked mkdir's mode
        uid = -1 if users.uid is None or os.geteuid() != 0 else users.uid
        gid = -1 if users.gid is None else users.gid
        if (uid, gid) != (-1, -1):
            os.fchown(fd, uid, gid)
    except OSError as e:
        raise UsageError(f"cannot make the run directory {path} private: {e.strerror}") from e
    finally:
        os.close(fd)


def owners_of(path: Path, users: TrainerUsers | None = None) -> Owners:
    """The trusted users of a run directory without judging it (the observer of `diag dump`
    and of tests): root, this process's user, the trainer's (given, else the owner)."""
    users = users or TrainerUsers()
    uid = users.uid
    if uid is None:
        with contextlib.suppress(OSError):
            uid = os.lstat(path).st_uid
    return Owners.of(os.geteuid(), *(() if uid is None else (uid,)))
