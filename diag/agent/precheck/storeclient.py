"""Store calls that give up on time.

torch's TCPStore client honours its timeout while connecting and waiting for keys, but a plain
request (check, get, set) on a connection whose network vanished (cable cut, host gone without
a reset) can block for as long as TCP keeps retransmitting: many minutes. Every call here runs
on a helper thread and is abandoned after `timeout_s`; from then on the store counts as lost.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class LostRendezvous(Exception):
    """The store stopped answering, or the coordinator gave up: no global verdict is coming."""


class BoundedStore:
    def __init__(self, store: Any, timeout_s: float, what: str) -> None:
        self.raw = store
        self.timeout_s = timeout_s
        self.what = what  # how to name the store in errors, e.g. "node 0 (10.0.0.1:29500)"
        self._calls: queue.Queue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.Queue()
        )
        self._dead: str | None = None
        threading.Thread(target=self._serve, name="store-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, box, done = self._calls.get()
            try:
                box.append((True, fn()))
            except Exception as e:
                box.append((False, e))
            done.set()

    def _call(self, fn: Callable[[], Any]) -> Any:
        if self._dead:
            raise LostRendezvous(self._dead)
        box: list[Any] = []
        done = threading.Event()
        self._calls.put((fn, box, done))
        if not done.wait(self.timeout_s):
            self._dead = (
                f"lost contact with the rendezvous host {self.what}: no answer within "
                f"{self.timeout_s:g} s"
            )
            raise LostRendezvous(self._dead)
        ok, value = box[0]
        if not ok:
            self._dead = f"lost contact with the rendezvous host {self.what}: {_short(value)}"
            raise LostRendezvous(self._dead)
        return value

    def check(self, key: str) -> bool:
        return bool(self._call(lambda: self.raw.check([key])))

    def get(self, key: str) -> bytes:
        return bytes(self._call(lambda: self.raw.get(key)))

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self.raw.set(key, value))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(lambda: self.raw.add(key, amount)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return bytes(self._call(lambda: self.raw.compare_set(key, expected, desired)))


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]
