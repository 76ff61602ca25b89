"""Deletes what `retention.to_remove` lets go in the timeline: the agent's incident directories
and the job-verdict directories of `.jobs/<job>/`.

Only entries that are real directories with the names the agent gives are candidates: the
timeline is shared (xpu_timer writes there too), and a symlink is never followed nor removed.
Everything goes through descriptors of the timeline opened without following symlinks, and
`shutil.rmtree(dir_fd=...)` refuses a top entry swapped for a symlink meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from diag.agent.retention import Entry, Retention, to_remove
from diag.formats.untrusted import UntrustedInput, open_dir

log = logging.getLogger(__name__)

# <YYYYmmdd-HHMMSS>-<kind>-<node>[@<incident key>][.<n>] (incident.dir_name)
INCIDENT_NAME = re.compile(r"^\d{8}-\d{6}-[A-Za-z0-9_.~@-]+$")
ANY_NAME = re.compile(r"^[^.]")
JOBS_DIR = ".jobs"  # taintevidence.JOB_VERDICTS_DIR
# A job-verdict directory this young may still be settling on another node: never removed.
JOB_VERDICT_MIN_AGE = 3600.0


def prune_incidents(
    timeline: Path, keep: Retention, now: float, protected: Iterable[str] = ()
) -> list[str]:
    """Removes the incident directories of `timeline` past `keep`; returns their names."""
    if keep == Retention():
        return []
    try:
        fd = open_dir(timeline)
    except UntrustedInput as e:
        log.warning("incident retention skipped: %s", e)
        return []
    try:
        return _prune(fd, timeline, INCIDENT_NAME, keep, now, frozenset(protected))
    finally:
        os.close(fd)


def prune_job_verdicts(timeline: Path, keep: Retention, now: float) -> list[str]:
    """The same for each job's directories under `<timeline>/.jobs/<job>/`, sparing those
    younger than JOB_VERDICT_MIN_AGE."""
    if keep == Retention():
        return []
    removed: list[str] = []
    try:
        root = open_dir(timeline / JOBS_DIR)
    except UntrustedInput:
        return []  # no job verdicts yet (or a planted symlink, which we leave alone)
    try:
        for job in _subdirs(root, ANY_NAME):
            try:
                fd = open_dir(job.name, dir_fd=root)
            except UntrustedInput:
                continue
            try:
                young = frozenset(
                    e.name for e in _subdirs(fd, ANY_NAME) if now - e.time < JOB_VERDICT_MIN_AGE
                )
                where = timeline / JOBS_DIR / job.name
                removed += [
                    f"{job.name}/{n}" for n in _prune(fd, where, ANY_NAME, keep, now, young)
                ]
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return removed


def _prune(
    fd: int,
    where: Path,
    pattern: re.Pattern[str],
    keep: Retention,
    now: float,
    protected: frozenset[str],
) -> list[str]:
    entries = list(_subdirs(fd, pattern, sized=keep.max_bytes > 0))
    removed = []
    for name in to_remove(entries, keep, now, protected):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                continue  # replaced by something else since the listing: not ours to remove
            shutil.rmtree(name, dir_fd=fd)
        except OSError as e:
            log.warning("could not remove %s: %s", where / name, e.strerror or e)
            continue
        removed.append(name)
    if removed:
        log.info(
            "removed %d old director%s from %s (retention: %s)",
            len(removed),
            "y" if len(removed) == 1 else "ies",
            where,
            keep,
        )
    return removed


def _subdirs(fd: int, pattern: re.Pattern[str], *, sized: bool = False) -> Iterator[Entry]:
    """The real directories (not symlinks) of `fd` whose names match, with mtime and size."""
    for name in os.listdir(fd):
        if not pattern.match(name):
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            yield Entry(name, st.st_mtime, _tree_bytes(fd, name) if sized else 0)


def _tree_bytes(fd: int, name: str) -> int:
    """Bytes of the regular files below fd/name, walked without following symlinks."""
    total = 0
    with contextlib.suppress(OSError):
        for _, _, files, dfd in os.fwalk(name, dir_fd=fd, follow_symlinks=False):
            for f in files:
                with contextlib.suppress(OSError):
                    st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
    return total
