"""Prometheus families for a precheck report, and the textfile writer behind `--metrics-file`.

Declared here, apart from the daemon's metrics module, so that module can pull them in. Every
node writes the job-wide view; the `node` label names the node a sample is about.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from diag.agent.precheck.measurements import Severity
from diag.agent.precheck.report import PrecheckReport
from diag.formats.untrusted import MIB, UntrustedInput, read_bounded, write_file_nofollow

# The textfile of a 16,000-node job of 8 GPUs a node is about 90 MiB.
MAX_TEXTFILE_BYTES = 256 * MIB
MAX_LABEL = 256


@dataclass(frozen=True)
class Family:
    name: str
    help: str
    labels: tuple[str, ...]


EXIT_CODE = Family(
    "diag_precheck_exit_code",
    "Exit code of the last precheck: 0 healthy, 4 faulty/straggling/suspect nodes, 5 could not run",
    ("job",),
)
NODES = Family(
    "diag_precheck_nodes",
    "Nodes of the last precheck by status (healthy, suspect, straggler, faulty)",
    ("job", "status"),
)
NODE_STATUS = Family(
    "diag_precheck_node_status",
    "1 for the status the last precheck gave the node, 0 for the others",
    ("job", "node", "status"),
)
BUSBW = Family(
    "diag_precheck_busbw_bytes_per_second",
    "Best inter-node allreduce bus bandwidth of the node with any partner (nccl-tests busbw)",
    ("job", "node"),
)
LINK_BUSBW = Family(
    "diag_precheck_link_busbw_bytes_per_second",
    "Allreduce bus bandwidth measured between two nodes (absent when the pair failed)",
    ("job", "node", "peer"),
)
LINK_FAILED = Family(
    "diag_precheck_link_failed",
    "1 when the collective between two nodes failed or timed out",
    ("job", "node", "peer"),
)
BUSBW_MEDIAN = Family(
    "diag_precheck_busbw_median_bytes_per_second",
    "Median over nodes of the best inter-node bus bandwidth",
    ("job",),
)
COMPUTE = Family(
    "diag_precheck_compute_flops",
    "Matmul throughput of each device in FLOP/s",
    ("job", "node", "device"),
)
COMPUTE_MEDIAN = Family(
    "diag_precheck_compute_median_flops",
    "Median matmul throughput over all devices of all nodes in FLOP/s",
    ("job",),
)
COPY = Family(
    "diag_precheck_copy_bytes_per_second",
    "Copy bandwidth between two devices of a node",
    ("job", "node", "pair"),
)
COPY_MEDIAN = Family(
    "diag_precheck_copy_median_bytes_per_second",
    "Median intra-node copy bandwidth over all device pairs of all nodes",
    ("job",),
)
WALL = Family("diag_precheck_wall_seconds", "Wall time of the last precheck", ("job",))
TIMESTAMP = Family(
    "diag_precheck_last_run_timestamp_seconds",
    "Unix time the last precheck started",
    ("job",),
)
ROUNDS = Family("diag_precheck_rounds", "Inter-node pairing rounds the last precheck ran", ("job",))

FAMILIES: tuple[Family, ...] = (
    EXIT_CODE,
    NODES,
    NODE_STATUS,
    BUSBW,
    LINK_BUSBW,
    LINK_FAILED,
    BUSBW_MEDIAN,
    COMPUTE,
    COMPUTE_MEDIAN,
    COPY,
    COPY_MEDIAN,
    WALL,
    TIMESTAMP,
    ROUNDS,
)


def _gauge(f: Family) -> GaugeMetricFamily:
    return GaugeMetricFamily(f.name, f.help, labels=list(f.labels))


class ReportCollector(Collector):
    """Turns one `PrecheckReport` into metric families (a custom collector: no global state)."""

    def __init__(self, report: PrecheckReport) -> None:
        self.report = report

    def collect(self) -> Iterator[Metric]:
        r = self.report
        job = r.job
        g = {f.name: _gauge(f) for f in FAMILIES}
        g[EXIT_CODE.name].add_metric([job], r.exit_code)
        g[WALL.name].add_metric([job], r.wall_seconds)
        g[TIMESTAMP.name].add_metric([job], r.started_at)
        g[ROUNDS.name].add_metric([job], len(r.rounds))
        for status in Severity:
            g[NODES.name].add_metric([job, status.value], sum(n.status is status for n in r.nodes))
        for median, fam in (
            (r.median_busbw_bytes_per_s, BUSBW_MEDIAN),
            (r.median_compute_flops, COMPUTE_MEDIAN),
            (r.median_copy_bytes_per_s, COPY_MEDIAN),
        ):
            if median is not None:
                g[fam.name].add_metric([job], median)
        for n in r.nodes:
            node = str(n.node)
            for status in Severity:
                g[NODE_STATUS.name].add_metric([job, node, status.value], n.status is status)
            if n.busbw_bytes_per_s is not None:
                g[BUSBW.name].add_metric([job, node], n.busbw_bytes_per_s)
            for link in n.links:
                peer = str(link.peer)
                g[LINK_FAILED.name].add_metric([job, node, peer], link.grade == "failed")
                if link.busbw_bytes_per_s is not None:
                    g[LINK_BUSBW.name].add_metric([job, node, peer], link.busbw_bytes_per_s)
            for c in n.compute:
                if c.flops is not None:
                    g[COMPUTE.name].add_metric([job, node, c.device], c.flops)
            for c in n.copies:
                if c.bytes_per_s is not None:
                    g[COPY.name].add_metric([job, node, c.label], c.bytes_per_s)
        yield from g.values()


def registry_for(report: PrecheckReport) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReportCollector(report))
    return registry


def write_textfile(report: PrecheckReport, path: Path) -> None:
    """Write the node-exporter textfile format atomically (temp file + rename), without
    following a symlink planted at the name or at the temp name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_nofollow(path, generate_latest(registry_for(report)), mode=0o644)


_KNOWN = {f.name: f for f in FAMILIES}


def read_textfile(path: Path) -> list[Metric]:
    """The families of a textfile `write_textfile` wrote, read back: a regular file under the
    cap, not through a symlink, holding only our families with their labels and finite values.
    Raises UntrustedInput naming the file."""
    raw = read_bounded(path, max_bytes=MAX_TEXTFILE_BYTES)
    try:
        families = list(text_string_to_metric_families(raw.decode()))
    except (ValueError, IndexError, KeyError, TypeError) as e:  # the parser's ways to fail
        raise UntrustedInput(path, f"is not a Prometheus textfile: {e}") from None
    out = []
    for m in families:
        fam = _KNOWN.get(m.name)
        if fam is None:
            if m.name.startswith("diag_precheck_"):
                raise UntrustedInput(path, f"has {m.name[:80]!r}, not a precheck family")
            continue  # another writer's families in a shared textfile: not ours to export
        labels = set(fam.labels)
        for s in m.samples:
            if s.name != fam.name or set(s.labels) != labels or m.type not in ("gauge", "unknown"):
                raise UntrustedInput(path, f"has a {s.name[:80]} sample unlike {fam.name}'s")
            if not math.isfinite(s.value) or any(len(v) > MAX_LABEL for v in s.labels.values()):
                raise UntrustedInput(path, f"has a {s.name} sample out of bounds")
        out.append(m)
    return out
