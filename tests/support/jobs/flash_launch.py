"""Launching the flash-checkpoint test job under torchrun, and comparing runs (shared by the
CPU and GPU end-to-end tests)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jobrun
import torch

JOB_SCRIPT = Path(__file__).with_name("flash_job.py")
STEPS = 6


def wait_for(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


@dataclass
class Workspace:
    root: Path
    run_dir: Path
    nproc: int = 2

    @property
    def save(self) -> Path:
        return self.root / "ckpt"

    def env(self) -> dict[str, str]:
        return dict(os.environ, DIAG_RUN_DIR=str(self.run_dir), OMP_NUM_THREADS="1")

    def command(self, *args: str) -> list[str]:
        return jobrun.command(
            self.nproc, JOB_SCRIPT, "--steps", str(STEPS), "--save-dir", str(self.save), *args
        )

    def launch(self, name: str, *args: str, timeout: float = 240) -> int:
        cmd = self.command("--out", str(self.root / name), *args)
        return jobrun.run(cmd, self.root / f"{name}.log", self.env(), timeout)

    def losses(self, name: str, zero: int) -> dict[int, str]:
        lines = (self.root / name / f"z{zero}" / "loss.jsonl").read_text().splitlines()
        return {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}

    def params(self, name: str, zero: int) -> dict[str, torch.Tensor]:
        return torch.load(self.root / name / f"z{zero}" / "params.pt")

    def start(self, name: str, zero: int) -> dict:
        return json.loads((self.root / name / f"z{zero}" / "start.json").read_text())

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-4000:]


def assert_same(ws: Workspace, name: str, zero: int, from_step: int) -> None:
    base, got = ws.losses("base", zero), ws.losses(name, zero)
    assert sorted(got) == list(range(from_step + 1, STEPS + 1)), (name, zero, sorted(got))
    for step, loss in got.items():
        assert loss == base[step], f"ZeRO-{zero} {name}: loss of step {step} differs"
    pa, pb = ws.params("base", zero), ws.params(name, zero)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), f"ZeRO-{zero} {name}: parameter {k} differs"
