"""From everything measured to a verdict per node: healthy, suspect, straggler or faulty.

Rules, in order:
- Presence: a node that never joined, or was lost mid-run (no heartbeat, no result), is faulty.
- Own evidence: its NIC has no carrier, a GPU reports ECC/XID/remap errors, too much memory in
  use, or a query fails: faulty. A GPU over the temperature limit, a device whose matmul
  throughput is below `compute_ratio` x the median of all devices, or an intra-node copy below
  `copy_ratio` x the median (or the floor): straggler.
- Network: a node is blamed for a failed or slow link only when it was bad with enough
  different partners (two; one with 2 nodes) that themselves passed with someone else. Failed
  links then make it faulty, slow ones a straggler. A bad link whose partner was already
  flagged by its own evidence is explained by that partner. A failed link between two nodes
  that both passed elsewhere makes both suspects. Anything else bad is left as suspect, never
  blamed on a guess: with only 2 nodes, the side of a slow or broken link cannot be told.
- If no other node could be reached at all (3 or more nodes), the run is an error: the fault is
  most likely on the coordinating node's side, and no one else is blamed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from diag.agent.node.units import fmt_flops, fmt_rate
from diag.agent.precheck.grading import Grade, Grading, Thresholds, grade_pairs, median
from diag.agent.precheck.measurements import (
    Check,
    Finding,
    LocalEvidence,
    PairResult,
    Severity,
    worst,
)
from diag.agent.precheck.rounds import required_partners


@dataclass(frozen=True)
class Observations:
    nnodes: int
    joined: frozenset[int]
    lost: Mapping[int, str] = field(default_factory=dict)  # node -> why it is considered gone
    local: Mapping[int, LocalEvidence] = field(default_factory=dict)
    pairs: tuple[PairResult, ...] = ()
    rdzv_timeout_s: float = 0.0
    coordinator: int = 0


@dataclass(frozen=True)
class NodeVerdict:
    node: int
    status: Severity
    findings: tuple[Finding, ...]
    busbw: float | None = None  # best inter-node busbw with any partner
    compute_flops: float | None = None  # the slowest device's matmul throughput
    copy_bw: float | None = None  # the slowest intra-node copy
    notes: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        bad = [f.message for f in self.findings if f.severity is not Severity.HEALTHY]
        return "; ".join(bad)


@dataclass(frozen=True)
class Assessment:
    verdicts: tuple[NodeVerdict, ...]
    median_busbw: float | None
    median_compute: float | None
    median_copy: float | None
    error: str | None = None  # the check could not run to a conclusion

    def nodes_with(self, status: Severity) -> list[int]:
        return [v.node for v in self.verdicts if v.status is status]


def classify(obs: Observations, th: Thresholds) -> Assessment:
    findings: dict[int, list[Finding]] = {n: [] for n in range(obs.nnodes)}
    notes: dict[int, list[str]] = {n: [] for n in range(obs.nnodes)}
    for n in range(obs.nnodes):
        if n not in obs.joined:
            findings[n].append(
                Finding(
                    Check.RENDEZVOUS,
                    Severity.FAULTY,
                    f"did not join within {obs.rdzv_timeout_s:g} s",
                )
            )
        elif n in obs.lost:
            findings[n].append(Finding(Check.LIVENESS, Severity.FAULTY, obs.lost[n]))

    for n, ev in obs.local.items():
        findings[n].extend(_local_findings(ev, th))
        notes[n].extend(ev.notes)
    med_compute = median(
        c.flops for ev in obs.local.values() for c in ev.compute if c.flops is not None
    )
    med_copy = median(
        c.bytes_per_s for ev in obs.local.values() for c in ev.copies if c.bytes_per_s is not None
    )
    for n, ev in obs.local.items():
        findings[n].extend(_relative_local_findings(ev, med_compute, med_copy, th))

    eligible = sorted(n for n in obs.joined if n not in obs.lost and 0 <= n < obs.nnodes)
    locally_flagged = {n for n in eligible if worst(findings[n]) is not Severity.HEALTHY}
    grading = grade_pairs(obs.pairs, eligible, th)
    for n, found in _network_findings(eligible, grading, th, locally_flagged).items():
        findings[n].extend(found)
    if len(eligible) == 1:
        notes[eligible[0]].append("no inter-node test: no other node took part")

    error = None
    others = [n for n in range(obs.nnodes) if n != obs.coordinator]
    if obs.nnodes >= 3 and others and not any(n in eligible for n in others):
        error = (
            f"no other node could be reached from node {obs.coordinator} (the rendezvous host): "
            "check that node's network before blaming the others"
        )
        # Absence of everyone else says more about the coordinator than about them.
        for n in others:
            findings[n] = [
                Finding(f.check, Severity.SUSPECT, f.message)
                if f.check in (Check.RENDEZVOUS, Check.LIVENESS)
                else f
                for f in findings[n]
            ]

    verdicts = []
    for n in range(obs.nnodes):
        ev = obs.local.get(n)
        flops = [c.flops for c in ev.compute if c.flops is not None] if ev else []
        copies = [c.bytes_per_s for c in ev.copies if c.bytes_per_s is not None] if ev else []
        verdicts.append(
            NodeVerdict(
                node=n,
                status=worst(findings[n]),
                findings=tuple(findings[n]),
                busbw=grading.best.get(n),
                compute_flops=min(flops) if flops else None,
                copy_bw=min(copies) if copies else None,
                notes=tuple(notes[n]),
            )
        )
    return Assessment(tuple(verdicts), grading.median_busbw, med_compute, med_copy, error)


def _local_findings(ev: LocalEvidence, th: Thresholds) -> list[Finding]:
    out: list[Finding] = []
    bad, slow = Severity.FAULTY, Severity.STRAGGLER
    if ev.error:
        out.append(Finding(Check.DEVICE, bad, f"local checks failed: {ev.error}"))
    if ev.nic is not None and ev.nic.carrier is False:
        out.append(
            Finding(
                Check.NIC,
                bad,
                f"interface {ev.nic.iface} has no carrier (operstate {ev.nic.operstate})",
            )
        )
    for d in ev.devices:
        gpu = f"GPU {d.index}"
        if d.error:
            out.append(Finding(Check.DEVICE, bad, f"NVML could not query {gpu}: {d.error}"))
        if d.ecc_uncorrected:
            out.append(
                Finding(Check.DEVICE, bad, f"{gpu} has {d.ecc_uncorrected} uncorrected ECC errors")
            )
        if d.xid_errors:
            xids = ", ".join(str(x) for x in d.xid_errors)
            out.append(Finding(Check.DEVICE, bad, f"{gpu} raised XID {xids} during the check"))
        if d.remap_failed:
            out.append(Finding(Check.DEVICE, bad, f"{gpu} row remapping failed"))
        used = d.memory_used_fraction
        if used is not None and used > th.max_gpu_memory_used:
            out.append(
                Finding(
                    Check.DEVICE,
                    bad,
                    f"{gpu} has {used:.0%} of its memory in use before training "
                    f"(limit {th.max_gpu_memory_used:.0%})",
                )
            )
        temp = d.temperature_c
        if temp is not None and temp > th.max_gpu_temp_c:
            out.append(
                Finding(
                    Check.DEVICE,
                    slow,
                    f"{gpu} at {temp:g} C (limit {th.max_gpu_temp_c:g} C): it will throttle",
                )
            )
    for c in ev.compute:
        if c.error:
            out.append(Finding(Check.COMPUTE, bad, f"matmul on {c.device} failed: {c.error}"))
    for c in ev.copies:
        if c.error:
            out.append(Finding(Check.INTRA, bad, f"copy GPU {c.label} failed: {c.error}"))
    return out


def _relative_local_findings(
    ev: LocalEvidence, med_compute: float | None, med_copy: float | None, th: Thresholds
) -> list[Finding]:
    out: list[Finding] = []
    for c in ev.compute:
        if c.flops is not None and med_compute and c.flops < th.compute_ratio * med_compute:
            out.append(
                Finding(
                    Check.COMPUTE,
                    Severity.STRAGGLER,
                    f"matmul {fmt_flops(c.flops)} on {c.device} < {th.compute_ratio:g} x "
                    f"median {fmt_flops(med_compute)}",
                )
            )
    for c in ev.copies:
        bw = c.bytes_per_s
        if bw is None:
            continue
        if th.min_copy_bw is not None and bw < th.min_copy_bw:
            why = f"minimum {fmt_rate(th.min_copy_bw)}"
        elif med_copy and bw < th.copy_ratio * med_copy:
            why = f"{th.copy_ratio:g} x median {fmt_rate(med_copy)}"
        else:
            continue
        out.append(
            Finding(Check.INTRA, Severity.STRAGGLER, f"copy GPU {c.label} {fmt_rate(bw)} < {why}")
        )
    return out


def _nodes(ns: Sequence[int] | set[int]) -> str:
    ns = sorted(ns)
    return ("node " if len(ns) == 1 else "nodes ") + ", ".join(str(n) for n in ns)


def _network_findings(
    eligible: Sequence[int], g: Grading, th: Thresholds, locally_flagged: set[int]
) -> dict[int, list[Finding]]:
    out: dict[int, list[Finding]] = {n: [] for n in eligible}
    required = required_partners(len(eligible))
    for x in eligible:
        bad = [p for p in g.pairs_of(x) if g.grades[p] is not Grade.GOOD]
        if not bad:
            continue
        if g.good(x):
            # x works with someone: a failed link to a partner that also works elsewhere is a
            # problem of that path, not of either node. Slow links here are noise or the
            # partner's fault, which the partner's own verdict covers.
            for p in bad:
                y = p.other(x)
                if g.grades[p] is Grade.FAILED and g.good(y):
                    out[x].append(
                        Finding(
                            Check.INTER,
                            Severity.SUSPECT,
                            f"link to node {y} failed ({p.error}) although both nodes passed "
                            "with other partners",
                        )
                    )
            continue
        explained = [p for p in bad if p.other(x) in locally_flagged]
        vouched = [p for p in bad if p.other(x) not in locally_flagged and g.good(p.other(x))]
        unexplained = [p for p in bad if p not in explained and p not in vouched]
        vouchers = {p.other(x) for p in vouched}
        if required >= 1 and len(vouchers) >= required:
            failed = [p for p in vouched if g.grades[p] is Grade.FAILED]
            if failed:
                out[x].append(
                    Finding(
                        Check.INTER,
                        Severity.FAULTY,
                        f"collective failed with {_nodes({p.other(x) for p in failed})} "
                        f"({failed[0].error}) while they passed with other partners",
                    )
                )
            else:
                out[x].append(
                    Finding(Check.INTER, Severity.STRAGGLER, _slow_message(x, vouched, g, th))
                )
        elif unexplained and x not in locally_flagged:
            # (A node flagged on its own evidence already explains its bad links.)
            partners = {p.other(x) for p in unexplained}
            what = _bad_what(unexplained, g)
            if len(eligible) == 2:
                why = "with 2 nodes the side of a single link cannot be told from the link alone"
            else:
                why = "not enough partners that passed elsewhere to pin it on one node"
            out[x].append(
                Finding(Check.INTER, Severity.SUSPECT, f"{what} with {_nodes(partners)}; {why}")
            )
    return out


def _bad_what(pairs: list[PairResult], g: Grading) -> str:
    failed = [p for p in pairs if g.grades[p] is Grade.FAILED]
    if failed:
        return f"collective failed ({failed[0].error})"
    rate = max(p.busbw or 0.0 for p in pairs)
    return f"busbw {fmt_rate(rate)} is low"


def _slow_message(x: int, vouched: list[PairResult], g: Grading, th: Thresholds) -> str:
    best = g.best.get(x)
    partners = _nodes({p.other(x) for p in vouched})
    if th.min_busbw is not None and best is not None and best < th.min_busbw:
        limit = f"minimum {fmt_rate(th.min_busbw)}"
    else:
        limit = f"{th.straggler_ratio:g} x median {fmt_rate(g.median_busbw)}"
    return f"busbw {fmt_rate(best)} (best with {partners}) < {limit}"
