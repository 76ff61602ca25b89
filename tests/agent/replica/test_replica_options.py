"""The replica options, read as the agent reads them: nodes, factor, token, caps; mistakes are
usage errors naming the option."""

from __future__ import annotations

import argparse

import pytest

from diag.agent.config import agentconfig as config
from diag.agent.replica.settings import NodeAddress, parse_nodes
from diag.formats.exitcodes import UsageError

NODES = "w0=10.0.0.1:7070,w1=[fd00::2]:7070,w2=w2.svc.cluster.local:7071"
SECRET = "s3cret-of-the-job-0123"


def load(argv: list[str], env: dict[str, str] | None = None) -> config.AgentSettings:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return config.load(
        p.parse_args(argv), env={"DIAG_REPLICA_TOKEN": SECRET} if env is None else env
    )


def test_nodes_parse_in_order():
    assert parse_nodes(NODES) == (
        NodeAddress("w0", "10.0.0.1", 7070),
        NodeAddress("w1", "fd00::2", 7070),
        NodeAddress("w2", "w2.svc.cluster.local", 7071),
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("w0=10.0.0.1", "NAME=HOST:PORT"),
        ("w0=10.0.0.1:0", "not a TCP port"),
        ("w0=10.0.0.1:99999", "not a TCP port"),
        ("=10.0.0.1:7070", "NAME=HOST:PORT"),
        ("w0=a b:7070", "NAME=HOST:PORT"),
        ("w0=h:1,w0=h:2", "named twice"),
        ("w\x1b0=h:1", "NAME=HOST:PORT"),
    ],
)
def test_bad_node_lists_are_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_nodes(text)


def test_the_agent_reads_the_replica_options():
    cfg = load(
        ["--job", "j", "--node", "w1", "--replica-nodes", NODES, "--replica-factor", "2",
         "--replica-max-bytes", "2GiB", "--replica-lost-after", "12"],
        env={"DIAG_REPLICA_TOKEN": SECRET, "DIAG_REPLICA_INTERVAL": "0.5"},
    )  # fmt: skip
    r = cfg.replica
    assert r is not None
    assert [n.name for n in r.nodes] == ["w0", "w1", "w2"]
    assert (r.factor, r.token, r.max_bytes, r.interval) == (2, SECRET, 2 << 30, 0.5)
    assert r.max_rate == 0  # no cap unless asked
    assert r.lost_after == 12.0


def test_the_push_rate_cap_is_read_in_bytes_per_second():
    cfg = load(["--job", "j", "--node", "w1", "--replica-nodes", NODES],
               env={"DIAG_REPLICA_MAX_RATE": "500MB", "DIAG_REPLICA_TOKEN": SECRET})  # fmt: skip
    assert cfg.replica is not None and cfg.replica.max_rate == 500_000_000


def test_no_nodes_no_replicas():
    assert load(["--job", "j"]).replica is None


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--node", "w1", "--replica-nodes", NODES], "needs --job"),
        (["--job", "j", "--node", "zz", "--replica-nodes", NODES], "'zz', is not in"),
        (["--job", "j", "--node", "w1", "--replica-nodes", "w1"], "--replica-nodes"),
        (["--job", "j", "--replica-nodes", NODES, "--replica-factor", "-1"], "replica-factor"),
        (["--job", "j", "--replica-nodes", NODES, "--replica-max-bytes", "1KiB"], "max-bytes"),
        (["--job", "j", "--replica-nodes", NODES, "--replica-lost-after", "0"], "lost-after"),
    ],
)
def test_replica_mistakes_are_usage_errors(argv, problem):
    with pytest.raises(UsageError, match=problem):
        load(argv)


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({}, "is not set"),
        ({"DIAG_REPLICA_TOKEN": "s3cret"}, "fewer than 16"),
    ],
)
def test_replication_needs_the_jobs_token(env, problem):
    with pytest.raises(UsageError, match=problem) as e:
        load(["--job", "j", "--node", "w1", "--replica-nodes", NODES], env=env)
    assert "DIAG_REPLICA_TOKEN" in str(e.value)


def test_the_pull_deadline_and_tls_options(tmp_path):
    cfg = load(["--job", "j", "--node", "w1", "--replica-nodes", NODES,
                "--replica-pull-deadline", "30", "--replica-tls-cert", "/c.pem",
                "--replica-tls-key", "/k.pem", "--replica-tls-ca", "/ca.pem"])  # fmt: skip
    r = cfg.replica
    assert r is not None and r.pull_deadline == 30.0
    assert r.tls is not None and (str(r.tls.cert), str(r.tls.key), str(r.tls.ca)) == (
        "/c.pem", "/k.pem", "/ca.pem"
    )  # fmt: skip
    assert load(["--job", "j", "--node", "w1", "--replica-nodes", NODES]).replica.tls is None
    with pytest.raises(UsageError, match="--replica-tls-key, --replica-tls-ca"):
        load(["--job", "j", "--node", "w1", "--replica-nodes", NODES,
              "--replica-tls-cert", "/c.pem"])  # fmt: skip
    with pytest.raises(UsageError, match="replica-pull-deadline"):
        load(["--job", "j", "--node", "w1", "--replica-nodes", NODES,
              "--replica-pull-deadline", "0"])  # fmt: skip
