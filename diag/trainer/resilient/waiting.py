"""A collective's wait that the recovery's signal can end, on gloo.

Gloo's `abort` (and `shutdown`) leaves a wait already blocked where it is (measured with torch
2.13: a rank blocked in an all-reduce whose own groups were aborted stays blocked until a peer's
connection closes). Such a rank would hold up the next generation until its collective timeout
(600 s by default) or until the peer it waits on frees its groups. So while `resilient` runs on
gloo, `Work.wait` waits on a lock the work's completion releases: a lock wait ends at a signal
(Python runs the handler, which raises `Interrupted`), where gloo's own wait does not. The work
stays in gloo's hands and fails when the peers' connections close. NCCL's abort ends its waits
itself: nothing is patched there.

Freeing a gloo group whose work was abandoned blocks until that work ends (measured: 9.7 s, as
long as the peer kept its end open). So the aborted world's groups are not freed by whichever
thread drops the last reference (the main thread, destroying the last attempt's engine): the
membership keeps them (`Graveyard`) until every abandoned work has ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_abandoned: list[Any] = []  # the futures of works a signal ended the wait for


def abandoned_pending() -> bool:
    """Some work whose wait a signal ended is still running in gloo's threads."""
    with _lock:
        _abandoned[:] = [f for f in _abandoned if not f.done()]
        return bool(_abandoned)


class Graveyard:
    """The process groups of aborted worlds, kept until no abandoned work runs in them."""

    def __init__(self) -> None:
        self._groups: list[Any] = []
        self._lock = threading.Lock()

    def keep(self, groups: list[Any]) -> None:
        with self._lock:
            self._groups.extend(groups)

    def release(self) -> int:
        """Frees the groups once no abandoned work runs (call off the main thread); returns how
        many are still kept."""
        with self._lock:
            if self._groups and not abandoned_pending():
                self._groups = []  # each group's destructor returns at once now
            return len(self._groups)


def interruptible_waits(backend: str) -> Callable[[], None]:
    """Patches `Work.wait` for gloo; returns the undo."""
    if backend != "gloo":
        return lambda: None
    from torch._C._distributed_c10d import Work

    raw = vars(Work)["wait"]  # the class attribute, put back as it was (a pybind descriptor)
    inner = Work.wait

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # a wait with its own timeout: gloo's, which keeps its meaning
            return inner(work, *args, **kwargs)
        try:
            future = work.get_future()
        except Exception:  # a work without a future (some point-to-point ops): gloo's wait
            return inner(work)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        try:
            done.wait()  # a signal ends it: the recovery's handler raises here
        except BaseException:
            with _lock:
                _abandoned.append(future)
            raise
        return inner(work)  # done: returns at once, or raises the work's error

    wait.__wrapped__ = inner  # type: ignore[attr-defined]
    setattr(Work, "wait", wait)  # noqa: B010 - a pybind class: mypy types it as a method

    def undo() -> None:
        if vars(Work).get("wait") is wait:
            setattr(Work, "wait", raw)  # noqa: B010

    return undo
