"""One node's precheck run: join, local checks, the pair rounds it is given, then the verdict.

Node 0 also hosts the rendezvous store (a torch TCPStore on MASTER_ADDR:MASTER_PORT) and runs
the coordinator in a thread. Each pair gets its own two-member process group over a store
prefix, so a dead or unreachable node can only fail the pairs it is in, each within its own
timeouts. When the store cannot be reached, the node still reports what it knows about itself
(its NIC) and exits with "could not run", or "faulty" when its own link is down.

The run itself happens on a worker thread under a watchdog: each phase announces how long it
may take, and a phase stuck in native code past that (a collective on a vanished network) ends
the run with an error report instead of a hang.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from diag.agent.node import nic
from diag.agent.node.linkstate import NicState
from diag.agent.precheck import keys
from diag.agent.precheck.coordinator import Coordinator
from diag.agent.precheck.liveness import round_limit_s
from diag.agent.precheck.localchecks import run_local_checks
from diag.agent.precheck.measurements import MAX_NODES, LocalEvidence
from diag.agent.precheck.precheckconfig import PrecheckSettings
from diag.agent.precheck.report import PrecheckReport, error_report
from diag.agent.precheck.storeclient import BoundedStore, LostRendezvous
from diag.formats.checkedjson import TEXT, Fields
from diag.formats.untrusted import UntrustedInput, parse_json

log = logging.getLogger(__name__)

POLL_S = 0.05
IMPORT_SLACK_S = 60.0  # on top of --rdzv-timeout: importing torch on a busy node


class NodeSession:
    def __init__(self, cfg: PrecheckSettings) -> None:
        self.cfg = cfg
        self.rank = cfg.rdzv.node_rank
        self.started_at = time.time()
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.nic_state: NicState | None = None
        self.accelerator = "cpu"
        self.stuck = False  # the watchdog fired: a thread may still be blocked in native code
        self._phase = "starting"
        self._deadline = time.monotonic() + cfg.timeouts.rdzv_s + IMPORT_SLACK_S

    def _wall(self) -> float:
        return time.monotonic() - self.t0

    def _enter(self, phase: str, limit_s: float) -> None:
        self._phase = phase
        self._deadline = time.monotonic() + limit_s

    def run(self) -> PrecheckReport:
        result: list[PrecheckReport] = []
        failure: list[BaseException] = []

        def work() -> None:
            try:
                result.append(self._run())
            except BaseException as e:  # handed to the caller's thread below
                failure.append(e)

        worker = threading.Thread(target=work, name="precheck", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            if worker.is_alive() and time.monotonic() > self._deadline:
                self.stuck = True
                self.stop.set()
                return self._error(f"stuck in {self._phase} past its time limit")
        if failure:
            raise failure[0]
        return result[0]

    def _run(self) -> PrecheckReport:
        rd = self.cfg.rdzv
        where = f"node 0 ({rd.master_addr}:{rd.master_port})"
        self.nic_state = nic.probe(rd.master_addr, rd.master_port, rd.iface)
        self._enter("joining the rendezvous", self.cfg.timeouts.rdzv_s + IMPORT_SLACK_S)
        try:
            raw = self._open_store()
        except Exception as e:
            return self._error(
                f"could not reach the rendezvous at {rd.master_addr}:{rd.master_port} within "
                f"{self.cfg.timeouts.rdzv_s:g} s: {_short(e)}"
            )
        coordinator = None
        if self.rank == 0:
            coordinator = Coordinator(raw.clone(), self.cfg, self.started_at)
            coordinator.start()
        try:
            # From here on every store call is short; one that does not come back in time
            # means the store's host died or was cut off.
            store = BoundedStore(raw, self.cfg.timeouts.lost_after_s, where)
            return self._run_joined(raw, store)
        except LostRendezvous as e:
            return self._error(str(e))
        finally:
            self.stop.set()
            if coordinator is not None:
                coordinator.join(timeout=10.0)

    def _open_store(self) -> Any:
        from torch.distributed import TCPStore

        rd = self.cfg.rdzv
        return TCPStore(
            rd.master_addr,
            rd.master_port,
            None,
            self.rank == 0,
            timedelta(seconds=self.cfg.timeouts.rdzv_s),
            wait_for_workers=False,
        )

    def _addr(self) -> str | None:
        return self.nic_state.addr if self.nic_state is not None else None

    def _run_joined(self, raw: Any, store: BoundedStore) -> PrecheckReport:
        rd, t, m = self.cfg.rdzv, self.cfg.timeouts, self.cfg.measure
        me = {"host": socket.gethostname(), "addr": self._addr() or "", "pid": os.getpid()}
        mine = json.dumps(me)
        current = store.compare_set(keys.join(self.rank), "", mine)
        if current != mine.encode():
            try:
                other = Fields(parse_json("join", current), "join")
                who = f"{other.str('host', '?')} ({other.str('addr', '?')})"
            except UntrustedInput:
                who = "another node"
            raise LostRendezvous(
                f"node rank {self.rank} already joined from {who}: check NODE_RANK on each node"
            )
        log.info(
            "node %d joined the rendezvous at %s:%d", self.rank, rd.master_addr, rd.master_port
        )
        raw.set_timeout(timedelta(seconds=t.lost_after_s))  # clones made from now on inherit it
        beat_store = raw.clone()
        threading.Thread(target=self._heartbeat, args=(beat_store,), daemon=True).start()

        plan0 = self._wait_plan(store, 0, t.rdzv_s + 10.0)
        if self.rank not in plan0["nodes"]:
            raise LostRendezvous("joined after the rendezvous had closed")
        self._enter("the local checks", t.local_s + 10.0)
        local, self.accelerator = run_local_checks(self.rank, m, self.nic_state, t.local_s)
        store.set(keys.local(self.rank), json.dumps(local.to_dict()))
        log.info("node %d: local checks done", self.rank)

        from diag.agent.precheck.measure import PairPlan, bounded_pair_allreduce, pair_limit_s

        r = 1
        wait_s = t.local_s + t.lost_after_s + 10.0
        while True:
            plan = self._wait_plan(store, r, wait_s)
            wait_s = (
                round_limit_s(
                    t.connect_s, t.collective_s, m.pair_seconds, m.warmup_iters, t.lost_after_s
                )
                + t.lost_after_s
                + 10.0
            )
            if plan.get("done"):
                break
            for a, b in plan["pairs"]:
                if self.rank not in (a, b):
                    continue
                peer = b if self.rank == a else a
                pair_plan = PairPlan(
                    round=r,
                    node=self.rank,
                    peer=peer,
                    rank_in_pair=0 if self.rank < peer else 1,
                    msg_bytes=m.msg_bytes_for(self.accelerator),
                    pair_seconds=m.pair_seconds,
                    warmup_iters=m.warmup_iters,
                    max_iters=m.max_iters,
                    connect_timeout_s=t.connect_s,
                    collective_timeout_s=t.collective_s,
                )
                log.info("round %d: testing the link with node %d", r, peer)
                self._enter(f"pair round {r} with node {peer}", pair_limit_s(pair_plan) + 10.0)
                # A connection of its own per pair: an abandoned test may still be using its one.
                pair_store = raw.clone()
                pair_store.set_timeout(timedelta(seconds=t.connect_s))
                side, abandoned = bounded_pair_allreduce(
                    pair_store, pair_plan, self.accelerator, self._addr(), m.net_device
                )
                self.stuck = self.stuck or abandoned
                store.set(keys.pair(r, self.rank), json.dumps(side.to_dict()))
            r += 1
        # The verdict follows the last plan at once; allow a few silent heartbeats' worth.
        raw_report = self._wait_key(store, keys.REPORT, 3 * t.lost_after_s)
        store.add(keys.ACKS, 1)
        try:
            report = PrecheckReport.from_dict(parse_json(keys.REPORT, raw_report), keys.REPORT)
        except UntrustedInput as e:
            raise LostRendezvous(f"the coordinator's report is unreadable: {e}") from None
        return report.with_reporter(self.rank, self._wall())

    def _wait_plan(self, store: BoundedStore, r: int, timeout_s: float) -> dict[str, Any]:
        key = keys.plan(r)
        try:
            return _plan(parse_json(key, self._wait_key(store, key, timeout_s)), key)
        except UntrustedInput as e:
            raise LostRendezvous(f"the coordinator's plan is unreadable: {e}") from None

    def _wait_key(self, store: BoundedStore, key: str, timeout_s: float) -> bytes:
        """Poll for `key`, giving up when the coordinator reports a failure or time runs out."""
        self._enter(f"waiting for {key}", timeout_s + 2 * store.timeout_s + 5.0)
        deadline = time.monotonic() + timeout_s
        while True:
            if store.check(key):
                return store.get(key)
            if store.check(keys.FAILURE):
                raise LostRendezvous(_failure(store.get(keys.FAILURE)))
            if time.monotonic() > deadline:
                raise LostRendezvous(
                    f"no word from the coordinator (node 0) for {timeout_s:g} s while waiting "
                    f"for {key}"
                )
            time.sleep(POLL_S)

    def _heartbeat(self, store: Any) -> None:
        key = keys.beat(self.rank)
        while not self.stop.is_set():
            try:
                store.add(key, 1)
            except Exception as e:
                log.debug("heartbeat stopped: %s", e)
                return
            self.stop.wait(self.cfg.timeouts.heartbeat_s)

    def _error(self, error: str) -> PrecheckReport:
        log.error("node %d: %s", self.rank, error)
        rd = self.cfg.rdzv
        state = nic.probe(rd.master_addr, rd.master_port, rd.iface)
        return error_report(
            job=self.cfg.job,
            nnodes=rd.nnodes,
            node=self.rank,
            error=error,
            local=LocalEvidence(node=self.rank, host=socket.gethostname(), nic=state),
            started_at=self.started_at,
            wall_seconds=self._wall(),
            settings=self.cfg.settings(),
            th=self.cfg.thresholds,
        )


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]


def _plan(doc: Any, key: str) -> dict[str, Any]:
    """A plan as the coordinator posts it: {"nodes": [...]}, {"pairs": [[a, b], ...]} or
    {"done": true}, node ranks bounded."""
    f = Fields(doc, key)
    out: dict[str, Any] = {
        "done": f.bool("done", False),
        "nodes": f.ints("nodes", 0, MAX_NODES, MAX_NODES),
    }
    pairs = []
    for i, p in enumerate(f.list("pairs", MAX_NODES)):
        if not (isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)):
            raise f.fail(f"pairs[{i}]", "is not a pair of node ranks")
        pairs.append((p[0], p[1]))
    out["pairs"] = pairs
    return out


def _failure(raw: bytes) -> str:
    try:
        return Fields(parse_json(keys.FAILURE, raw), keys.FAILURE).str("error", max_len=TEXT)
    except UntrustedInput as e:
        return f"the coordinator failed ({e})"
