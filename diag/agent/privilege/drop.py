"""Changing the agent's credentials, once, at start-up: the ranks' user's uid, gid and groups,
no capabilities left, no way back (`no_new_privs`), and not dumpable, so a process of that user
cannot ptrace the agent or read its memory (its Kubernetes credentials, the replica token).

After the change the agent can no longer read what only root may: its own code among it, when
the interpreter lives under a directory like /root. So what it imports late is imported first.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import pwd

from diag.agent.privilege.stance import Account, Identity
from diag.formats.exitcodes import UsageError

log = logging.getLogger(__name__)

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_CAP_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapAmb")

# What the agent imports inside functions (a lazy import is cheaper at start-up, but after the
# change it may no longer be readable), and what the standard library imports on first use.
LATE_IMPORTS = (
    "diag.agent.job.verdict",
    "diag.agent.node.nic",
    "diag.agent.node.units",
    "diag.agent.taint.gpuhealth",
    "diag.formats.slotmeta",
    "diag.formats.snapshot",
    "diag.proto.control_pb2",
    "encodings.idna",  # getaddrinfo of a peer's name
    "ctypes.util",
    "orjson",
)
KUBERNETES_IMPORTS = (
    "kubernetes.client",
    "kubernetes.config",
    "kubernetes.client.exceptions",
    "kubernetes.config.config_exception",
)


def account_of(uid: int) -> Account | None:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return None
    return Account(entry.pw_gid, tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)))


def preload(*, kubernetes: bool) -> None:
    """Imports what the agent would otherwise import later (a module that is not installed is
    skipped: its feature reports that when used, as before)."""
    for name in (*LATE_IMPORTS, *(KUBERNETES_IMPORTS if kubernetes else ())):
        try:
            importlib.import_module(name)
        except ImportError:
            log.debug("%s is not importable; skipped before the privilege drop", name)


def become(identity: Identity) -> None:
    """Becomes `identity` for good; a UsageError when the change does not hold."""
    try:
        os.setgroups(list(identity.groups))
        os.setresgid(identity.gid, identity.gid, identity.gid)
        os.setresuid(identity.uid, identity.uid, identity.uid)
    except OSError as e:
        raise UsageError(
            f"cannot become the ranks' user (uid {identity.uid}, gid {identity.gid}): "
            f"{e.strerror}; start the agent as root, or as that user"
        ) from e
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _prctl(_PR_SET_DUMPABLE, 0)
    problem = _still_privileged(identity)
    if problem:
        raise UsageError(f"the privilege drop did not hold: {problem}")


def _still_privileged(identity: Identity) -> str:
    want = (identity.uid,) * 3
    if os.getresuid() != want or os.getresgid() != (identity.gid,) * 3:
        return f"uids {os.getresuid()}, gids {os.getresgid()}"
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        return "setuid(0) still succeeds"
    caps = _capabilities()
    held = [f"{k}={v:x}" for k, v in caps.items() if v]
    return f"capabilities left: {' '.join(held)}" if held else ""


def _capabilities() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _CAP_FIELDS:
                out[key] = int(value.strip(), 16)
    return out


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise UsageError(f"prctl({option}, {value}) failed: {os.strerror(err)}")
