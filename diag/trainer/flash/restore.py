"""Loading a flash checkpoint back from shared memory, through DeepSpeed's own `load_checkpoint`.

DeepSpeed finds checkpoint files by name (it globs the model-states files and checks that they
exist) and reads them through its checkpoint engine. So we lay out empty placeholder files with
the snapshot's names in a private directory of the run dir, and serve their contents from shared
memory with a loading engine; everything else is DeepSpeed's unchanged logic, for every ZeRO stage.

Slots are read only when this rank's user (or root) owns them. The files of the step the ranks
agreed on are read and unpickled (each pickle proven first: trainer.unpickler) before DeepSpeed's
load runs any collective, so a slot that fails for any reason is reported with its path and the
reason, and the ranks agree on another step together (trainer.flash.resuming), instead of one
rank failing alone in the middle of DeepSpeed's load (and again at every restart).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import pickle
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diag.formats.journalmeta import safe_job_name
from diag.formats.rundir import control_socket_candidates
from diag.formats.slotfile import SlotFile, Snapshot, read_snapshots
from diag.formats.snapshot import (
    FileEntry,
    SnapshotError,
    find_slots,
    pull_marker_path,
    step_tag,
    writing_marker_path,
)
from diag.formats.untrusted import Owners, UntrustedInput, create_new, open_dir, walk_beneath
from diag.trainer.elastic import reshard
from diag.trainer.flash.capture import loading_engine, relative, swapped_engine, unpickle_state

log = logging.getLogger(__name__)

LOAD_LOCK_TIMEOUT_S = 30.0
PULL_WAIT_S = 120.0  # the longest a rank waits for its agent to pull the node's replica
WRITING_WAIT_S = 600.0  # ... for its agent to write the newest step to storage (can be GBs)
AGENT_WAIT_ENV = "DIAG_AGENT_WAIT"  # seconds an empty node's rank waits for its agent to be up

# relative path -> (slot file holding it, its entry)
FileIndex = dict[str, tuple[Path, FileEntry]]


class FlashCheckpointError(RuntimeError):
    pass


class RestoreError(FlashCheckpointError):
    pass


@dataclass(frozen=True)
class Place:
    """Who and where this rank is, as far as finding its snapshots goes."""

    run_dir: Path
    job: str
    node: str
    rank: int
    world_size: int
    save_dir: str
    agent_wait: float = 0.0  # seconds to wait for the agent on an empty node (AGENT_WAIT_ENV)


def agent_wait_from_env(env: dict[str, str] | None = None) -> float:
    """DIAG_AGENT_WAIT, in seconds: 0 when unset."""
    text = (os.environ if env is None else env).get(AGENT_WAIT_ENV, "").strip()
    if not text:
        return 0.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:
        raise ValueError(
            f"{AGENT_WAIT_ENV}={text!r}: give the seconds a rank on an empty node waits for its "
            "agent to be up, from 0 to 3600 (e.g. 60), or leave it unset"
        )
    return seconds


def needed_files(engine: Any, save_dir: str, tag: str) -> set[str]:
    """The files DeepSpeed's load_checkpoint reads on this rank, relative to the save dir."""
    needed = {relative(save_dir, engine._get_ckpt_name(save_dir, tag))}
    if engine.zero_optimization():
        if getattr(engine, "zero_elastic_checkpoint", lambda: False)():
            return {"<every rank's optimizer states>"}  # never all on one node
        needed.add(relative(save_dir, engine._get_zero_ckpt_name(save_dir, tag)))
    return needed


def wait_for_pull(place: Place, timeout: float = PULL_WAIT_S) -> bool:
    """Waits while the node's agent pulls this node's replica from a peer into the run directory
    (its marker is there: a regular file of the rank's user or root); True when it went. A
    marker left by a killed agent costs at most `timeout` seconds."""
    return _wait_marker(
        pull_marker_path(place.run_dir, place.job), timeout, "pull this node's replica"
    )


def wait_for_writing(place: Place, timeout: float = WRITING_WAIT_S) -> bool:
    """Waits while the node's agent writes the job's newest step to storage after the ranks
    stopped (their own snapshots, a lost peer's replica: agent.checkpoint.writingmark); True when
    its marker went. For a rank about to resume from storage: a restart at another size then
    resumes from that step, not an older one."""
    return _wait_marker(
        writing_marker_path(place.run_dir, place.job), timeout, "write the newest step to storage"
    )


def _wait_marker(marker: Path, timeout: float, what: str) -> bool:
    owners = Owners.this_process()

    def gone() -> bool:
        try:
            st = os.lstat(marker)
        except FileNotFoundError:
            return True
        return not stat.S_ISREG(st.st_mode) or not owners.trusts(st)  # not the agent's: ignored

    return _wait_until(
        gone, timeout, f"diag: waiting for the agent to {what} ({marker})",
        f"diag: the agent's work to {what} took over {timeout:.0f} s; not waiting",
    )  # fmt: skip


def _wait_until(done: Callable[[], bool], timeout: float, waiting: str, late: str) -> bool:
    """Polls `done` until it holds (True) or `timeout` seconds pass (False, `late` logged)."""
    deadline = time.monotonic() + timeout
    told = False
    while not done():
        if time.monotonic() >= deadline:
            log.warning("%s", late)
            return False
        if not told:
            log.info("%s", waiting)
            told = True
        time.sleep(0.05)
    return True


def agent_is_up(place: Place) -> bool:
    """Whether the node's agent serves its control channel (it opens it only once it has pulled
    the node's replica) or is pulling (its marker): a socket or regular file of a trusted user."""
    owners = Owners.this_process()
    marker = pull_marker_path(place.run_dir, place.job)
    for path in [*control_socket_candidates(place.run_dir, place.job), marker]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        kind_ok = stat.S_ISREG(st.st_mode) if path == marker else stat.S_ISSOCK(st.st_mode)
        if kind_ok and owners.trusts(st):
            return True
    return False


def wait_for_agent(place: Place, timeout: float) -> bool:
    """Waits until the node's agent is up (agent_is_up), at most `timeout` seconds; True when
    it is. A pod's containers start together, and a rank that reaches its restore before its
    agent has even started would find an empty node and resume from storage, an older step,
    while the agent was about to pull the newer one from a peer."""
    return _wait_until(
        lambda: agent_is_up(place), timeout,
        f"diag: waiting for this node's agent to be up ({place.run_dir})",
        f"diag: no agent came up in {place.run_dir} within {timeout:.0f} s ({AGENT_WAIT_ENV}): "
        "restoring without it",
    )  # fmt: skip


def _node_snapshots(place: Place) -> list[Snapshot]:
    return [
        s for s in read_snapshots(find_slots(place.run_dir, place.job), Owners.this_process())
        if s.meta.node == place.node
    ]  # fmt: skip


def memory_index(place: Place, needed: Callable[[str], set[str]]) -> dict[int, FileIndex]:
    """step -> file index, for the snapshots this rank could load: complete, of this job layout,
    with every file it needs held on this node (its own, or a local rank's). Their pickles are
    proven when the step is read (stage): only the chosen step's, once."""
    if place.agent_wait > 0 and not _node_snapshots(place):
        wait_for_agent(place, place.agent_wait)  # an empty node: its agent may bring a replica
    wait_for_pull(place)
    local = [
        s for s in _node_snapshots(place)
        if s.meta.world_size == place.world_size
        and s.meta.save_dir == place.save_dir
    ]  # fmt: skip
    out: dict[int, FileIndex] = {}
    for step in {s.meta.step for s in local if s.meta.rank == place.rank}:
        index: FileIndex = {}
        # Own files win over node-local copies of the same path.
        for s in sorted(local, key=lambda s: s.meta.rank != place.rank):
            if s.meta.step == step:
                for f in s.meta.files:
                    if f.kind == "torch":
                        index.setdefault(f.path, (s.path, f))
        if needed(step_tag(step)) <= set(index):
            out[step] = index
    return out


def _remove_shadow(run_dir: Path, name: str) -> None:
    """Removes run_dir/name, whatever it is, without following a symlink."""
    base = open_dir(run_dir)
    try:
        with contextlib.suppress(OSError, UntrustedInput):
            with walk_beneath(base, (name,)):
                pass  # a real directory, not a link to one
            shutil.rmtree(name, dir_fd=base)  # ours, left by a load that was killed
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            os.unlink(name, dir_fd=base)  # a file or a symlink: removed, never followed
    finally:
        os.close(base)


def _fresh_shadow(run_dir: Path, name: str) -> None:
    """Makes run_dir/name an empty private directory, whatever was planted under that name."""
    _remove_shadow(run_dir, name)
    os.mkdir(run_dir / name, 0o700)


@dataclass(frozen=True)
class LoadFailure:
    """Why this rank could not read one of its files of a step from shared memory."""

    slot: Path
    file: str
    reason: str


def stage(
    place: Place, step: int, index: FileIndex, needed: set[str]
) -> dict[str, Any] | LoadFailure:
    """Reads and unpickles the files of `step` this rank's load needs (relative path -> state),
    on the CPU, where DeepSpeed's own loads map every checkpoint file. Collective-free: a
    failure of any kind is logged once, naming the slot and the reason, and returned."""
    objects: dict[str, Any] = {}
    for rel in sorted(needed & set(index)):
        path, entry = index[rel]
        try:
            objects[rel] = _read(path, entry, step)
        except Exception as e:  # whatever a slot's bytes make the unpickler or a rebuild raise
            reason = f"{type(e).__name__}: {e}"
            log.warning(
                "diag: step %d cannot be loaded from snapshot slot %s (%s): %s; the ranks "
                "resume from an older step or from storage", step, path, rel, reason,
            )  # fmt: skip
            return LoadFailure(path, rel, reason)
    return objects


def _read(path: Path, entry: FileEntry, step: int, map_location: Any = None) -> Any:
    """One file of a snapshot, unpickled: its storages copied out of the slot."""
    slot = _open_for_load(path)
    try:
        h = slot.header()
        if not h.complete or h.step != step or entry.pickle is None:
            raise RestoreError(f"{path} no longer holds step {step}")
        spans = {s.key: s for s in entry.storages}
        return unpickle_state(
            slot.view(entry.pickle.offset, entry.pickle.length),
            lambda key: slot.view(spans[key].offset, spans[key].nbytes),
            _on_cpu if map_location is None else map_location,
            storages={s.key: s.nbytes for s in entry.storages},
            budget=slot.capacity,
        )
    finally:
        slot.close()


def _on_cpu(storage: Any, location: str) -> Any:
    return storage


def load_from_memory(
    engine: Any, place: Place, step: int, index: FileIndex, staged: dict[str, Any]
) -> tuple[Any, Any]:
    """engine.load_checkpoint of `step`, served from what `stage` read, and from shared memory for
    any file it did not. A file asked for again gets what was read (DeepSpeed's state-dict loader
    opens the model states twice, once for their keys: a second copy out of the slot cost a quarter
    of a restore), in a top-level dict of its own, so that a key one reader takes out stays for
    the other; the tensors are shared, as the second reader only copies them into the model."""
    name = f".{safe_job_name(place.job)}-rank{place.rank:05d}.load"
    shadow = place.run_dir / name
    try:
        _fresh_shadow(place.run_dir, name)
        base = open_dir(shadow)
        try:
            for _path, entry in index.values():
                # DeepSpeed globs and checks names; we serve the bytes
                with walk_beneath(base, entry.parts[:-1], create=True) as d:
                    os.close(create_new(entry.parts[-1], dir_fd=d))
        finally:
            os.close(base)

        def load(rel: str, map_location: Any) -> Any:
            if rel in staged:
                return _own_top(staged[rel])
            path, entry = index[rel]
            try:
                return _read(path, entry, step, map_location)
            except (RestoreError, pickle.UnpicklingError, KeyError) as e:
                raise RestoreError(f"snapshot slot {path}, {rel}: {e}") from None

        with swapped_engine(engine, loading_engine(str(shadow), load)), reshard.direct():
            return engine.load_checkpoint(str(shadow), tag=step_tag(step))
    finally:
        staged.clear()  # what DeepSpeed kept stays with it
        _remove_shadow(place.run_dir, name)


def _own_top(state: Any) -> Any:
    return copy.copy(state) if isinstance(state, dict) else state


def _open_for_load(path: Path) -> SlotFile:
    try:
        slot = SlotFile.open(path, owners=Owners.this_process())
    except (OSError, SnapshotError, UntrustedInput) as e:
        raise RestoreError(f"cannot load snapshot slot {path}: {e}") from None
    if not slot.lock_shared(LOAD_LOCK_TIMEOUT_S):
        slot.close()
        raise RestoreError(f"{path} stayed locked by a writer")
    return slot
