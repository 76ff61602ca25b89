"""A collective's wait that the recovery's signal can end, on gloo.

Gloo's `abort` (and `shutdown`) leaves a wait already blocked where it is (measured with torch
2.13: a rank blocked in an all-reduce whose own groups were aborted stays blocked until a peer's
connection closes). Such a rank would hold up the next generation until its collective timeout
(600 s by default) or until the peer it waits on frees its groups. So while `resilient` runs on
gloo, `Work.wait` waits on a lock the work's completion releases: a lock wait ends at a signal
(Python runs the handler, which raises `Interrupted`), where gloo's own wait does not. The work
stays in gloo's hands and fails when the peers' connections close. NCCL's abort ends its waits
itself: nothing is patched there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def interruptible_waits(backend: str) -> Callable[[], None]:
    """Patches `Work.wait` for gloo; returns the undo."""
    if backend != "gloo":
        return lambda: None
    from torch._C._distributed_c10d import Work

    raw = vars(Work)["wait"]  # the class attribute, put back as it was (a pybind descriptor)
    inner = Work.wait

    def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            future = work.get_future()
        except Exception:  # a work without a future (some point-to-point ops): gloo's wait
            return inner(work, *args, **kwargs)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        done.wait()  # a signal ends it: the recovery's handler raises here
        return inner(work, *args, **kwargs)  # done: returns at once, or raises the work's error

    wait.__wrapped__ = inner  # type: ignore[attr-defined]
    setattr(Work, "wait", wait)  # noqa: B010 - a pybind class: mypy types it as a method

    def undo() -> None:
        if vars(Work).get("wait") is wait:
            setattr(Work, "wait", raw)  # noqa: B010

    return undo
