"""A real spare says when its imports are done, and the one that takes a rank is a warm one
first: the launcher's log then says whether the place went to a warm spare or one still
importing (diag.launch.workerpolicy)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from diag.launch.spare import Order
from diag.launch.workers import Spares

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_spare_is_warm_once_imported_and_takes_an_order_without_the_ready_pipe(
    tmp_path: Path,
) -> None:
    fds = _open_fds()
    spares = Spares(1)
    spares.fill()
    try:
        assert spares.ready() == 1 and spares.warm() == 0  # torch takes seconds to import
        deadline = time.monotonic() + 180
        while spares.warm() == 0:
            assert spares.ready() == 1, "the spare died while importing"
            assert time.monotonic() < deadline, "the spare never said its imports were done"
            time.sleep(0.2)
        script = tmp_path / "rank.py"
        out = tmp_path / "env.txt"
        # The rank's script sees the order's environment, not the launcher's ready pipe.
        script.write_text(
            "import os, sys\n"
            f"open({str(out)!r}, 'w').write(repr((os.environ.get('RANK'), "
            "os.environ.get('DIAG_SPARE_READY_FD'), 'torch' in sys.modules)))\n"
        )
        p = spares.take(Order({"RANK": "3"}, [str(script)]))
        assert p is not None
        assert p.wait(timeout=60) == 0
        assert out.read_text() == "('3', None, True)"  # warm: torch was imported already
        assert spares.ready() == 0 and spares.warm() == 0
    finally:
        spares.close(5.0)
    assert _open_fds() == fds, "the ready pipes were not closed"


def test_a_spare_that_dies_importing_is_never_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once, without a word
    fds = _open_fds()
    spares = Spares(1)
    spares.fill()
    try:
        deadline = time.monotonic() + 10
        while spares.ready():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert spares.warm() == 0
    finally:
        for p in spares.waiting:
            p.wait(timeout=10)  # reaped
        spares.close(1.0)
    assert _open_fds() == fds
