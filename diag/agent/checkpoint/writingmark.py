"""The mark a node's agent keeps in the run directory while it writes a job's newest step to
storage after the job's ranks stopped: its ranks' own snapshots, then the replicas of lost peers
(agent.replication). A restart at another data-parallel size resumes from storage; its ranks wait
while the mark is there (trainer.flash.restore), so they resume from the step being written.

Held by count: the persist of the ranks' own snapshots takes it, a replica handover takes it
before that persist lets go, so the mark stays through both. A mark a killed agent left is removed
at the next agent's start, and the ranks wait for one at most a bounded time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import Counter
from pathlib import Path

from diag.formats.snapshot import writing_marker_path

log = logging.getLogger(__name__)


class WritingMarks:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    def clear_stale(self, job: str) -> None:
        """Removes the mark a killed agent left."""
        with contextlib.suppress(OSError):
            writing_marker_path(self.run_dir, job).unlink()

    def take(self, job: str) -> None:
        with self._lock:
            self._held[job] += 1
            if self._held[job] > 1:
                return
            path = writing_marker_path(self.run_dir, job)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                with contextlib.suppress(FileExistsError):
                    os.close(os.open(path, flags, 0o600))
            except OSError as e:  # the mark only saves steps: writing goes on without it
                log.warning("cannot mark %s: %s", path, e.strerror)

    def release(self, job: str) -> None:
        with self._lock:
            if self._held[job] <= 0:
                return
            self._held[job] -= 1
            if self._held[job] == 0:
                del self._held[job]
                with contextlib.suppress(OSError):
                    writing_marker_path(self.run_dir, job).unlink()

    def held(self, job: str) -> bool:
        with self._lock:
            return self._held[job] > 0
