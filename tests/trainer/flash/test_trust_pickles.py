"""A slot's pickles are loaded by the trainer: whatever their bytes say, loading them allocates no
more than the slot holds, changes no class or global of the process, and a slot that fails to
load for any reason is reported and left out, the ranks resuming from another step together.

The pickles here are written by hand, as an attacker (or a corruption) would, into real slots
through the trainer's own writer (snapshot_helpers.write_snapshot)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import memprobe
import pytest
from jobrun import free_port
from memprobe import MIB
from picklebombs import BOMBS, global_, pickle_of, text
from repo import SUPPORT
from snapshot_helpers import captured, load_file, new_slot, write_snapshot

from diag.trainer.flash.capture import CapturedFile

MODEL = "global_step5/mp_rank_00_model_states.pt"


_PROBE = """
import atexit, shutil, tempfile
from pathlib import Path
import torch
from snapshot_helpers import load_file, new_slot, write_snapshot
from diag.trainer.flash.capture import CapturedFile, CapturedStorage

TRACE = True  # an allocation never touched shows only there
from picklebombs import BOMBS

def setup():
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-pickles-", dir="/dev/shm"))
    atexit.register(shutil.rmtree, run_dir, True)
    slots = {{}}
    for i, (name, pkl) in enumerate(BOMBS.items()):
        storage = CapturedStorage("0", torch.zeros(4).untyped_storage(), 16)
        slot = new_slot(run_dir, f"bomb{{i}}", 0, 0)
        write_snapshot(slot, 5, [CapturedFile("{model}", "torch", pkl, [storage])], job=f"bomb{{i}}",
                       rank=0, world=1, save_dir=run_dir / "save")
        slots[name] = slot
    return slots

def loader(name):
    def act(slots):
        got = load_file(slots[name])
        return f"loaded a {{type(got).__name__}}"
    return act

CASES = {{name: loader(name) for name in BOMBS}}
"""


def test_memory_bombs_are_refused_before_they_allocate() -> None:
    """A14: a pickle holding bytearray(3 GiB) loaded, and allocated it. Every size a pickle can
    make large is bounded by the slot: refused before the allocation, not after. One child
    process loads every bomb in turn (a torch import, not six)."""
    probes = memprobe.run(_PROBE.format(model=MODEL), timeout=300)
    assert sorted(probes) == sorted(BOMBS)
    bad = {
        name: str(p) for name, p in probes.items()
        if not p.outcome.startswith("Refused")
        or max(p.peak_grew, p.traced_peak) >= 64 * MIB
    }  # fmt: skip
    assert not bad, bad


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-pickles-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _load(run_dir: Path, pkl: bytes, job: str = "j") -> object:
    slot = new_slot(run_dir, job, 0, 0)
    try:
        files = [CapturedFile(MODEL, "torch", pkl, [])]
        write_snapshot(slot, 5, files, job=job, rank=0, world=1, save_dir=run_dir / "save")
        return load_file(slot)
    finally:
        slot.close()


def _build_on(module: str, name: str) -> bytes:
    """BUILD on the global itself, with slot state: setattr(global, "poisoned", 1)."""
    state = b"N}" + text("poisoned") + b"K\x01s\x86"
    return pickle_of(global_(module, name), state, b"b")


POISONABLE = [
    ("argparse", "Namespace"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("torch._utils", "_rebuild_tensor_v2"),  # a function is a global too
]


@pytest.mark.parametrize("where", POISONABLE, ids=lambda w: w[1])
def test_build_on_a_class_or_global_is_refused_and_changes_nothing(
    run_dir: Path, where: tuple[str, str]
) -> None:
    """A14: BUILD on a class set its attributes for the whole process (refused by accident in
    the check, done in the load)."""
    import importlib

    target = getattr(importlib.import_module(where[0]), where[1])
    try:
        with pytest.raises(Exception, match="BUILD on") as refused:
            _load(run_dir, _build_on(*where))
        assert type(refused.value).__name__ == "RefusedBuild"
        assert "for the whole process" in str(refused.value)
        assert not hasattr(target, "poisoned"), "the class was changed for the whole process"
    finally:
        if "poisoned" in vars(target):  # what the code before the fix did
            delattr(target, "poisoned")


def _newobj_with_state(module: str, name: str, key: str, value: bytes) -> bytes:
    return pickle_of(global_(module, name), b")\x81}", text(key), value, b"sb")


@pytest.mark.parametrize(
    "where,key",
    [
        (("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"), "update_scale"),
        (("argparse", "Namespace"), "_get_kwargs"),
        (("argparse", "Namespace"), "__class__"),
    ],
    ids=lambda x: x if isinstance(x, str) else x[1],
)
def test_an_objects_state_cannot_shadow_its_methods(run_dir: Path, where, key: str) -> None:
    """BUILD on an allowed object sets data attributes only: a checkpoint's loss scaler whose
    `update_scale` were builtins.int would have DeepSpeed call int(overflow) at every step."""
    with pytest.raises(Exception, match="shadow") as refused:
        _load(run_dir, _newobj_with_state(*where, key, global_("builtins", "int")))
    assert type(refused.value).__name__ == "RefusedBuild"


_DTYPE_STATE = b"(K\x03" + text("<") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x3ftb"


@pytest.mark.parametrize(
    "pkl",
    [
        pickle_of(global_("numpy.dtypes", "UInt32DType"), b")R", _DTYPE_STATE),
        pickle_of(global_("numpy", "dtype"), text("u4"), b"\x89\x89\x87R", _DTYPE_STATE),
    ],
    ids=["dtype-class-called", "dtype-without-a-copy"],
)
def test_numpys_own_dtypes_are_never_given_state(run_dir: Path, pkl: bytes) -> None:
    """Both calls return numpy's own uint32 dtype, shared by the process: BUILD after them is
    BUILD on a global. numpy pickles a dtype as a copy (`numpy.dtype(name, align, True)`)."""
    import numpy as np

    with pytest.raises(Exception, match=r"never called|not a copy of its own") as refused:
        _load(run_dir, pkl)
    assert type(refused.value).__name__ == "RefusedCall"
    assert np.dtype("u4").flags == 0


def test_a_dtype_state_numpy_never_writes_is_refused(run_dir: Path) -> None:
    """numpy believes the flags a dtype's state gives: -1 made a uint32 array look like one of
    objects (errors deep inside numpy, found by the fuzz run)."""
    import pickle

    import numpy as np

    good = pickle.dumps(np.zeros(2, "u4"), protocol=2)
    flags = b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"
    assert good.count(flags) == 1
    with pytest.raises(Exception, match="not what numpy writes") as refused:
        _load(run_dir, good.replace(flags, flags[:-3] + b"J\xff\xff\xff\xfft"))
    assert type(refused.value).__name__ == "RefusedBuild"
    assert list(_load(run_dir, good, job="k")) == [0, 0]


def test_what_checkpoints_hold_still_loads(run_dir: Path) -> None:
    """The bounds refuse nothing a checkpoint's client state holds (protocol 2 names builtins
    `__builtin__.set`: the code before them refused sets, bytearrays and ranges)."""
    import collections
    import random

    import numpy as np
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "scaler": LossScaler(8.0), "args": argparse.Namespace(lr=0.1, name="x"),
        "address": fragment_address(numel=3, start=4), "seen": {1, 2}, "frozen": frozenset([3]),
        "raw": bytearray(b"abc"), "window": slice(1, 9, 2), "z": complex(1, 2),
        "steps": range(10), "counts": collections.defaultdict(list, a=[1]),
        "recent": collections.deque([1, 2], maxlen=5), "np_rng": np.random.get_state(),
        "py_rng": random.getstate(), "torch_rng": torch.get_rng_state(),
        "param": torch.nn.Parameter(torch.ones(3)), "dtype": np.dtype("f8"),
        "objects": np.array([1, "a"], dtype=object), "meta": torch.empty(3, device="meta"),
        "view": torch.arange(10.0)[2:5], "bf16": torch.ones(2, dtype=torch.bfloat16),
    }  # fmt: skip
    slot = new_slot(run_dir, "j", 0, 0)
    write_snapshot(slot, 5, captured({MODEL: state}), job="j", rank=0, world=1,
                   save_dir=run_dir / "save")  # fmt: skip
    back = load_file(slot)
    slot.close()
    assert vars(back["scaler"]) == vars(state["scaler"])
    assert vars(back["address"]) == vars(state["address"])
    for key in ("args", "seen", "frozen", "raw", "window", "z", "steps", "counts", "recent"):
        assert back[key] == state[key], key
    assert back["py_rng"] == state["py_rng"]
    assert (back["np_rng"][1] == state["np_rng"][1]).all()
    for key in ("torch_rng", "param", "view", "bf16"):
        assert torch.equal(back[key], state[key]), key
    assert back["meta"].shape == (3,) and list(back["objects"]) == [1, "a"]


# -- a slot that fails to load, end to end ------------------------------------------------------


def _run_badslot_job() -> tuple[subprocess.CompletedProcess, dict[str, dict], Path]:
    """One run of tests/support/jobs/badslot_job.py: a real DeepSpeed rank whose snapshots raise a
    ValueError, then hold memory bombs, relaunched (a new checkpointer) after each."""
    root = Path(tempfile.mkdtemp(prefix="diag-test-badslot-"))
    run_dir = Path(tempfile.mkdtemp(prefix="diag-test-badslot-", dir="/dev/shm"))
    try:
        out = root / "out.json"
        cmd = [
            sys.executable, str(SUPPORT / "jobs" / "badslot_job.py"), "--run-dir", str(run_dir),
            "--save-dir", str(root / "save"), "--out", str(out),
        ]  # fmt: skip
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        results = json.loads(out.read_text()) if out.exists() else []
        return done, {r["phase"]: r for r in results}, run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_a_slot_that_fails_to_load_is_reported_and_skipped() -> None:
    """A14: a load failure other than UnpicklingError/KeyError crash-looped the rank. Now any
    failure is reported once with the slot and the reason, the step is left out on every rank
    and the rank resumes from the next candidate, in memory or on storage; a relaunch does not
    meet the failed slot again, and memory bombs in every slot cost no memory."""
    done, phases, run_dir = _run_badslot_job()
    assert done.returncode == 0, done.stderr[-4000:]
    first, again, bomb = phases["valueerror"], phases["valueerror-again"], phases["bomb"]
    assert (first["step"], first["from"]) == (1, "memory"), first
    slot = run_dir / "bad-rank00000.snap1"
    failures = [
        line for line in done.stderr.splitlines()
        if "cannot be loaded from snapshot slot" in line and "step 2 " in line
    ]  # fmt: skip
    assert len(failures) == 2, failures  # the ValueError once, then the bomb of step 2 once
    assert str(slot) in failures[0] and "ValueError: 99 is not a valid ZeroStageEnum" in failures[0]
    assert first["gens"]["bad-rank00000.snap1"][1] % 2 == 1, "the failed snapshot is torn"
    assert (again["step"], again["from"]) == (1, "memory"), again
    # Both slots hold a bomb: the rank resumes from storage, its memory unchanged.
    assert (bomb["step"], bomb["from"]) == (1, "storage"), bomb
    assert bomb["peak_grew"] < 64 * MIB, bomb
    assert "its slot holds" in done.stderr
    assert "storage (step 2, 3 failed to load from memory" in done.stderr
