"""The command line: clear errors for bad input, configuration precedence, and `diag dump` on
really stuck processes."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobrun import free_port
from polling import catches_sigterm, wait_for

from diag.agent.config import agentconfig as config_mod
from diag.agent.detect.hang import OnHang
from diag.agent.observe.procs import stop_tree
from diag.formats.exitcodes import USAGE, UsageError
from diag.formats.journalreader import JournalReader
from diag.formats.stackdump import RankDump

DIAG = [sys.executable, "-m", "diag.cli.main"]


def _diag(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DIAG, *args], capture_output=True, text=True, timeout=timeout, env=env or dict(os.environ)
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "usage: diag <command>"),
        (("frobnicate",), "unknown command 'frobnicate'"),
        (("agent", "--hang-timeout", "-5"), "--hang-timeout: must be > 0"),
        (("agent", "--hang-timeout", "5", "--hang-floor", "9"), None),  # floor is clamped
        (("agent", "--phase-timeout", "eval"), "expected NAME=SECONDS"),
        (("agent", "--warmup-cadence", "-1"), "--warmup-cadence: must be >= 0"),
        (("agent", "--on-hang", "explode"), "invalid choice"),
        (("agent", "--config", "/nonexistent/diag.toml"), "no such file"),
        (("dump", "--pid", "999999999"), "--pid 999999999: no such process"),
        (("launch", "--spares", "-1", "train.py"), "--spares -1: give 0 to 64"),
        (("launch", "--spare-delay", "nan", "train.py"), "--spare-delay nan: give 0 to 3600"),
        (("launch", "--nnodes", "two", "train.py"), "torchrun's arguments: invalid literal"),
        (("launch", "--monitor-interval", "nan", "train.py"), "--monitor-interval: give a"),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(
    args: tuple, message: str | None, tmp_path: Path
) -> None:
    if message is None:
        # Accepted: the floor is capped at the ceiling. Run briefly to prove it starts.
        p = subprocess.Popen(
            [*DIAG, *args, "--run-dir", str(tmp_path / "run"), "--timeline", str(tmp_path / "tl")],
            stderr=subprocess.PIPE,
            text=True,
        )
        # Started once it catches SIGTERM (seconds of imports on a loaded machine).
        assert wait_for(lambda: catches_sigterm(p.pid) or p.poll() is not None, timeout=60)
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        return
    r = _diag(*args, "--timeline", str(tmp_path)) if args[:1] == ("dump",) else _diag(*args)
    out = r.stdout + r.stderr
    assert r.returncode == USAGE, out
    assert message in out
    assert "Traceback" not in out


def test_unwritable_timeline_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = _diag("agent", "--run-dir", str(tmp_path / "run"), "--timeline", str(blocker / "x"))
    assert r.returncode == USAGE and "cannot write incidents" in r.stderr
    assert "Traceback" not in r.stderr


def test_config_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "diag.toml"
    cfg.write_text(
        '[agent]\nhang_timeout = 40\nhang-floor = 4\non_hang = "stop"\n'
        "phase_timeout = { eval = 99 }\n"
    )
    parser = argparse.ArgumentParser()
    config_mod.add_arguments(parser)
    args = parser.parse_args(["--config", str(cfg), "--hang-floor", "3"])
    c = config_mod.load(args, env={"DIAG_HANG_TIMEOUT": "50", "DIAG_RUN_DIR": str(tmp_path)})
    assert c.policy.timeouts.ceiling == 50  # env beats file
    assert c.policy.timeouts.floor == 3  # flag beats file
    assert c.policy.on_hang == OnHang.STOP  # file beats default
    assert c.policy.timeouts.phase_timeouts == {"eval": 99.0}
    assert c.policy.timeouts.warmup_cadence == 30.0  # the default
    assert c.run_dir == tmp_path
    assert (
        config_mod.load(args, env={"DIAG_WARMUP_CADENCE": "0"}).policy.timeouts.warmup_cadence == 0
    )
    defaults = config_mod.load(parser.parse_args([]), env={})
    assert defaults.timeline == Path("/root/timeline") and isinstance(defaults.run_dir, Path)
    # Options of earlier versions fail loudly, wherever they are set, instead of being ignored.
    for argv, env, text in (
        (["--peer-interval", "2"], {}, "--peer-interval was removed"),
        ([], {"DIAG_PEERS": "false"}, "DIAG_PEERS was removed"),
    ):
        with pytest.raises(UsageError, match=text):
            config_mod.load(parser.parse_args(argv), env=env)
    cfg.write_text("[agent]\npeers_dir = '/x'\n")
    with pytest.raises(UsageError, match="peers_dir was removed: the peer board is gone"):
        config_mod.load(parser.parse_args(["--config", str(cfg)]), env={})
    cfg.write_text("[agent]\nhang_timeot = 40\n")
    with pytest.raises(UsageError, match="unknown option 'hang_timeot'"):
        config_mod.load(parser.parse_args(["--config", str(cfg)]), env={})


@pytest.mark.timeout(120)
def test_dump_captures_every_journaled_rank_of_a_stuck_job(tmp_path: Path) -> None:
    run_dir, timeline = tmp_path / "run", tmp_path / "timeline"
    env = dict(os.environ, DIAG_RUN_DIR=str(run_dir), DIAG_JOB="dumptest", OMP_NUM_THREADS="1")
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "diag.trainer.demo_job", "--fault", "hang",
         "--fault-rank", "1", "--fault-step", "2", "--steps", "10"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        # Wait until rank 0 is stuck in a collective that rank 1 never joins.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            journals = sorted(run_dir.glob("*rank00000.journal"))
            if journals:
                tail = JournalReader(journals[0]).tail(1)
                if tail and tail[0].pending and tail[0].step >= 2:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("the job never got stuck")
        r = _diag(
            "dump",
            "--run-dir",
            str(run_dir),
            "--timeline",
            str(timeline),
            "--job",
            "dumptest",
            "--pyspy-timeout",
            "60",  # a native dump on a loaded machine: seconds of symbol loading
            env=env,
        )
        assert r.returncode == 0, r.stderr
        incident = Path(r.stdout.split()[0])
        verdict = json.loads((incident / "verdict.json").read_text())
        assert verdict["kind"] == "manual" and verdict["evidence"]["ranks"] == [0, 1]
        dumps = {d.rank: d for d in map(RankDump.load, incident.glob("*.stack.json"))}
        assert sorted(dumps) == [0, 1]
        assert "inject" in [f.func for t in dumps[1].threads for f in t.frames]
        native = dumps[0].native and any(f.native for t in dumps[0].threads for f in t.frames)
        assert native, verdict.get("evidence")
        assert (incident / "00000-00002.journal.json").exists()
    finally:
        stop_tree(job.pid, grace=5)
        job.wait(timeout=30)


def test_version_is_the_project_s(capsys) -> None:
    import tomllib

    from repo import ROOT

    from diag.cli import main as cli

    want = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"diag {want['project']['version']}"
