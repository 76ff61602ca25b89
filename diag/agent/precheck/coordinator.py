"""The coordinator: runs inside node 0's precheck process, next to that node's own checks.

It owns the sequence (join, local checks, pair rounds, verdict) and talks to the nodes only
through the rendezvous store: it publishes `plan/<round>` and collects what nodes post. Every
wait has a deadline, and a node whose heartbeat stops is dropped instead of waited for, so one
dead node never holds up the others. Decisions are made by the pure `rounds` and `classify`.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from diag.agent.precheck import keys
from diag.agent.precheck.classify import Observations, classify
from diag.agent.precheck.liveness import BeatTracker, PhaseDeadline, round_limit_s
from diag.agent.precheck.measurements import LocalEvidence, PairResult, PairSide, merge_sides
from diag.agent.precheck.precheckconfig import LocalCheck, PrecheckSettings
from diag.agent.precheck.report import PrecheckReport, build_report
from diag.agent.precheck.rounds import plan_round
from diag.formats.checkedjson import Fields
from diag.formats.untrusted import MIB, UntrustedInput, parse_json

log = logging.getLogger(__name__)

POLL_S = 0.1
MAX_VALUE_BYTES = 16 * MIB  # what a node posts: its local evidence is about 12 KiB


class Coordinator:
    def __init__(
        self,
        store: Any,
        cfg: PrecheckSettings,
        started_at: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.clock = clock
        self.started_at = started_at
        self.t0 = clock()
        self.beats = BeatTracker(cfg.timeouts.lost_after_s)
        self.joined: dict[int, dict[str, Any]] = {}
        self.lost: dict[int, str] = {}
        self.report: PrecheckReport | None = None
        self.thread: threading.Thread | None = None

    # -- store plumbing -------------------------------------------------------------------
    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _get_json(self, key: str) -> Any:
        raw = self.store.get(key)
        if len(raw) > MAX_VALUE_BYTES:
            raise UntrustedInput(f"store key {key}", f"is {len(raw)} bytes, over the limit")
        return parse_json(f"store key {key}", raw)

    def _publish(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def _watch_beats(self, nodes: Iterable[int]) -> None:
        now = self.clock()
        for n in nodes:
            self.beats.observe(n, int(self.store.add(keys.beat(n), 0)), now)

    # -- phases ---------------------------------------------------------------------------
    def _await_joins(self) -> None:
        n = self.cfg.rdzv.nnodes
        deadline = self.clock() + self.cfg.timeouts.rdzv_s
        while len(self.joined) < n and self.clock() < deadline:
            for node in range(n):
                if node not in self.joined and self._has(keys.join(node)):
                    try:
                        self.joined[node] = _join(self._get_json(keys.join(node)), node)
                    except UntrustedInput as e:
                        self.lost[node] = f"sent an unreadable join: {e}"
                        self.joined[node] = {}
                        log.warning("node %d: %s", node, self.lost[node])
                        continue
                    log.info("node %d joined from %s", node, self.joined[node].get("addr"))
            self._watch_beats(self.joined)
            if len(self.joined) < n:
                time.sleep(POLL_S)

    def _alive(self) -> list[int]:
        return sorted(n for n in self.joined if n not in self.lost)

    def _collect(
        self,
        phase: PhaseDeadline,
        expected: dict[int, str],
        parse: Callable[[Any, str, int], Any] = lambda d, source, node: d,
    ) -> dict[int, Any]:
        """Wait for `expected` (node -> key) until all arrive, their node goes silent, or the
        phase deadline passes. Nodes that miss it, or send what `parse` refuses, are marked
        lost, with the reason."""
        got: dict[int, Any] = {}
        deadline = self.clock() + phase.limit_s
        while True:
            for node, key in expected.items():
                if node not in got and node not in self.lost and self._has(key):
                    try:
                        got[node] = parse(self._get_json(key), f"store key {key}", node)
                    except UntrustedInput as e:
                        self.lost[node] = f"sent an unreadable result: {e}"
                        log.warning("node %d: %s", node, self.lost[node])
            self._watch_beats(self._alive())
            for node in self.beats.stale(self.clock()):
                if node in expected and node not in got and node not in self.lost:
                    self.lost[node] = phase.lost_reason(self.cfg.timeouts.lost_after_s)
                    log.warning("node %d lost: %s", node, self.lost[node])
            waiting = [n for n in expected if n not in got and n not in self.lost]
            if not waiting:
                return got
            if self.clock() > deadline:
                for node in waiting:
                    self.lost[node] = phase.missing_reason()
                    log.warning("node %d: %s", node, self.lost[node])
                return got
            time.sleep(POLL_S)

    def run(self) -> PrecheckReport:
        cfg = self.cfg
        t = cfg.timeouts
        self._await_joins()
        self._publish(keys.plan(0), {"nodes": sorted(self.joined)})
        local_raw = self._collect(
            PhaseDeadline("the local checks", t.local_s + 5.0),
            {n: keys.local(n) for n in self._alive()},
            _local,
        )
        local = dict(local_raw)
        history: list[PairResult] = []
        rounds: list[list[tuple[int, int]]] = []
        m = cfg.measure
        limit = round_limit_s(
            t.connect_s, t.collective_s, m.pair_seconds, m.warmup_iters, t.lost_after_s
        )
        r = 1
        while LocalCheck.INTER in m.checks:
            pairs = plan_round(self._alive(), history, r, cfg.thresholds, cfg.max_rounds)
            if not pairs:
                break
            log.info("round %d: %s", r, " ".join(f"{a}-{b}" for a, b in pairs))
            self._publish(keys.plan(r), {"pairs": pairs})
            expected = {n: keys.pair(r, n) for p in pairs for n in p}
            sides_raw = self._collect(
                PhaseDeadline(f"pair round {r}", limit), expected, functools.partial(_side, r)
            )
            sides = list(sides_raw.values())
            history.extend(merge_sides(r, a, b, sides) for a, b in pairs)
            rounds.append(pairs)
            r += 1
        self._publish(keys.plan(r), {"done": True})
        obs = Observations(
            nnodes=cfg.rdzv.nnodes,
            joined=frozenset(self.joined),
            lost=dict(self.lost),
            local=local,
            pairs=tuple(history),
            rdzv_timeout_s=t.rdzv_s,
            coordinator=0,
        )
        report = build_report(
            job=cfg.job,
            obs=obs,
            assessment=classify(obs, cfg.thresholds),
            th=cfg.thresholds,
            rounds=rounds,
            addrs={n: str(j.get("addr", "")) for n, j in self.joined.items()},
            reported_by=0,
            started_at=self.started_at,
            wall_seconds=self.clock() - self.t0,
            settings=cfg.settings(),
        )
        self._publish(keys.REPORT, report.to_dict())
        self._await_acks(len(self._alive()))
        self.report = report
        return report

    def _await_acks(self, expected: int) -> None:
        """Keep the store (and so this process) up until every live node has read the verdict."""
        deadline = self.clock() + self.cfg.timeouts.lost_after_s
        while self.clock() < deadline and int(self.store.add(keys.ACKS, 0)) < expected:
            time.sleep(POLL_S)

    # -- threading ------------------------------------------------------------------------
    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="precheck-coordinator", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.run()
        except Exception as e:
            log.exception("precheck coordinator failed")
            try:
                self._publish(keys.FAILURE, {"error": f"coordinator failed: {e}"})
            except Exception:
                log.debug("could not publish the coordinator failure")

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


def _join(doc: Any, node: int) -> dict[str, Any]:
    f = Fields(doc, f"node {node}'s join")
    return {"host": f.str("host", ""), "addr": f.str("addr", ""), "pid": f.int("pid", 0, 2**31, 0)}


def _local(doc: Any, source: str, node: int) -> LocalEvidence:
    local = LocalEvidence.from_dict(doc, source)
    if local.node != node:
        raise UntrustedInput(source, f"is node {local.node}'s evidence, not node {node}'s")
    return local


def _side(round_: int, doc: Any, source: str, node: int) -> PairSide:
    side = PairSide.from_dict(doc, source)
    if (side.round, side.node) != (round_, node):
        raise UntrustedInput(source, f"is round {side.round} of node {side.node}")
    return side
