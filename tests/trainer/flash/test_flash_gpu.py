"""The CUDA path of flash checkpoints: device-to-host copies into shared memory registered with
CUDA as pinned memory, and a DeepSpeed job on the GPU (fp16 and bf16) resumed bit for bit.
Skipped without a GPU."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from flash_launch import Workspace, assert_same, wait_for
from snapshot_helpers import captured, new_slot

from diag.agent.checkpoint.manager import CheckpointManager, CheckpointSettings
from diag.agent.checkpoint.persist import persist_slot
from diag.agent.checkpoint.service import ControlServer
from diag.formats.rundir import control_socket_path
from diag.formats.snapshot import SnapshotMeta, read_latest_step, step_tag
from diag.trainer.flash.capture import unpickle_state
from diag.trainer.flash.pinned import HostRegistry
from diag.trainer.flash.slotlayout import plan_layout, write_files

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture
def run_dir():
    d = Path(tempfile.mkdtemp(prefix="diag-test-gpu-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_device_storages_land_in_pinned_shared_memory(run_dir: Path, tmp_path: Path) -> None:
    state = {
        "w": torch.randn(1024, 1024, device="cuda"),
        "h": torch.randn(4096, device="cuda").half(),
        "b": torch.randn(3, device="cuda").bfloat16(),
        "step": 1,
    }
    files = captured({"global_step1/mp_rank_00_model_states.pt": state})
    entries, data_end = plan_layout(files)
    meta = SnapshotMeta(
        job="g", rank=0, world_size=1, local_rank=0, node="n", step=1, tag=step_tag(1),
        save_dir=str(tmp_path), files=tuple(entries), device="cuda",
    ).to_json()  # fmt: skip
    slot = new_slot(run_dir, "g", 0, 0)
    slot.grow(data_end + len(meta))
    registry = HostRegistry()
    view = torch.frombuffer(slot.mm, dtype=torch.uint8)
    assert registry.ensure(0, view.data_ptr(), view.numel())
    assert view.is_pinned(), "the mapping is registered with CUDA"
    gen = slot.begin_write()
    assert write_files(slot.mm, view, files, entries), "device copies were issued"
    torch.cuda.current_stream().synchronize()
    slot.mm[data_end : data_end + len(meta)] = meta
    slot.finish_write(gen, 1, data_end, len(meta), 0.0)
    registry.release_all()
    del view

    entry = slot.meta().files[0]
    spans = {s.key: s for s in entry.storages}
    assert entry.pickle is not None
    back = unpickle_state(
        slot.view(entry.pickle.offset, entry.pickle.length),
        lambda k: slot.view(spans[k].offset, spans[k].nbytes),
        "cpu",
        storages={k: s.nbytes for k, s in spans.items()},
        budget=slot.capacity,
    )
    for k in ("w", "h", "b"):
        assert torch.equal(back[k], state[k].cpu())
    slot.close()
    assert persist_slot(slot.path, step=1).ok
    loaded = torch.load(
        tmp_path / "global_step1" / "mp_rank_00_model_states.pt", map_location="cuda"
    )
    assert loaded["w"].is_cuda and torch.equal(loaded["w"], state["w"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_gpu_job_resumes_bit_for_bit(precision: str, tmp_path: Path) -> None:
    run = Path(tempfile.mkdtemp(prefix="diag-test-gpu-run-", dir="/dev/shm"))
    ws = Workspace(tmp_path, run, nproc=min(2, torch.cuda.device_count()))
    # No persist at the rank's death: storage keeps the job's own step 2, so step 3 can only
    # come back from memory (with one GPU, the agent would otherwise persist step 3, complete on
    # every rank there is).
    manager = CheckpointManager(run, None, CheckpointSettings(persist_on_death=False))
    server = ControlServer(control_socket_path(run, None), manager).start()
    try:
        common = ("--cuda", precision, "--zero", "2")
        assert ws.launch("base", *common, "--no-flash") == 0, ws.log("base")
        rc = ws.launch("kill", *common, "--kill-rank", "0", "--kill-step", "3",
                       "--persist-every", "2")  # fmt: skip
        assert rc != 0
        assert wait_for(lambda: read_latest_step(ws.save / "z2") == 2, 60)
        assert ws.launch("mem", *common) == 0, ws.log("mem")
        assert ws.start("mem", 2) == {"step": 3, "from": "memory"}
        assert_same(ws, "mem", 2, 3)
    finally:
        server.stop()
        manager.close(timeout=30)
        shutil.rmtree(run, ignore_errors=True)
