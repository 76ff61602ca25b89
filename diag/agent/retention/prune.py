"""Deletes what `retention.decide` lets go in the timeline: this node's incident directories
and the job-verdict directories of `.jobs/<job>/`.

The timeline is shared by every node's agent, the trainers (their own dumps) and xpu_timer, so
what is in it is input, not a record of what this agent wrote. An incident directory counts
(toward the limits, and as one that may go) only when it is this node's: a real directory, not
a symlink, named as `dir_name` names this node's, owned by this agent's user or root, with a
verdict.json (read capped, typed) that names this node. Another node's incidents are never
counted nor removed, whatever their names and dates; one dated in the future ranks below every
real one (`retention`), with one warning naming it.

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

from diag.agent.retention.policy import Entry, Retention, decide
from diag.formats.incidentdir import name_time, node_dir_pattern, verdict_in
from diag.formats.inputcaps import clean
from diag.formats.untrusted import Owners, UntrustedInput, WarnOnce, open_dir

log = logging.getLogger(__name__)
_warn = WarnOnce(log)

ANY_NAME = re.compile(r"^[^.]")
JOBS_DIR = ".jobs"  # taintevidence.JOB_VERDICTS_DIR
# A job-verdict directory this young may still be settling on another node: never removed.
JOB_VERDICT_MIN_AGE = 3600.0


def prune_incidents(
    timeline: Path, keep: Retention, now: float, *, node: str, protected: Iterable[str] = ()
) -> list[str]:
    """Removes `node`'s incident directories in `timeline` past `keep`; returns their names."""
    if keep == Retention():
        return []
    try:
        fd = open_dir(timeline)
    except UntrustedInput as e:
        log.warning("incident retention skipped: %s", e)
        return []
    try:
        entries = list(_own_incidents(fd, timeline, node, sized=keep.max_bytes > 0))
        return _prune(fd, timeline, entries, keep, now, frozenset(protected))
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
                entries = list(_subdirs(fd, ANY_NAME, sized=keep.max_bytes > 0))
                young = frozenset(e.name for e in entries if now - e.time < JOB_VERDICT_MIN_AGE)
                where = timeline / JOBS_DIR / job.name
                removed += [f"{job.name}/{n}" for n in _prune(fd, where, entries, keep, now, young)]
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return removed


def _prune(
    fd: int,
    where: Path,
    entries: list[Entry],
    keep: Retention,
    now: float,
    protected: frozenset[str],
) -> list[str]:
    verdict = decide(entries, keep, now, protected)
    for name in verdict.future:
        _warn(
            "%s is dated in the future: counted after every real entry, removed first",
            where / name,
        )
    removed = []
    for name in verdict.remove:
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


def _own_incidents(fd: int, timeline: Path, node: str, *, sized: bool) -> Iterator[Entry]:
    """`node`'s incident directories in the timeline open as `fd`. Its time is the later of
    the directory's mtime and the time its name begins with (the same for what we wrote: the
    name is taken before the first file), so a fake cannot hide a future date in either."""
    pattern = node_dir_pattern(node)
    owners = Owners.this_process()
    for name in os.listdir(fd):
        if not pattern.match(name):
            continue
        try:
            d = open_dir(name, dir_fd=fd)
        except UntrustedInput:
            continue  # a symlink, a file, or gone
        try:
            st = os.fstat(d)
            if not owners.trusts(st):
                continue  # made by another user: not what this agent wrote
            try:
                written_by = verdict_in(d, timeline / name).node
            except UntrustedInput as e:
                _warn("%s: not counted nor removed by retention: %s", e.path, e.problem)
                continue
            if written_by != clean(node):
                continue
            named = name_time(name)
            t = max(st.st_mtime, named.timestamp()) if named is not None else st.st_mtime
            yield Entry(name, t, _tree_bytes(d, ".") if sized else 0)
        finally:
            os.close(d)


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
