"""One node's precheck run: join, local checks, the pair rounds it is given, then the verdict.

Node 0 also hosts the rendezvous store (a torch TCPStore on MASTER_ADDR:MASTER_PORT) and runs
the coordinator in a thread. Each pair gets its own two-member process group over a store
prefix, so a dead or unreachable node can only fail the pairs it is in, each within its own
timeouts. When the store itself cannot be reached, the node still reports what it knows about
itself (its NIC) and exits with "could not run" (or "faulty" when its own link is down).
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

from diag.agent.precheck import keys, nic
from diag.agent.precheck.config import LocalCheck, PrecheckConfig
from diag.agent.precheck.coordinator import Coordinator
from diag.agent.precheck.devicehealth import NvmlWatch
from diag.agent.precheck.evidence import LocalEvidence, NicState
from diag.agent.precheck.liveness import round_limit_s
from diag.agent.precheck.report import PrecheckReport, error_report

log = logging.getLogger(__name__)

POLL_S = 0.05


class LostRendezvous(Exception):
    """The store stopped answering, or the coordinator gave up: no global verdict is coming."""


class NodeSession:
    def __init__(self, cfg: PrecheckConfig) -> None:
        self.cfg = cfg
        self.rank = cfg.rdzv.node_rank
        self.started_at = time.time()
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.nic_state: NicState | None = None
        self.accelerator = "cpu"

    def _wall(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> PrecheckReport:
        rd = self.cfg.rdzv
        self.nic_state = nic.probe(rd.master_addr, rd.master_port, rd.iface)
        try:
            store = self._open_store()
        except Exception as e:
            return self._error(
                f"could not reach the rendezvous at {rd.master_addr}:{rd.master_port} within "
                f"{self.cfg.timeouts.rdzv_s:g} s: {_short(e)}"
            )
        coordinator = None
        if self.rank == 0:
            coordinator = Coordinator(store.clone(), self.cfg, self.started_at)
            coordinator.start()
        try:
            return self._run_joined(store)
        except LostRendezvous as e:
            return self._error(str(e))
        except Exception as e:  # RuntimeError / DistStoreError from a store that went away
            return self._error(
                f"lost contact with the rendezvous host (node 0, {rd.master_addr}:"
                f"{rd.master_port}): {_short(e)}"
            )
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
        if self.nic_state is not None and self.nic_state.addr:
            return self.nic_state.addr
        return None

    def _run_joined(self, store: Any) -> PrecheckReport:
        rd, t, m = self.cfg.rdzv, self.cfg.timeouts, self.cfg.measure
        me = {"host": socket.gethostname(), "addr": self._addr() or "", "pid": os.getpid()}
        mine = json.dumps(me)
        current = store.compare_set(keys.join(self.rank), "", mine)
        if current.decode() != mine:
            other = json.loads(current)
            raise LostRendezvous(
                f"node rank {self.rank} already joined from {other.get('host')} "
                f"({other.get('addr')}): check NODE_RANK on each node"
            )
        log.info(
            "node %d joined the rendezvous at %s:%d", self.rank, rd.master_addr, rd.master_port
        )
        # From now on every store call is short; a store that stops answering (its host died
        # or was cut off) must fail fast instead of being retried for the whole rdzv timeout.
        store.set_timeout(timedelta(seconds=t.lost_after_s))
        beat = threading.Thread(target=self._heartbeat, args=(store.clone(),), daemon=True)
        beat.start()

        plan0 = self._wait_plan(store, 0, t.rdzv_s + 10.0)
        if self.rank not in plan0["nodes"]:
            raise LostRendezvous("joined after the rendezvous had closed")
        local = self._local_checks()
        store.set(keys.local(self.rank), json.dumps(local.to_dict()))
        log.info("node %d: local checks done", self.rank)

        from diag.agent.precheck.measure import PairPlan, pair_allreduce

        limit = round_limit_s(t.connect_s, t.collective_s, m.pair_seconds, m.warmup_iters)
        pair_store = store.clone()
        pair_store.set_timeout(timedelta(seconds=t.connect_s))
        r = 1
        wait_s = t.local_s + t.lost_after_s + 10.0
        while True:
            plan = self._wait_plan(store, r, wait_s)
            wait_s = limit + t.lost_after_s + 10.0
            if plan.get("done"):
                break
            for a, b in plan["pairs"]:
                if self.rank in (a, b):
                    peer = b if self.rank == a else a
                    log.info("round %d: testing the link with node %d", r, peer)
                    side = pair_allreduce(
                        pair_store,
                        PairPlan(
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
                        ),
                        self.accelerator,
                        self._addr(),
                        m.net_device,
                    )
                    store.set(keys.pair(r, self.rank), json.dumps(side.to_dict()))
            r += 1
        raw = self._wait_key(store, keys.REPORT, ACK_GRACE_S)
        store.add(keys.ACKS, 1)
        report = PrecheckReport.from_dict(json.loads(raw))
        return report.with_reporter(self.rank, self._wall())

    def _wait_plan(self, store: Any, r: int, timeout_s: float) -> dict[str, Any]:
        return json.loads(self._wait_key(store, keys.plan(r), timeout_s))

    def _wait_key(self, store: Any, key: str, timeout_s: float) -> bytes:
        """Poll for `key`, giving up when the coordinator reports a failure or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if store.check([key]):
                return bytes(store.get(key))
            if store.check([keys.FAILURE]):
                raise LostRendezvous(json.loads(store.get(keys.FAILURE))["error"])
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

    def _local_checks(self) -> LocalEvidence:
        """Device health, compute and intra-node copies, bounded by the local timeout."""
        result: list[LocalEvidence] = []
        worker = threading.Thread(
            target=lambda: result.append(self._measure_local()), daemon=True, name="local-checks"
        )
        worker.start()
        worker.join(self.cfg.timeouts.local_s)
        if result:
            return result[0]
        return LocalEvidence(
            node=self.rank,
            host=socket.gethostname(),
            nic=self.nic_state,
            error=f"did not finish within {self.cfg.timeouts.local_s:g} s",
        )

    def _measure_local(self) -> LocalEvidence:
        from diag.agent.precheck import measure

        m = self.cfg.measure
        notes: list[str] = []
        watch = NvmlWatch()
        if LocalCheck.DEVICE in m.checks:
            watch.start()
            if watch.note:
                notes.append(watch.note)
        try:
            self.accelerator, count = measure.detect_accelerator(m.device)
        except Exception as e:
            return LocalEvidence(node=self.rank, host=socket.gethostname(), error=_short(e))
        compute = []
        if LocalCheck.COMPUTE in m.checks:
            devices = [f"cuda:{i}" for i in range(count)] if self.accelerator == "cuda" else ["cpu"]
            size = m.matmul_for(self.accelerator)
            compute = [
                measure.matmul_throughput(d, size, m.compute_seconds, m.compute_threads)
                for d in devices
            ]
        copies = []
        if LocalCheck.INTRA in m.checks:
            if self.accelerator != "cuda":
                notes.append("no GPU: intra-node device copies skipped")
            elif count < 2:
                notes.append("one GPU: intra-node device copies skipped")
            else:
                copies = [
                    measure.copy_bandwidth(a, b, m.copy_bytes)
                    for a, b in m.device_pairs.resolve(count)
                ]
        return LocalEvidence(
            node=self.rank,
            host=socket.gethostname(),
            accelerator=self.accelerator,
            devices=watch.finish(),
            compute=tuple(compute),
            copies=tuple(copies),
            nic=self.nic_state,
            notes=tuple(notes),
        )

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


ACK_GRACE_S = 30.0


def _short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]
