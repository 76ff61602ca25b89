"""The trainer side of a drain, in process: the agreement period (diag.trainer.control.period), the drain
configuration and stop file (diag.trainer.graceful.stopflag), the agreement itself over a real gloo group, and
the storage save of diag.trainer.graceful.gracefulexit on a real DeepSpeed engine."""

from __future__ import annotations

import itertools
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
from jobrun import free_port

from diag.trainer.control.commands import Agreement
from diag.trainer.control.period import AgreementPeriod, PeriodPolicy, propose
from diag.trainer.graceful.stopflag import (
    DRAIN_EXIT_CODE,
    StopFlagSettings,
    StopFlagSettingsError,
    consume_stop_file,
    stop_file_present,
)

# -- the period ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "step_s", "cost_s", "every", "typical"),
    [
        # Nothing measured yet: every step.
        (PeriodPolicy(), None, None, 1, None),
        (PeriodPolicy(), 0.5, None, 1, None),
        # Cheap agreement, 1% budget (aimed at 0.5%): every step (0.1 ms of a 20 ms step).
        (PeriodPolicy(), 0.020, 0.0001, 1, None),
        # 1 ms of a 20 ms step is 5%: every 10 steps aims at 0.5%.
        (PeriodPolicy(), 0.020, 0.001, 10, None),
        # A thousand ranks: 60 ms per agreement, 1 s steps -> every 12 steps for the budget,
        # but the 10 s latency bound caps it at 10.
        (PeriodPolicy(), 1.0, 0.060, 10, None),
        (PeriodPolicy(max_latency_s=20.0), 1.0, 0.060, 12, None),
        # The latency bound wins over the budget: 10 s / 1 s steps -> at most every 10 steps.
        (PeriodPolicy(), 1.0, 0.5, 10, None),
        (PeriodPolicy(max_latency_s=3.0), 1.0, 0.5, 3, None),
        # Steps longer than the bound: every step (a step cannot be cut short).
        (PeriodPolicy(max_latency_s=3.0), 30.0, 0.5, 1, None),
        # A fixed period ignores the measurements.
        (PeriodPolicy(every=4), 1.0, 0.5, 4, None),
        (PeriodPolicy(every=4), None, None, 4, None),
        # Mostly 20 ms steps with a slow one (longest 0.5 s): the budget follows the typical
        # step (1 ms of 20 ms: every 10), the latency bound the longest (10 s / 0.5 s = 20).
        (PeriodPolicy(), 0.5, 0.001, 10, 0.020),
        (PeriodPolicy(), 0.5, 0.010, 20, 0.020),
        # A wider budget (10%) agrees more often.
        (PeriodPolicy(max_overhead=0.1), 0.020, 0.001, 1, None),
    ],
)
def test_proposed_period(policy: PeriodPolicy, step_s, cost_s, every: int, typical) -> None:  # type: ignore[no-untyped-def]
    assert propose(policy, step_s, cost_s, typical) == every


def test_schedule_agrees_at_the_same_steps_on_every_rank() -> None:
    # Two ranks whose clocks and costs differ: both follow the agreed period.
    a, b = AgreementPeriod(PeriodPolicy()), AgreementPeriod(PeriodPolicy())
    met: list[int] = []
    for step in range(1, 60):
        now = step * 0.02
        due = a.boundary(step, now), b.boundary(step, now + 0.003)
        assert due[0] == due[1], step
        if due[0]:
            met.append(step)
            every = min(a.proposal(), b.proposal())
            a.agreed(step, every, 0.0009)
            b.agreed(step, every, 0.004)
    # First boundary, then every step until costs are known, then a period that doubles up to
    # every 9 (0.9 ms of 20 ms, aimed at half the 1% budget).
    assert met[:5] == [1, 2, 4, 8, 16]
    assert all(y - x == 9 for x, y in itertools.pairwise(met[4:])), met
    assert a.latency_bound() == pytest.approx(9 * 0.02)


def test_one_mismeasured_step_cannot_stretch_the_period_past_doubling() -> None:
    # What a resume at 2 ranks with 2 micro-steps per step once did: the first interval timed
    # was half a step (20 ms), the first agreement waited 0.5 s for a rank still loading. At
    # the 2 s bound the period would have gone to 100 steps (10 s of 0.1 s steps).
    p = AgreementPeriod(PeriodPolicy(max_latency_s=2.0))
    assert p.boundary(13, 0.0)
    p.agreed(13, p.proposal(), 0.5)
    assert p.boundary(14, 0.02)
    assert p.proposal() == 2
    p.agreed(14, p.proposal(), 0.001)
    now, step = 0.02, 14
    while step < 40:  # whole steps of 0.1 s from here: the bound holds (2 s / 0.1 s = 20)
        step += 1
        now += 0.1
        if p.boundary(step, now):
            assert p.proposal() <= 2 * p.every
            p.agreed(step, p.proposal(), 0.001)
    assert p.every <= 20
    # A fixed period is taken as it is, from the start.
    assert AgreementPeriod(PeriodPolicy(every=50)).proposal() == 50


def test_a_rebase_agrees_at_the_next_boundary_and_times_no_step_across_it() -> None:
    p = AgreementPeriod(PeriodPolicy())
    p.boundary(1, 0.0)
    p.agreed(1, 30, 0.001)  # next at 31
    p.boundary(2, 0.1)
    p.rebase()  # a checkpoint of step 500 was loaded
    assert p.boundary(501, 50.0)  # agrees there, and 49.9 s is no step time
    assert p.step_seconds == pytest.approx(0.1)


def test_step_time_is_the_longest_recent_step() -> None:
    p = AgreementPeriod(PeriodPolicy(max_latency_s=1.0))
    p.boundary(1, 0.0)
    p.boundary(2, 0.1)
    p.boundary(3, 0.6)  # a slow step
    p.boundary(5, 0.8)  # two steps at once (a restart loaded a later step): 0.1 each
    assert p.step_seconds == pytest.approx(0.5)
    p.agreed(5, 1, 0.2)
    assert p.proposal() == 2  # 1 s bound / 0.5 s steps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "at least 1 step"),
        ({"max_latency_s": 0}, "must be positive"),
        ({"max_overhead": 1.5}, "in (0, 1)"),
    ],
)
def test_bad_policy(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PeriodPolicy(**kwargs)


# -- configuration ------------------------------------------------------------------------------


def test_config_arguments_then_environment_then_defaults(tmp_path: Path) -> None:
    c = StopFlagSettings.resolve(run_dir=tmp_path, env={})
    assert c.stop_file == tmp_path / "stop"
    assert c.exit_code == DRAIN_EXIT_CODE == 143
    assert c.period == PeriodPolicy()
    env = {
        "DIAG_STOP_FILE": "/x/stop", "DIAG_STOP_MAX_LATENCY": "4", "DIAG_STOP_EVERY": "3",
        "DIAG_DRAIN_EXIT_CODE": "75", "DIAG_STOP_MAX_OVERHEAD": "0.05",
    }  # fmt: skip
    c = StopFlagSettings.resolve(run_dir=tmp_path, env=env)
    assert (c.stop_file, c.exit_code) == (Path("/x/stop"), 75)
    assert c.period == PeriodPolicy(max_latency_s=4.0, max_overhead=0.05, every=3)
    c = StopFlagSettings.resolve(stop_file="/y", max_latency_s=2.0, exit_code=99, env=env)
    assert (c.stop_file, c.exit_code, c.period.max_latency_s) == (Path("/y"), 99, 2.0)
    assert StopFlagSettings.resolve(run_dir=tmp_path, env={"DIAG_STOP_FILE": ""}).stop_file is None


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        (
            {},
            {"DIAG_STOP_MAX_LATENCY": "soon"},
            "DIAG_STOP_MAX_LATENCY='soon' is not a valid float",
        ),
        ({}, {"DIAG_STOP_EVERY": "1.5"}, "DIAG_STOP_EVERY='1.5' is not a valid int"),
        ({"exit_code": 0}, {}, "0 would read as success"),
        ({}, {"DIAG_DRAIN_EXIT_CODE": "300"}, "in 1..255"),
        ({"max_latency_s": -1.0}, {}, "DIAG_STOP_MAX_LATENCY"),
    ],
)
def test_bad_config_names_the_problem(kwargs: dict, env: dict, message: str) -> None:
    with pytest.raises(StopFlagSettingsError) as e:
        StopFlagSettings.resolve(env=env, **kwargs)
    assert message in str(e.value)


def test_stop_file(tmp_path: Path) -> None:
    path = tmp_path / "stop"
    assert not stop_file_present(path) and not stop_file_present(None)
    path.touch()
    assert stop_file_present(path)
    consume_stop_file(path)
    consume_stop_file(path)  # already gone: nothing to do
    consume_stop_file(None)
    assert not path.exists()


# -- the agreement over a real gloo group -------------------------------------------------------


def _agree_rank(rank: int, port: int, local: Agreement, q: mp.Queue) -> None:
    import torch.distributed as dist

    from diag.trainer.control.commands import agree

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        q.put((rank, agree(local, None, 3)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_agreement_takes_any_request_the_largest_code_and_the_smallest_period() -> None:
    votes = [
        Agreement(False, False, 0, every=7, no_agent=False),
        Agreement(False, True, DRAIN_EXIT_CODE, every=3, no_agent=False),
        Agreement(True, False, 0, every=12, no_agent=True),
    ]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_agree_rank, args=(r, port, votes[r], q)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    expected = Agreement(True, True, DRAIN_EXIT_CODE, every=3, no_agent=True)
    assert got == {0: expected, 1: expected, 2: expected}


# -- the storage save on one rank ----------------------------------------------------------------


def test_save_to_storage_writes_latest_last_and_only_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from diag.formats.snapshot import read_latest_step
    from diag.trainer.graceful.gracefulexit import save_to_storage

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), dist_init_required=False,
            config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
                    "optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}}},
        )  # fmt: skip
        save = tmp_path / "ckpt"
        save_to_storage(engine, str(save), 5, {"data": 5}, None)
        assert (save / "latest").read_text() == "global_step5"
        assert (save / "dlrover_latest.txt").read_text() == "5"
        assert (save / "global_step5" / "mp_rank_00_model_states.pt").exists()
        assert not list(save.glob(".*.tmp"))
        save_to_storage(engine, str(save), 3, {}, None)  # an older step never moves it back
        assert read_latest_step(save) == 5
        assert (save / "global_step3").is_dir()
        # The engine's own save method is back in place.
        assert not hasattr(engine.checkpoint_engine, "_diag_orig_save")
    finally:
        dist.destroy_process_group()


def _resume_rank(port: int, save: str, q: mp.Queue) -> None:
    """graceful_exit created before the load, as a resuming job does, on a rank of its own (a
    process of its own: DeepSpeed keeps its groups across process groups)."""
    import os
    import time

    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from diag.trainer.graceful.gracefulexit import graceful_exit

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", DIAG_STOP_FILE="")  # fmt: skip
    dist.init_process_group("gloo", rank=0, world_size=1)

    def engine() -> Any:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        e, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), dist_init_required=False,
            config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                    "optimizer": {"type": "Adam", "params": {"lr": 0.1, "torch_adam": True}}},
        )  # fmt: skip
        return e

    def micro_step(e: Any, pause: float) -> None:
        e.backward(e(torch.ones(1, 4)).sum())
        time.sleep(pause)
        e.step()

    try:
        first = engine()
        for _ in range(6):
            micro_step(first, 0)
        first.save_checkpoint(save)
        second = engine()
        drain = graceful_exit(second, save, signals=(), exit=False)
        second.load_checkpoint(save)
        loaded = second.global_steps
        agreed_at: list[int] = []
        agreed = drain.period.agreed

        def noting(step: int, every: int, cost: float) -> None:
            agreed_at.append(step)
            agreed(step, every, cost)

        drain.period.agreed = noting  # type: ignore[method-assign]
        for _ in range(4):
            micro_step(second, 0.05)
        q.put((loaded, agreed_at, drain.period.step_seconds))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_a_resume_is_not_timed_as_a_step(tmp_path: Path) -> None:
    """The load moves global_steps at the first micro-step: that is no step boundary. The first
    agreement is at the next real one, and a step is timed whole (two micro-steps)."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_resume_rank, args=(free_port(), str(tmp_path / "ckpt"), q))
    p.start()
    try:
        loaded, agreed_at, step_s = q.get(timeout=150)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert loaded == 3
    assert agreed_at == [4, 5]
    assert step_s >= 0.09  # two micro-steps of 0.05 s, not one
