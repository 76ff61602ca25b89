"""Room in the shared-memory directory for snapshot slots: how much is free, whether it is memory
at all, and the one message that says what to do when it is short."""

from __future__ import annotations

import os
from pathlib import Path

from diag.formats.snapshot import ShmSpaceError


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def is_memory_backed(directory: Path) -> bool:
    """True when `directory` lives on tmpfs (or ramfs)."""
    try:
        best, fstype = "", ""
        target = str(directory.resolve())
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                    if inside and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
        return fstype in ("tmpfs", "ramfs")
    except OSError:
        return False


def space_message(directory: Path, needed: int) -> str:
    free = free_bytes(directory) if directory.exists() else 0
    return (
        f"flash checkpoint needs {needed / 2**30:.2f} GiB more in {directory} but only "
        f"{free / 2**30:.2f} GiB is free. Give the shared-memory directory more room: "
        f"`docker run --shm-size=...`, or in Kubernetes mount an emptyDir with `medium: Memory` "
        f"and a `sizeLimit` of at least the slots of all local ranks at the run directory "
        f"(DIAG_RUN_DIR); remember that tmpfs pages count against the pod's memory limit"
    )


def check_space(directory: Path, needed: int) -> None:
    """Raises ShmSpaceError, before anything is allocated, when `needed` bytes do not fit."""
    free = free_bytes(directory)
    if needed > free:
        raise ShmSpaceError(space_message(directory, needed))
