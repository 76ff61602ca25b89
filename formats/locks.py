"""Open-file-description locks (fcntl F_OFD_SETLK): held per open file, not per process.

Classic POSIX record locks belong to the process: two threads of one process never exclude each
other, and closing any descriptor of the file drops all of the process's locks. OFD locks belong
to the open file, so every `open()` is its own owner (threads and processes alike), and the kernel
releases them when the last descriptor of that open file goes away (a dead holder never leaves a
lock behind). They go through the same lock manager as POSIX locks, so network filesystems that
support POSIX locks (NFSv3 with lockd, NFSv4, CephFS, Lustre with -o flock) honour them across
machines.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux; OFD locks need l_pid == 0

SHARED = fcntl.F_RDLCK
EXCLUSIVE = fcntl.F_WRLCK
UNLOCK = fcntl.F_UNLCK


def ofd_lock(fd: int, kind: int, wait: bool) -> bool:
    """Takes (or with UNLOCK releases) a lock on the whole file; False when another holder has
    it and `wait` is False. Other errors (e.g. ENOLCK: the filesystem has no locks) raise."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True
