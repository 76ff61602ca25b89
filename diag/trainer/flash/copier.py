"""The copy of a captured checkpoint into its shared-memory slot, inline or on a background
thread, and the completion of the snapshot (its generation made even, its lock released).

On the GPU the copies run on a side stream, after an event recorded on the training stream at
the time of the save, into the slot's mapping registered as pinned memory (pinned.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diag.formats.slotfile import SlotFile
from diag.formats.snapshot import FileEntry
from diag.trainer.flash import slotlayout as layout
from diag.trainer.flash.capture import CapturedFile
from diag.trainer.flash.pinned import HostRegistry

log = logging.getLogger(__name__)


@dataclass
class Copy:
    """One save's copy into a locked slot, finished in the background (or inline)."""

    index: int
    slot: SlotFile
    step: int
    gen: int
    files: list[CapturedFile]
    entries: list[FileEntry]
    data_end: int
    meta: bytes
    persist: bool
    replica_round: bool = False  # a replication round's step: the agent is told once it is copied
    ready: Any = None  # CUDA: an event on the training stream at the time of the save

    @property
    def device(self) -> bool:
        return any(s.storage.device.type != "cpu" for f in self.files for s in f.storages)


Done = Callable[[Copy, float | None], None]  # (copy, seconds or None when it failed)


class Copier:
    def __init__(self, done: Done) -> None:
        self.done = done
        self.pinned = HostRegistry()
        self._thread: threading.Thread | None = None
        self._stream: Any = None

    def start(self, c: Copy, *, background: bool) -> None:
        """Copies `c` (whose slot is locked and marked as being written); at most one at a time."""
        self.wait()
        if c.device:
            import torch

            c.ready = torch.cuda.current_stream().record_event()
        if not background:
            self._run(c)
            return
        self._thread = threading.Thread(
            target=self._run, args=(c,), name="diag-flash-copy", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self, c: Copy) -> None:
        import torch

        seconds: float | None = None
        try:
            t0 = time.perf_counter()
            view = torch.frombuffer(c.slot.mm, dtype=torch.uint8)
            try:
                if c.device:
                    self.pinned.ensure(c.index, view.data_ptr(), view.numel())
                    stream = self._copy_stream()
                    with torch.cuda.stream(stream):
                        stream.wait_event(c.ready)  # the state as of the save() call
                        layout.write_files(c.slot.mm, view, c.files, c.entries)
                    stream.synchronize()
                else:
                    layout.write_files(c.slot.mm, view, c.files, c.entries)
            finally:
                del view
            c.slot.mm[c.data_end : c.data_end + len(c.meta)] = c.meta
            seconds = time.perf_counter() - t0
            c.slot.finish_write(c.gen, c.step, c.data_end, len(c.meta), seconds)
        except Exception:
            log.exception("diag: the copy of step %d into shared memory failed", c.step)
            seconds = None
        finally:
            c.slot.unlock()
            c.files = []  # drop the references to the training state
        self.done(c, seconds)

    def _copy_stream(self) -> Any:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream
