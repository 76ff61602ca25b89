"""A deadline over a whole exchange on a socket, not over each read: when it passes, the socket is
shut down from a timer thread, so whatever blocks on it returns, however the other end dribbles
its bytes (a socket timeout bounds only the wait for the next byte)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class DeadlineExceeded(TimeoutError):
    """The exchange did not finish in time."""


class Cutoff:
    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.seconds = seconds
        self.fired = False
        self._sock = sock
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            # the plain socket's shutdown, also under TLS: the reader's SSL object stays whole
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def watch(self, sock: socket.socket) -> None:
        """Cuts `sock` instead from now on (TLS took the socket over)."""
        with self._lock:
            self._sock = sock
            if self.fired:
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()


@contextlib.contextmanager
def cutoff(sock: socket.socket, seconds: float, what: str) -> Iterator[Cutoff]:
    """Runs the body with `sock` shut down after `seconds`; any error the body meets after that
    becomes DeadlineExceeded naming `what`."""
    c = Cutoff(sock, seconds)
    c._timer.start()
    try:
        yield c
    except Exception as e:
        if c.fired:
            raise DeadlineExceeded(f"{what} did not finish within {seconds:.1f} s") from e
        raise
    finally:
        c.cancel()
