"""The report as a terminal table: one line per node, the medians, then notes."""

from __future__ import annotations

from diag.agent.node.units import fmt_flops, fmt_rate
from diag.agent.precheck.measurements import Severity
from diag.agent.precheck.report import Outcome, PrecheckReport


def _ranks(nodes: tuple[int, ...]) -> str:
    return ", ".join(str(n) for n in nodes)


def headline(r: PrecheckReport) -> str:
    rounds = f"{len(r.rounds)} round" + ("" if len(r.rounds) == 1 else "s")
    nodes = f"{r.nnodes} node" + ("" if r.nnodes == 1 else "s")
    head = f"diag precheck: {nodes}, {rounds}, {r.wall_seconds:.1f} s: "
    if r.outcome is Outcome.HEALTHY:
        return head + "all nodes healthy"
    parts = []
    for label, nodes in (
        ("faulty", r.faulty),
        ("stragglers", r.stragglers),
        ("suspects", r.suspects),
    ):
        if nodes:
            parts.append(f"{label} [{_ranks(nodes)}]")
    if r.outcome is Outcome.ERROR:
        parts.insert(0, f"could not run ({r.error})")
    elif r.error:
        parts.append(f"({r.error})")
    return head + ", ".join(parts)


def render(r: PrecheckReport) -> str:
    show_copy = any(n.copy_bytes_per_s is not None for n in r.nodes)
    header = ["node", "host", "status", "busbw", "compute"]
    if show_copy:
        header.append("copy")
    header.append("reason")
    rows = [header]
    for n in r.nodes:
        row = [
            f"{n.node}*" if n.node == r.reported_by else str(n.node),
            n.host or "-",
            n.status.value,
            fmt_rate(n.busbw_bytes_per_s),
            fmt_flops(n.compute_flops),
        ]
        if show_copy:
            row.append(fmt_rate(n.copy_bytes_per_s))
        row.append(n.reason if n.status is not Severity.HEALTHY else "")
        rows.append(row)
    med = ["median", "", "", fmt_rate(r.median_busbw_bytes_per_s)]
    med.append(fmt_flops(r.median_compute_flops))
    if show_copy:
        med.append(fmt_rate(r.median_copy_bytes_per_s))
    med.append("")
    rows.append(med)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [headline(r)]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    lines.extend(_notes(r))
    return "\n".join(lines)


def _notes(r: PrecheckReport) -> list[str]:
    """Notes shared by every node once, the others per node."""
    every = [set(n.notes) for n in r.nodes if n.notes]
    common = set.intersection(*every) if every and len(every) == len(r.nodes) else set()
    out = [f"note: {text}" for text in sorted(common)]
    for n in r.nodes:
        out.extend(f"note: node {n.node}: {text}" for text in n.notes if text not in common)
    if any(n.node == r.reported_by for n in r.nodes):
        out.append(f"* this node ({r.reported_by})")
    return out
