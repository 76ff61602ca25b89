"""A real `diag agent` restoring an empty node next to hostile replica holders on 127.0.0.1
(tests/support/replica/fakeholder.py speaks the wire protocol): a holder that cannot prove the job's
token is not believed and never sees the token; one that can still does not choose where the
node writes; one that dribbles its bytes does not keep the node out of service; and without a
token there is no replication at all (findings A5, A7, A9 of the security review)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from fakeholder import FakeHolder, Offered
from jobrun import free_port
from polling import catches_sigterm, wait_for
from replica_helpers import TOKEN

JOB = "rj"


def start_agent(
    tmp: Path, ring: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700, exist_ok=True)
    log = tmp / "agent.log"
    cmd = [
        sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run_dir),
        "--timeline", str(tmp / "timeline"), "--job", JOB, "--node", "a",
        "--replica-nodes", ring, "--replica-listen", "127.0.0.1", "--native-stacks", "false",
        "--interval", "0.2", "--termination-grace", "20", "-v", *extra,
    ]  # fmt: skip
    full = {k: v for k, v in os.environ.items() if not k.startswith("DIAG_")}
    full.update(env or {}, DIAG_RUN_DIR=str(run_dir))
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, env=full, stdout=out, stderr=subprocess.STDOUT)
    return agent, log


def stop(agent: subprocess.Popen) -> None:
    if agent.poll() is None:
        agent.kill()
        agent.wait(10)


def test_a_holder_is_believed_only_once_it_proves_the_token_and_never_chooses_the_save_dir(
    tmp_path: Path,
) -> None:
    """A5. Holder b cannot prove the token and offers step 2^62; holder c can, and offers a step
    whose part names the trainer's ~/.ssh with a file `authorized_keys`. The agent pulls from c
    only, sends neither the token, and at the drain (SIGTERM) writes nothing into ~/.ssh: a
    pulled part goes only where this node's own configuration or ranks say."""
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    stranger = FakeHolder("b", Offered("a", JOB, 1 << 62, ssh))
    insider = FakeHolder("c", Offered("a", JOB, (1 << 61) + 1, ssh), token=TOKEN)
    for h, where in ((stranger, "b"), (insider, "c")):
        h.offered.build(tmp_path / f"parts-{where}")
    ring = f"a=127.0.0.1:{free_port()},b=127.0.0.1:{stranger.port},c=127.0.0.1:{insider.port}"
    agent, log = start_agent(tmp_path, ring, "--replica-factor", "2",
                             env={"DIAG_REPLICA_TOKEN": TOKEN})  # fmt: skip
    try:
        assert wait_for(lambda: "control channel on" in log.read_text(), 60), log.read_text()
        assert wait_for(lambda: catches_sigterm(agent.pid), 30)
        agent.send_signal(signal.SIGTERM)  # a drain: persist every newest snapshot, then exit
        agent.wait(60)
    finally:
        stop(agent)
        stranger.close()
        insider.close()
    text = log.read_text()
    assert not (ssh / "authorized_keys").exists(), text
    assert list(ssh.iterdir()) == [], text
    for h in (stranger, insider):
        assert TOKEN.encode() not in h.received, "the token crossed the wire"
    assert "did not prove the job's replica token" in text, text
    assert "offer" not in stranger.served and "pull" not in stranger.served
    assert f"replica restore: peer step {(1 << 61) + 1}" in text, text
    assert "pulled from a peer's replica" in text, text
    assert "Traceback" not in text, text


def test_a_holder_dribbling_its_replica_does_not_keep_the_node_out_of_service(
    tmp_path: Path,
) -> None:
    """A7. Holder b proves the token, offers a replica and sends its manifest, then one byte a
    second: the agent gives the pull up at --replica-pull-deadline (set through the
    environment), warns, and serves its control channel; the ranks restore from storage."""
    slow = FakeHolder("b", Offered("a", JOB, 7, tmp_path / "save"), token=TOKEN, dribble_s=1.0)
    slow.offered.build(tmp_path / "parts")
    ring = f"a=127.0.0.1:{free_port()},b=127.0.0.1:{slow.port}"
    env = {"DIAG_REPLICA_TOKEN": TOKEN, "DIAG_REPLICA_PULL_DEADLINE": "2"}
    agent, log = start_agent(tmp_path, ring, env=env)
    try:
        in_service = wait_for(lambda: "control channel on" in log.read_text(), 15)
        text = log.read_text()
        assert in_service, text
    finally:
        stop(agent)
        slow.close()
    assert "--replica-pull-deadline" in text and "did not finish within" in text, text
    assert "replica restore: none" in text or "replica restore: storage" in text, text
    assert not list((tmp_path / "run").glob("*.snap*")), "a part of the slow pull was installed"


def test_replication_without_a_token_is_refused_at_start(tmp_path: Path) -> None:
    """A9. With no token, replicas would be served to any process that can reach the port (a
    local user who cannot read the run directory included): the agent refuses to start, exit 2,
    saying how to set one."""
    ring = f"a=127.0.0.1:{free_port()},b=127.0.0.1:{free_port()}"
    agent, log = start_agent(tmp_path, ring)
    try:
        code = agent.wait(20)
    finally:
        stop(agent)
    text = log.read_text()
    assert code == 2, text
    assert "DIAG_REPLICA_TOKEN" in text and "Traceback" not in text, text
