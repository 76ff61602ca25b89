"""Open-file-description locks (fcntl F_OFD_SETLK): held per open file, not per process.

Classic POSIX record locks belong to the process: two threads of one process never exclude each
other, and closing any descriptor of the file drops all of the process's locks. OFD locks belong
to the open file, so every `open()` is its own owner (threads and processes alike), and the kernel
releases them when the last descriptor of that open file goes away (a dead holder never leaves a
lock behind). They go through the same lock manager as POSIX locks, so network filesystems that
support POSIX locks (NFSv3 with lockd, NFSv4, CephFS, Lustre with -o flock) honour them across
machines.

`open_lock_file` opens a lock file in a directory others can write (the shared timeline).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct

from diag.formats.untrusted import UntrustedInput, describe_mode, open_error

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


def open_lock_file(name: str, *, dir_fd: int, mode: int = 0o600) -> int:
    """The lock file `name` in the directory `dir_fd`, opened read-write (made with `mode` if
    missing) without following a symlink or blocking on a FIFO; UntrustedInput unless it is a
    regular file. Another writer of the directory may have been first: a symlink there would
    have us create or lock a file of its choosing, a FIFO would hang the open."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        raise open_error(name, e) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UntrustedInput(name, f"is {describe_mode(st.st_mode)}, expected a regular file")
    os.set_blocking(fd, True)
    return fd
