"""Leaving a rank's process without the interpreter's teardown.

With gloo, a process group's worker thread may still hold the last reference to an async work
(ZeRO-3 issues all-gathers nobody waits for) when Python finalizes. Destroying that work takes the
GIL to drop its tensors; during finalization that ends the thread from inside a C++ destructor and
the process aborts ("terminate called without an active exception", SIGABRT) after it finished
its work. Seen here about once in 20 runs of a 2-rank ZeRO-3 job, with or without diag; a barrier
before `destroy_process_group` does not prevent it. The launcher then reports the rank as failed.
Running the exit handlers ourselves and leaving with `os._exit` skips finalization altogether.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def exit_process(code: int = 0) -> NoReturn:
    """Runs the `atexit` handlers (diag closes its journal and checkpoint slots there, logging
    flushes), flushes stdio, and exits with `code` without finalizing the interpreter. Call it
    last, after `destroy_process_group()`."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
