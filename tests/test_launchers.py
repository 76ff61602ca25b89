"""The collector and the agent work the same under torchrun, the deepspeed launcher and dlrover-run:
each one starts a 2-rank job with a hung rank, and the agent names it."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from diag.agent.demo import DemoOptions, run_demo
from diag.collector.meta import read_meta

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

HERE = Path(__file__).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launchers() -> dict[str, tuple[str, ...]]:
    py = sys.executable
    return {
        "torchrun": (),
        "deepspeed": (
            py,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "2",
            "--master_port",
            str(_port()),
            "--module",
        ),
        "dlrover-run": (
            py,
            str(HERE / "launchers" / "dlrover_run.py"),
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
        ),
    }


@pytest.mark.parametrize("name", ["torchrun", "deepspeed", "dlrover-run"])
def test_hang_is_named_under_each_launcher(name: str, tmp_path: Path) -> None:
    if name == "dlrover-run":
        pytest.importorskip("dlrover", reason="dlrover is installed by scripts/bootstrap.sh")
    opts = DemoOptions(
        nproc=2,
        fault="hang",
        fault_rank=1,
        fault_step=3,
        steps=12,
        workdir=tmp_path,
        merge=False,
        timeout=150,
        launcher=_launchers()[name],
    )
    result = run_demo(opts, out=open(tmp_path / "demo.out", "w"))  # noqa: SIM115
    assert result.verdict is not None, (tmp_path / "agent.log").read_text()[-2000:]
    assert result.verdict["culprit"] == 1 and result.verdict["kind"] == "hang"
    metas = sorted(
        (read_meta(p) for p in (tmp_path / "run").glob("*.journal")), key=lambda m: m.rank
    )
    assert [(m.rank, m.local_rank, m.world_size, m.local_world_size) for m in metas] == [
        (0, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    assert {m.launcher for m in metas} == {name}
