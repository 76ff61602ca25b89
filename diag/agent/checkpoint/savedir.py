"""Whose save directory it is: the rule for a save directory that a slot names.

A slot names its own save directory. On a bare node the agent runs as root and the ranks as an
unprivileged user, so a directory named by a slot of another user is that user's input: the agent
writes only into a directory that user already owns (it could write there itself), never creates
one for it, never opens it through a symlink, and gives everything it creates beneath it to the
directory's owner, so the trainer can later rewrite `latest` and remove old steps. A symlinked
parent needs no rule of its own: whatever path leads there, the directory opened must be that
user's. A directory the operator names (--save-dir), or one named by a slot of the agent's own
user (a pod, a root trainer), is used as configured: made when missing, its path followed.

`rule_for` and `refusal` are the pure rules; `open_save_dir` and `beneath` are the thin adapters.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from diag.formats.untrusted import UntrustedInput, open_dir, walk_beneath

DIR_MODE = 0o755


@dataclass(frozen=True)
class SaveDirRule:
    """How the agent may use a save directory. `owner`: the uid that must own it (the slot's
    owner); None: as configured."""

    owner: int | None = None


AS_CONFIGURED = SaveDirRule()


def rule_for(*, from_operator: bool, slot_owner: int, agent_euid: int) -> SaveDirRule:
    if from_operator or slot_owner == agent_euid:
        return AS_CONFIGURED
    return SaveDirRule(owner=slot_owner)


class DirKind(enum.Enum):
    MISSING = "missing"
    SYMLINK = "symlink"
    NOT_DIR = "not a directory"
    DIR = "directory"


@dataclass(frozen=True)
class DirFacts:
    kind: DirKind
    uid: int = -1


def refusal(rule: SaveDirRule, facts: DirFacts) -> str | None:
    """Why a save directory may not be used under `rule` (None: it may)."""
    if rule.owner is None:
        return None
    if facts.kind is DirKind.MISSING:
        return "does not exist (the agent does not create a save directory a slot names)"
    if facts.kind is DirKind.SYMLINK:
        return "is a symlink (the agent does not follow one to a save directory a slot names)"
    if facts.kind is DirKind.NOT_DIR:
        return "is not a directory"
    if facts.uid != rule.owner:
        return f"is owned by uid {facts.uid}, not by the slot's owner uid {rule.owner}"
    return None


def advice(rule: SaveDirRule) -> str:
    return (
        f"create the save directory as the ranks' user (uid {rule.owner}), "
        "or give the agent --save-dir"
    )


class SaveDirRefused(UntrustedInput):
    """A save directory named by a slot that the agent does not write into."""


@dataclass(frozen=True)
class Owner:
    uid: int
    gid: int


@dataclass(frozen=True)
class Base:
    """An open save directory; `give_to`: who gets what the agent creates beneath it."""

    fd: int
    give_to: Owner | None = None

    def give(self, fd: int) -> None:
        """Gives the file or directory open at `fd`, which the agent just created, to the save
        directory's owner (only what is the agent's: never someone else's swapped-in entry)."""
        if self.give_to is not None and os.fstat(fd).st_uid == os.geteuid():
            os.fchown(fd, self.give_to.uid, self.give_to.gid)


def _facts(path: Path, err: OSError) -> DirFacts:
    if err.errno == errno.ENOENT:
        return DirFacts(DirKind.MISSING)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return DirFacts(DirKind.MISSING)
    if stat.S_ISLNK(st.st_mode):
        return DirFacts(DirKind.SYMLINK, st.st_uid)
    if not stat.S_ISDIR(st.st_mode):
        return DirFacts(DirKind.NOT_DIR, st.st_uid)
    raise err


@contextlib.contextmanager
def open_save_dir(save_dir: Path, rule: SaveDirRule, *, create: bool = False) -> Iterator[Base]:
    """The save directory, open; SaveDirRefused when `rule` forbids it."""
    if rule.owner is None:
        if create:
            os.makedirs(save_dir, DIR_MODE, exist_ok=True)
        fd = os.open(save_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        base = Base(fd)
    else:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(save_dir, flags)
        except OSError as e:
            problem = refusal(rule, _facts(save_dir, e))
            raise SaveDirRefused(save_dir, problem or str(e)) from None
        st = os.fstat(fd)
        problem = refusal(rule, DirFacts(DirKind.DIR, st.st_uid))
        if problem is not None:
            os.close(fd)
            raise SaveDirRefused(save_dir, problem)
        base = Base(fd, Owner(st.st_uid, st.st_gid))
    try:
        yield base
    finally:
        os.close(fd)


@contextlib.contextmanager
def beneath(base: Base, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
    """A descriptor of base/parts, no symlink followed; missing directories are made (ours,
    DIR_MODE) and given to the save directory's owner when `create`."""
    if not create:
        with walk_beneath(base.fd, parts) as d:
            yield d
        return
    fds: list[int] = []
    cur = base.fd
    try:
        for part in parts:
            made = True
            try:
                os.mkdir(part, DIR_MODE, dir_fd=cur)
            except FileExistsError:
                made = False
            cur = open_dir(part, dir_fd=cur)
            fds.append(cur)
            if made:
                base.give(cur)
        yield cur
    finally:
        for fd in fds:
            os.close(fd)
