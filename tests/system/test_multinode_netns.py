"""Two nodes as two network namespaces: a 4-rank job under two torchrun launchers (2 ranks each),
each launcher and its node's `diag agent` inside its own namespace, the ranks talking over the
veth links (gloo on eth0) rather than loopback, the nodes sharing the timeline as a cluster shares
a volume.

- Rank 3, on node-b, hangs. The job gets one job verdict (rank 3 on node-b) from node-b's report,
  both nodes' incident directories carry the same incident id, `diag merge` makes one picture of
  all four ranks, and `diag taint --dry-run` plans a taint for node-b only.
- Rank 1 dies on node-a while node-b's ranks wait for it in a collective: one incident (node-b's
  hang is recognised as a consequence of the death), one job verdict naming rank 1 on node-a.
- Rank 3 hangs on node-b; node-a's agent (`--on-hang stop`) stops node-a's ranks, once, on
  node-b's first-hand report, without a verdict of its own.
- node-b is lost whole (its agent, launcher and ranks SIGKILLed): node-a's ranks die when their
  peers vanish, and the job verdict names node-b, whose agent went silent, not node-a; node-a's
  taint plan leaves it alone."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from children import stop_jobs_and_agents
from netlab import SUBNET, NetLab, netns_unavailable
from test_multinode import _taint_plans

from diag.viewer.merge import merge_incident

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(300)]

# The rendezvous store listens in node-a's own namespace, where nothing else runs: any port is
# free there, and no other suite on the host can take it.
PORT = 29500
NODES = ("node-a", "node-b")


def _exec_into_python(proc: subprocess.Popen[bytes]) -> None:
    """Waits until `ip netns exec` has exec'd its command. It execs, rather than forking, so then
    the PID is the Python process itself, and stopping it (or its tree) reaches the launcher or
    agent, not a wrapper that would leave them running."""
    deadline = time.monotonic() + 10
    while True:
        try:
            cmdline = psutil.Process(proc.pid).cmdline()
        except psutil.NoSuchProcess:
            return  # exited already: nothing left to stop
        if cmdline[:1] == [sys.executable] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert cmdline[:1] == [sys.executable], cmdline


@dataclass
class Cluster:
    lab: NetLab
    tmp: Path
    timeline: Path
    agents: list[subprocess.Popen[bytes]]
    jobs: list[subprocess.Popen[bytes]]

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
            for f in sorted(self.tmp.glob("*.log"))
        )

    def verdicts(self) -> dict[str, tuple[Path, dict]]:
        out = {}
        for d in self.timeline.iterdir():
            if (d / "verdict.json").exists():
                v = json.loads((d / "verdict.json").read_text())
                out[v["node"]] = (d, v)
        return out


@contextmanager
def two_nodes(
    tmp_path: Path,
    fault_rank: int,
    hang_floor: str = "3",
    agent_args: dict[str, list[str]] | None = None,
    job_args: list[str] | None = None,
    env_extra: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """Agents and launchers on two namespaces; rank `fault_rank` hangs at step 4. `agent_args`:
    a node's agent options after the common ones (the last of an option wins); `job_args`:
    the job's options instead of the fault's."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    timeline = tmp_path / "timeline"
    c = Cluster(NetLab(2), tmp_path, timeline, [], [])
    try:
        c.lab.build()  # inside try: a half-built lab is torn down too
        for node_rank, node in enumerate(NODES):
            run = tmp_path / f"run-{node}"
            env = dict(
                os.environ,
                DIAG_RUN_DIR=str(run),
                DIAG_JOB="mn",
                DIAG_NODE=node,
                OMP_NUM_THREADS="1",
                **(env_extra or {}),
            )
            log = open(tmp_path / f"agent-{node}.log", "wb")  # noqa: SIM115
            c.agents.append(subprocess.Popen(
                c.lab.exec_in(node_rank, [
                    sys.executable, "-m", "diag.cli.main", "agent", "--run-dir", str(run),
                    "--timeline", str(timeline), "--job", "mn", "--node", node, "--hang-timeout",
                    "20", "--hang-floor", hang_floor, "--warmup-timeout", "60", "--on-hang",
                    "none", "--until", "incident", "--interval", "0.25", "-v",
                    *(agent_args or {}).get(node, [])]),
                env=env, stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
            # gloo otherwise binds the address the host name resolves to (127.0.0.1 here, from
            # /etc/hosts, shared by both namespaces): the other node cannot reach it and the
            # full mesh times out. eth0 is the veth, the node's only address on the lab's subnet.
            job_env = dict(env, GLOO_SOCKET_IFNAME="eth0")
            job_log = open(tmp_path / f"torchrun-{node}.log", "wb")  # noqa: SIM115
            c.jobs.append(subprocess.Popen(
                c.lab.exec_in(node_rank, [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--node-rank", str(node_rank), "--nproc-per-node", "2", "--master-addr",
                    c.lab.addr(0), "--master-port", str(PORT), "-m", "diag.trainer.demo_job",
                    *(job_args or ["--fault", "hang", "--fault-rank", str(fault_rank),
                                   "--fault-step", "4", "--steps", "40"])]),
                env=job_env, stdout=job_log, stderr=subprocess.STDOUT,
                start_new_session=True))  # fmt: skip
        for p in (*c.agents, *c.jobs):
            _exec_into_python(p)
        yield c
    finally:
        try:
            stop_jobs_and_agents(c.jobs, c.agents)
        finally:
            c.lab.close()


def test_job_verdict_names_the_hung_rank_and_the_waiting_node_stops_its_ranks_once(
    tmp_path: Path,
) -> None:
    """Rank 3 hangs on node-b. node-b's agent names it and leaves its ranks alone (`--on-hang
    none`), so that node-a's ranks do not fail through gloo first. node-a's ranks only wait for
    it, and node-a's own hang limit is far beyond this test's wait: only node-b's first-hand
    report can stop them. node-a's agent (`--on-hang stop`, running until its ranks end) stops
    both its ranks under the job's incident, once, and files nothing: one job incident, one
    report, one job verdict naming rank 3 on node-b with both nodes' evidence."""
    args = {
        "node-a": ["--on-hang", "stop", "--until", "job-end", "--hang-floor", "250",
                   "--hang-timeout", "300"],
    }  # fmt: skip
    with two_nodes(tmp_path, fault_rank=3, agent_args=args) as c:
        timeline, agents, jobs, logs = c.timeline, c.agents, c.jobs, c.logs
        # A launcher that exits before node-b's report is filed failed to start the job (a
        # rendezvous or gloo that cannot reach the other namespace): say so now, not at the
        # timeout. After it, node-a's ranks are stopped, maybe before node-b's agent, which
        # stops at its incident, has finished writing the evidence.
        deadline = time.monotonic() + 200
        while not list(timeline.glob(".jobs/*/*/reports/*")):
            exited = [n for n, j in zip(NODES, jobs, strict=True) if j.poll() is not None]
            assert not exited, f"torchrun exited on {exited} before the incident:\n{logs()}"
            assert time.monotonic() < deadline, f"no report filed:\n{logs()}"
            time.sleep(0.25)
        while any(a.poll() is None for a in agents):
            assert time.monotonic() < deadline, f"agents still running:\n{logs()}"
            time.sleep(0.5)
        assert jobs[0].wait(timeout=60) != 0, logs()  # node-a's ranks were stopped
        verdicts = c.verdicts()
        assert set(verdicts) == set(NODES), logs()
        a, b = verdicts["node-a"][1], verdicts["node-b"][1]
        assert (b["kind"], b["culprit"]) == ("hang", 3), b["summary"]
        # node-a's own verdict names no culprit: remote culprits are the job verdict's to name.
        assert (a["kind"], a["culprit"]) == ("hang", None), a["summary"]
        assert a["incident_id"] == b["incident_id"], (a, b)
        assert "rank 3 on node node-b reported it first-hand" in a["summary"], a["summary"]
        assert "trigger: first-hand" in a["summary"], a["summary"]
        log_a = (tmp_path / "agent-node-a.log").read_text()
        # Once: one incident, each rank stopped once (their deaths that follow open none).
        assert log_a.count("incident: hang") == 1 and "incident: rank_exited" not in log_a, log_a
        for rank in (0, 1):
            assert log_a.count(f"stopping rank {rank} (pid") == 1, log_a
        assert len(list((timeline / ".jobs" / "mn").iterdir())) == 1, logs()

        # One job verdict for the incident: rank 3 on node-b, with both nodes' evidence.
        job_verdicts = list((timeline / ".jobs").glob("*/*/job-verdict.json"))
        assert len(job_verdicts) == 1, logs()
        jv = json.loads(job_verdicts[0].read_text())
        assert (jv["culprit"], jv["culprit_node"]) == (3, "node-b"), jv
        # Only node-b filed (first-hand); node-a, which only waited for it, wrote nothing for
        # the job verdict. Every node's directory is still found, by its name.
        assert (jv["nodes"], jv["reports"]) == (["node-b"], 1), jv
        assert jv["evidence"] == [str(verdicts["node-b"][0])]
        dirs = sorted(glob.glob(jv["evidence_glob"]))
        assert dirs == sorted(str(d) for d, _ in verdicts.values()), jv["evidence_glob"]
        reports = list((timeline / ".jobs").glob("*/*/reports/*"))
        assert [p.name.split("~")[0] for p in reports] == ["r3.L.node-b"], reports

        merged = merge_incident(timeline)
        assert len(merged.sources) == 2 and merged.world_size == 4
        assert merged.suspects[0].rank == 3

        # The picture as a user makes it: `diag merge` on the timeline root merges the newest
        # incident, both nodes' directories of it, into one merged-<id> directory.
        r = subprocess.run(
            [sys.executable, "-m", "diag.cli.main", "merge", "--path", str(timeline)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out_dir = Path(r.stdout.split("wrote into ", 1)[1].split(":\n", 1)[0])
        assert out_dir == merged.out_dir and out_dir.parent == timeline, r.stdout
        assert [p.name for p in timeline.glob("merged-*")] == [out_dir.name]
        svg = out_dir / "py_stack.svg"
        assert svg.is_file() and svg.stat().st_size > 0, r.stdout

        # One taint plan, for the job verdict's culprit node only (threshold 1: this single
        # incident is enough), against the in-memory API.
        plans = _taint_plans(tmp_path, timeline, jv["culprit_node"])
        assert "+ taint" in plans[jv["culprit_node"]] and "dry run" in plans[jv["culprit_node"]]
        assert "+ taint" not in plans["node-a"], plans


def _rank_pid(launcher: subprocess.Popen[bytes], rank: int) -> int:
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "diag.trainer.demo_job" in p.cmdline():
                return p.pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of rank {rank} under the launcher {launcher.pid}")


def test_a_death_and_the_hang_it_causes_elsewhere_make_one_incident(tmp_path: Path) -> None:
    """Rank 1 dies on node-a while node-b's ranks wait for it in a collective. With gloo the
    peers of a dead rank see its sockets close and fail at once; NCCL ranks hang instead. To
    get the hang, node-a's cable is cut first (as when a node loses its network), then rank 1
    is killed: node-a's agent sees a death (`rank_exited`), node-b's a hang seconds later. They
    are one fault: one incident id on both nodes, one job verdict (rank 1 on node-a)."""
    # A floor well above the time between rank 1's stall and its death: node-a's agent must see
    # the death, not a hang, and node-b's hang comes seconds after the death is filed.
    with two_nodes(tmp_path, fault_rank=1, hang_floor="6") as c:
        deadline = time.monotonic() + 150
        log_a = tmp_path / "torchrun-node-a.log"
        while b"diag-demo: injecting hang" not in log_a.read_bytes():
            assert all(j.poll() is None for j in c.jobs), c.logs()
            assert time.monotonic() < deadline, c.logs()
            time.sleep(0.1)
        c.lab.link_down(0)
        os.kill(_rank_pid(c.jobs[0], 1), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while any(a.poll() is None for a in c.agents):
            assert time.monotonic() < deadline, f"agents still running:\n{c.logs()}"
            time.sleep(0.5)
        verdicts = c.verdicts()
        assert set(verdicts) == set(NODES), c.logs()
        (a_dir, a), (b_dir, b) = verdicts["node-a"], verdicts["node-b"]
        assert (a["kind"], a["culprit"]) == ("rank_exited", 1), a["summary"]
        # node-b saw a hang of its own ranks, waiting for ranks on node-a; it is the death's.
        assert (b["kind"], b["culprit"]) == ("hang", None), b["summary"]
        assert a["incident_id"] == b["incident_id"] == "mn-a0-rank_exited", (a, b)
        assert "part of job incident a0-rank_exited: rank 1 on node node-a" in b["summary"]

        job_verdicts = list((c.timeline / ".jobs").glob("*/*/job-verdict.json"))
        assert len(job_verdicts) == 1, c.logs()
        jv = json.loads(job_verdicts[0].read_text())
        assert (jv["culprit"], jv["culprit_node"], jv["reports"]) == (1, "node-a", 1), jv
        assert sorted(glob.glob(jv["evidence_glob"])) == sorted([str(a_dir), str(b_dir)])
        merged = merge_incident(c.timeline)
        assert sorted(merged.sources) == sorted([a_dir, b_dir])
        assert merged.world_size == 4


REPLICA_PORT = 7070  # each agent listens in its own namespace: any port is free there


def test_a_node_lost_whole_is_the_culprit_and_the_survivor_is_not_tainted(tmp_path: Path) -> None:
    """node-b goes away whole. node-a's ranks die a moment later (gloo: their peers' sockets
    closed), so node-a's agent sees a death of its own rank first-hand and claims the job's
    incident (or, where gloo missed the close, they wait for node-b's ranks and node-a files
    its view); node-b's agent files nothing. Before concluding, node-a's agent asks its replica
    neighbour's agent whether it answers: node-b is silent for --replica-lost-after seconds, so
    the job verdict names node-b (its ranks 2-3, the replica node-a holds says so), node-a's
    death is its victim, and `diag taint` plans a taint for node-b only."""
    lab_addrs = [f"{SUBNET}.{i + 1}" for i in range(2)]  # NetLab's own, checked below
    spec = ",".join(f"{n}={a}:{REPLICA_PORT}" for n, a in zip(NODES, lab_addrs, strict=True))
    save = tmp_path / "save"
    common = ["--replica-nodes", spec, "--replica-lost-after", "2", "--save-dir", str(save),
              "--native-stacks", "false"]  # fmt: skip
    args = {n: [*common, "--replica-dir", str(tmp_path / f"run-{n}" / ".replicas")] for n in NODES}
    # node-a's own taint step, as an agent runs it (a dry run: no API server here).
    args["node-a"] += ["--taint-mode", "dry-run", "--taint-culprit-threshold", "1",
                       "--taint-gpu-watch", "false"]  # fmt: skip
    job = ["--fault", "none", "--steps", "100000", "--flash-every", "1", "--save-dir", str(save)]
    with two_nodes(tmp_path, fault_rank=0, agent_args=args, job_args=job,
                   env_extra={"DIAG_REPLICA_TOKEN": "job-secret-replica-token"}) as c:  # fmt: skip
        assert [c.lab.addr(i) for i in range(2)] == lab_addrs
        # node-a holds node-b's replica: it knows node-b's ranks, and node-b's agent answered.
        replicas = tmp_path / "run-node-a" / ".replicas"
        deadline = time.monotonic() + 200
        while not list(replicas.glob("node-b-*/replica.json")):
            assert all(j.poll() is None for j in c.jobs), c.logs()
            assert time.monotonic() < deadline, f"no replica of node-b on node-a:\n{c.logs()}"
            time.sleep(0.25)
        _lose_whole(c, 1)
        # The verdict is in place within --replica-lost-after of node-a's claim; its agent then
        # waits out the settle time for late reports, which this test does not need.
        deadline = time.monotonic() + 120
        while not (job_verdicts := list((c.timeline / ".jobs").glob("*/*/job-verdict.json"))):
            assert time.monotonic() < deadline, f"no job verdict:\n{c.logs()}"
            time.sleep(0.25)
        a_dir, a = c.verdicts()["node-a"]
        # node-a's own verdict: its rank died (it cannot know why, yet), or, where gloo did not
        # see the sockets close, its ranks wait for ranks on another node.
        died = a["kind"] == "rank_exited"
        assert (a["kind"], a["culprit"]) in (("rank_exited", 0), ("rank_exited", 1),
                                             ("hang", None)), a["summary"]  # fmt: skip
        assert len(job_verdicts) == 1, c.logs()
        jv = json.loads(job_verdicts[0].read_text())
        assert (jv["culprit_node"], jv["lost_nodes"]) == ("node-b", ["node-b"]), jv
        assert jv["culprit"] in (2, 3), jv
        assert "node node-b went silent" in jv["basis"], jv["basis"]
        if died:
            victim = f"rank {a['culprit']} on node-a died after it (victims"
            assert victim in jv["basis"] and jv["evidence"] == [str(a_dir)], jv
        else:
            assert "the ranks of node-a waited for it" in jv["basis"], jv
        log_a = tmp_path / "agent-node-a.log"
        assert "node node-b went silent" in log_a.read_text(), c.logs()
        # node-a's agent counts its rank's death against node-b, not against its own node.
        spared = (
            "this incident counts against node-b, not this node"
            if died
            else "names rank {} on node node-b, not this node".format(jv["culprit"])
        )
        while spared not in log_a.read_text():
            assert time.monotonic() < deadline, f"node-a's taint step:\n{c.logs()}"
            time.sleep(0.25)

        plans = _taint_plans(tmp_path, c.timeline, "node-b")
        assert "+ taint" in plans["node-b"], plans
        assert "+ taint" not in plans["node-a"], plans


def _lose_whole(c: Cluster, index: int) -> None:
    """Node `index` is gone: its agent, launcher and ranks SIGKILLed at once."""
    procs = []
    for p in (c.jobs[index], c.agents[index]):
        with suppress(psutil.NoSuchProcess):
            root = psutil.Process(p.pid)
            procs += [root, *root.children(recursive=True)]
    for p in procs:
        with suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=30)
