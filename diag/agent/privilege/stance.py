"""What a starting agent becomes: the decision, on plain facts.

- Not root (a pod's user, py-spy carrying `cap_sys_ptrace`): it has no more than its user has;
  it stays as it is and runs py-spy itself.
- Root, ranks as root (no `--trainer-uid`, or 0): whoever writes its directories is root too;
  nothing to separate.
- Root, ranks as another user: a dump helper keeps root (it only attaches py-spy to a process it
  proves itself to be a rank of that user), and the agent becomes the ranks' user: their uid,
  their group (`--trainer-gid`, else the account's primary group, else the uid's number) and the
  account's supplementary groups. Everything else it does, it does as they could.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Stance(Enum):
    AS_STARTED = "as started"  # not root: nothing to give up
    ROOT = "root"  # root, and so are the ranks
    DROPPED = "dropped"  # the ranks' user, a root helper for the dumps


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary, the primary one included


@dataclass(frozen=True)
class Account:
    """What the user database says of a uid (absent for a uid with no entry, as in many
    containers)."""

    gid: int
    groups: tuple[int, ...]


@dataclass(frozen=True)
class PrivilegePlan:
    stance: Stance
    become: Identity | None = None  # None: keep the credentials it started with
    dump_helper: bool = False  # py-spy through a root helper, not run by the agent itself

    def describe(self) -> str:
        if self.become is not None:
            groups = ",".join(str(g) for g in self.become.groups)
            return (
                f"running as the ranks' user (uid {self.become.uid}, gid {self.become.gid}, "
                f"groups {groups}); stack dumps through a root helper"
            )
        if self.stance is Stance.ROOT:
            return "running as root: the ranks run as root (pass --trainer-uid if they do not)"
        return "running as started (not root)"


def plan(
    euid: int, trainer_uid: int | None, trainer_gid: int | None, account: Account | None
) -> PrivilegePlan:
    """`account` is the user database's entry of `trainer_uid`, when it has one."""
    if euid != 0:
        return PrivilegePlan(Stance.AS_STARTED)
    if not trainer_uid:
        return PrivilegePlan(Stance.ROOT)
    if trainer_gid is not None:
        gid = trainer_gid
    elif account is not None:
        gid = account.gid
    else:
        gid = trainer_uid
    extra = account.groups if account is not None else ()
    groups = (gid, *sorted({g for g in extra if g != gid}))
    return PrivilegePlan(Stance.DROPPED, Identity(trainer_uid, gid, groups), dump_helper=True)
