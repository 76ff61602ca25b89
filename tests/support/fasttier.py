"""The fast tier holds no test that starts a job: a guard armed around every test that would run
in it (no slow-class mark, under 2 s in tests/durations.json), in every run, fast or full.

A job is torchrun, a DeepSpeed launcher, the demo job or one of the `*_job.py` scripts of
tests/support. The guard is an audit hook on `subprocess.Popen` (every process the suite starts
goes through it): a new test that starts one, with no mark and no timing entry, fails with what
to do instead of slowing down everyone's minute.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

# What a job looks like on a command line (any of its words).
JOB_WORD = re.compile(
    r"(^|/)torchrun$|^torch\.distributed\.run$|(^|/)deepspeed$|^diag\.trainer\.demo_job$"
    r"|(^|/)\w+_job\.py$|^\w+_job$"
)

_armed: str | None = None  # the node id of the fast-tier test now running
_caught: list[str] = []  # what it started
_installed = False


def job_in(argv: Sequence[Any]) -> str | None:
    """The word of `argv` that makes it a job, None if it is none."""
    for word in argv:
        text = str(word)
        if JOB_WORD.search(text):
            return text.rsplit("/", 1)[-1]
    return None


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event != "subprocess.Popen" or _armed is None:
        return
    executable, argv = args[0], args[1]
    words = [argv] if isinstance(argv, str | bytes) else list(argv or ())
    word = job_in([executable, *words])
    if word is not None:
        _caught.append(word)


def install() -> None:
    global _installed
    if not _installed:
        sys.addaudithook(_hook)  # for the life of the process: audit hooks cannot be removed
        _installed = True


def arm(nodeid: str) -> None:
    global _armed
    _armed = nodeid
    _caught.clear()


def disarm() -> list[str]:
    """What the armed test started that is a job."""
    global _armed
    _armed = None
    caught = list(_caught)
    _caught.clear()
    return caught


def advice(nodeid: str, words: list[str]) -> str:
    return (
        f"{nodeid} starts a job ({', '.join(sorted(set(words)))}) but would run in the fast "
        "tier: mark it @pytest.mark.slow and add the seconds it takes to tests/durations.json "
        "(halved if measured on a machine twice as slow)"
    )
