"""Privilege separation: a root agent whose ranks run as another user becomes that user after
start-up, and a root helper takes the stacks of ranks it proves itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from otheruser import NOBODY, fork_as, hung_rank, maps_file, private_dir, shared_base
from polling import catches_sigterm, wait_for

from diag.agent.privilege.dumpwire import Outcome, decode_reply
from diag.agent.privilege.stance import Account, Identity, PrivilegePlan, Stance, plan
from diag.formats.exitcodes import HANG_DETECTED
from diag.formats.stackdump import dump_file_name

pytestmark = pytest.mark.timeout(120)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
DIAG = [sys.executable, "-m", "diag.cli.main"]


@pytest.mark.parametrize(
    ("euid", "uid", "gid", "account", "want"),
    [
        (1000, None, None, None, PrivilegePlan(Stance.AS_STARTED)),
        (1000, 1000, None, None, PrivilegePlan(Stance.AS_STARTED)),
        (0, None, None, None, PrivilegePlan(Stance.ROOT)),
        (0, 0, 5, None, PrivilegePlan(Stance.ROOT)),
        (0, 1000, None, None, PrivilegePlan(Stance.DROPPED, Identity(1000, 1000, (1000,)), True)),
        (
            0, 1000, None, Account(100, (100, 27, 44)),
            PrivilegePlan(Stance.DROPPED, Identity(1000, 100, (100, 27, 44)), True),
        ),
        (
            0, 1000, 7, Account(100, (100, 27)),
            PrivilegePlan(Stance.DROPPED, Identity(1000, 7, (7, 27, 100)), True),
        ),
    ],
)  # fmt: skip
def test_plan(
    euid: int, uid: int | None, gid: int | None, account: Account | None, want: PrivilegePlan
) -> None:
    assert plan(euid, uid, gid, account) == want


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


@root_only
def test_a_dropped_agent_runs_as_the_ranks_user_and_dumps_through_its_helper() -> None:
    """The agent, started as root with --trainer-uid, runs as that user with no capabilities and
    cannot be read by it; the only root process is its dump helper; a hung rank of that user is
    named and its stack taken; the incident belongs to that user."""
    with shared_base("diag-test-drop-") as base:
        run_dir = private_dir(base / "run")
        timeline = private_dir(base / "tl")
        ready = base / "run" / "ready"
        rank = fork_as(NOBODY, hung_rank(run_dir, ready))
        agent = None
        try:
            assert wait_for(ready.exists, timeout=30)
            agent = subprocess.Popen(
                [*DIAG, "agent", "--run-dir", str(run_dir), "--timeline", str(timeline),
                 "--state-dir", str(base / "state"), "--trainer-uid", str(NOBODY),
                 "--interval", "0.1", "--hang-floor", "1", "--hang-timeout", "2",
                 "--warmup-timeout", "2", "--control", "false", "--drain", "false",
                 "--until", "incident", "--pyspy-timeout", "20"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            assert wait_for(lambda: catches_sigterm(agent.pid) or agent.poll() is not None, 60)
            assert agent.poll() is None, agent.communicate()[0]
            status = _status(agent.pid)
            assert status["Uid"].split() == [str(NOBODY)] * 4, status["Uid"]
            assert status["Gid"].split() == [str(NOBODY)] * 4, status["Gid"]
            assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
            assert status["NoNewPrivs"] == "1"
            helpers = [p for p in psutil.Process(agent.pid).children() if p.uids().effective == 0]
            assert len(helpers) == 1 and "diag.agent.privilege.dumper" in helpers[0].cmdline()

            def read_agent_environ() -> None:  # the ranks' user may not read the agent
                try:
                    Path(f"/proc/{agent.pid}/environ").read_bytes()
                except PermissionError:
                    return
                raise AssertionError("the ranks' user read the agent's environment")

            assert fork_as(NOBODY, read_agent_environ).wait() == 0
            out, _ = agent.communicate(timeout=90)
        finally:
            if agent is not None and agent.poll() is None:
                agent.kill()
                agent.wait()
            rank.stop()
        assert agent.returncode == HANG_DETECTED, out
        assert "running as the ranks' user (uid 65534" in out, out
        incidents = [p for p in timeline.iterdir() if (p / "verdict.json").exists()]
        assert len(incidents) == 1, out
        incident = incidents[0]
        verdict = json.loads((incident / "verdict.json").read_text())
        assert verdict["evidence"]["stack_failures"] == {}, verdict["evidence"]
        dump = incident / dump_file_name(0, 1)
        assert "rank_waits_in_a_collective_for_ever" in dump.read_text(), out
        assert incident.stat().st_uid == NOBODY
        assert all(p.stat().st_uid == NOBODY for p in incident.iterdir())


@root_only
def test_the_helper_dumps_only_what_it_proves() -> None:
    """The helper proves every claim again: the agent itself, a root process and a process of
    the ranks' user that maps the journal read-only are refused; the rank is dumped; a
    malformed request is refused, not obeyed."""
    from diag.agent.evidence.pyspy import DumpTarget, SpyRefused
    from diag.agent.observe.rankproof import claim_of, file_id
    from diag.agent.privilege.helperspy import DumpHelper

    with shared_base("diag-test-helper-") as base:
        run_dir = private_dir(base / "run")
        # Orphans: here this process plays the agent, whose descendants are never ranks.
        rank = fork_as(NOBODY, hung_rank(run_dir, base / "run" / "ready"), orphan=True)
        others: list = []
        helper = DumpHelper.start(NOBODY)
        try:
            assert wait_for((base / "run" / "ready").exists, timeout=30)
            path = next(run_dir.glob("*.journal"))
            journal = file_id(path)
            others.append(fork_as(0, maps_file(path, base / "r1", writable=True), orphan=True))
            others.append(
                fork_as(NOBODY, maps_file(path, run_dir / "r2", writable=False), orphan=True)
            )
            assert wait_for(lambda: (base / "r1").exists() and (run_dir / "r2").exists(), 30)

            def dump(pid: int) -> tuple[str, bytes]:
                start = psutil.Process(pid).create_time()
                target = DumpTarget(0, 1, pid, claim=claim_of(pid, start, [journal]))
                spy = helper.start_spy(target, False, False, 20.0)
                try:
                    return "", spy.finish(time.monotonic() + 20).stdout
                except SpyRefused as e:
                    return str(e), b""

            assert "the agent's own process" in dump(os.getpid())[0]
            assert "runs as uid (0, 0)" in dump(others[0].pid)[0]
            assert "does not map the journal shared and writable" in dump(others[1].pid)[0]
            why, out = dump(rank.pid)
            assert not why and b"rank_waits_in_a_collective_for_ever" in out, why
            # A raw request out of shape, straight on the channel: refused, answered.
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with tempfile.TemporaryFile() as f1, tempfile.TemporaryFile() as f2:
                socket.send_fds(helper.channel, [b"\0" * 8], [b.fileno(), f1.fileno(), f2.fileno()])
                b.close()
                a.settimeout(10)
                answer = decode_reply(a.recv(2048))
            a.close()
            assert answer.outcome is Outcome.REFUSED and "bad request" in answer.reason
        finally:
            helper.close()
            rank.stop()
            for o in others:
                o.stop()


def test_the_agents_dump_timeout_is_one_its_dump_helper_takes() -> None:
    """A longer --pyspy-timeout would pass the agent's options and then have every dump of a
    dropped agent refused by its root helper."""
    from diag.agent.config.options import OPTIONS
    from diag.agent.privilege.dumpwire import MAX_TIMEOUT

    (opt,) = [o for o in OPTIONS.options if o.name == "pyspy_timeout"]
    bounds = OPTIONS.bounds_of(opt)
    assert bounds is not None and bounds.hi == MAX_TIMEOUT
