"""The collector in real gloo ranks: what each kind of op leaves in the journal."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from diag.formats.journal import JournalStatus
from diag.formats.journalmeta import read_meta
from diag.formats.journalreader import JournalReader
from diag.formats.records import OpCode, OpFlag, OpState, RecordKind

pytestmark = pytest.mark.timeout(120)


def _rank_main(rank: int, world: int, init_file: str, run_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DIAG_JOB="ctest",
    )
    import torch
    import torch.distributed as dist

    import diag.trainer

    session = diag.trainer.attach(run_dir=run_dir)  # before init: the patch is class-wide
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x = torch.ones(256)
    dist.all_reduce(x)  # sync, with a future
    dist.all_reduce(x, async_op=True).wait()  # async
    out = torch.zeros(128)
    dist.reduce_scatter_tensor(out, torch.ones(256))  # gloo: a work without a future
    pending = dist.reduce_scatter_tensor(out, torch.ones(256), async_op=True)
    sub = dist.new_group([0, 1])
    dist.broadcast(x, src=0, group=sub)
    if rank == 0:
        dist.send(torch.ones(3), dst=1)
        dist.send(torch.ones(3), dst=1)
    else:
        dist.recv(torch.zeros(3), src=0)
        dist.recv(torch.zeros(3), src=0)
    pending.wait()
    with diag.trainer.phase("eval"):
        dist.barrier()
    diag.trainer.step()
    session.instrumentation.uninstall()
    dist.all_reduce(x)  # not journaled any more, and torch still works
    session.instrumentation.install()
    dist.all_reduce(x)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def journals(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    tmp = tmp_path_factory.mktemp("collector")
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(r, 2, str(tmp / "init"), str(tmp / "run")))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode == 0
    return {r: next((tmp / "run").glob(f"ctest-rank0000{r}.journal")) for r in range(2)}


def test_every_op_is_recorded_and_completed(journals: dict[int, Path]) -> None:
    r = JournalReader(journals[1])
    ops = [x for x in r.tail(100) if x.kind == RecordKind.OP]
    assert [x.op for x in ops] == [
        OpCode.ALL_REDUCE, OpCode.ALL_REDUCE, OpCode.REDUCE_SCATTER_BASE,
        OpCode.REDUCE_SCATTER_BASE, OpCode.BROADCAST, OpCode.RECV, OpCode.RECV, OpCode.BARRIER,
        OpCode.ALL_REDUCE,
    ]  # fmt: skip
    assert all(x.state == OpState.COMPLETED and x.t_end_ns >= x.t_enqueue_ns > 0 for x in ops)
    assert ops[0].nbytes == 256 * 4 and ops[2].nbytes == 256 * 4
    assert ops[0].dtype.name == "FLOAT32"


def test_sequence_numbers_line_up_across_ranks(journals: dict[int, Path]) -> None:
    metas = {r: read_meta(p) for r, p in journals.items()}
    seqs = {}
    for rank, path in journals.items():
        names = {g.index: g.name for g in metas[rank].groups}
        seqs[rank] = [
            (names[x.group], x.group_seq, x.op)
            for x in JournalReader(path).tail(100)
            if x.kind == RecordKind.OP and not x.flags & OpFlag.P2P
        ]
    assert seqs[0] == seqs[1]
    world = [s for g, s, _ in seqs[0] if g == metas[0].groups[0].name]
    assert world == [1, 2, 3, 4, 5, 6]  # the un-journaled all_reduce left no gap in numbering
    groups = {g.name: g.ranks for g in metas[0].groups}
    assert sorted(groups.values()) == [(0, 1), (0, 1)]


def test_p2p_ops_carry_the_peer_and_a_per_peer_sequence(journals: dict[int, Path]) -> None:
    sends = [x for x in JournalReader(journals[0]).tail(100) if x.op == OpCode.SEND]
    recvs = [x for x in JournalReader(journals[1]).tail(100) if x.op == OpCode.RECV]
    assert [(x.peer, x.group_seq) for x in sends] == [(1, 1), (1, 2)]
    assert [(x.peer, x.group_seq) for x in recvs] == [(0, 1), (0, 2)]
    assert all(x.flags & OpFlag.P2P for x in sends + recvs)


def test_phase_step_and_close(journals: dict[int, Path]) -> None:
    r = JournalReader(journals[0])
    recs = r.tail(100)
    kinds = [(x.kind, x.name) for x in recs if x.kind != RecordKind.OP]
    assert kinds == [
        (RecordKind.PHASE_BEGIN, "eval"),
        (RecordKind.PHASE_END, "eval"),
        (RecordKind.STEP, ""),
    ]
    barrier = next(x for x in recs if x.op == OpCode.BARRIER)
    assert barrier.step == 0
    st = r.state()
    assert st.status == JournalStatus.CLOSED and st.step == 1 and st.phase == ""
    meta = read_meta(journals[0])
    assert meta.job == "ctest" and meta.pg_timeout_s == 1800.0 and meta.groups[0].backend
    assert [g.timeout_s for g in meta.groups] == [1800.0, 1800.0]


@pytest.mark.slow
# ZeRO 1 runs stage 2's optimizer with other partitions: the long tier.
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.long), 2, 3])
def test_deepspeed_zero_collectives_are_journaled(stage: int, tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DIAG_RUN_DIR=str(tmp_path), DIAG_JOB=f"zero{stage}", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(port), "-m", "diag.trainer.demo_job", "--steps", "3",
         "--zero", str(stage)],
        env=env, timeout=150, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        r = JournalReader(tmp_path / f"zero{stage}-rank0000{rank}.journal")
        recs = r.tail(r.header.capacity)
        ops = {x.op for x in recs if x.kind == RecordKind.OP}
        assert all(x.state == OpState.COMPLETED for x in recs if x.kind == RecordKind.OP)
        assert r.state().step == 3 and r.state().status == JournalStatus.CLOSED
        steps = [x for x in recs if x.kind == RecordKind.STEP]
        assert len(steps) == 3
        if stage == 3:  # parameters are gathered and gradients reduce-scattered
            assert {OpCode.ALL_GATHER_BASE, OpCode.REDUCE_SCATTER_BASE} <= ops
        else:  # gradients are reduced, updated partitions gathered
            assert ops & {OpCode.ALL_REDUCE, OpCode.REDUCE_SCATTER_BASE, OpCode.REDUCE}
            assert ops & {OpCode.ALL_GATHER_BASE, OpCode.ALL_GATHER, OpCode.BROADCAST}


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        # What each launcher's workers were seen to get (dlrover-run: DLRover 0.6.1's elastic agent).
        ({"TORCHELASTIC_RUN_ID": "x", "DLROVER_MASTER_ADDR": "127.0.0.1:5000"}, "dlrover-run"),
        ({"TORCHELASTIC_RUN_ID": "x", "DLROVER_PARAL_CONFIG_PATH": "/tmp/p.json"}, "dlrover-run"),
        ({"TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
        ({"CROSS_RANK": "0"}, "deepspeed"),
        # DLRover's own settings in a pod say nothing of the launcher.
        ({"TORCHELASTIC_RUN_ID": "x", "DLROVER_EVENT_FILE_DIR": "/logs"}, "torchrun"),
        ({"DLROVER_EVENT_FILE_DIR": "/logs"}, "unknown"),
    ],
)
def test_launcher_name(env: dict[str, str], launcher: str) -> None:
    from diag.formats.rundir import launcher_name

    assert launcher_name(env) == launcher
