"""What the diag dashboard shows: its rows, panels and queries, as plain data.

`build_dashboard.py` lays them out into Grafana's JSON. Queries use the dashboard's variables
`$job` and `$node` and Grafana's `$__rate_interval` and `$__range`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

R = '{job=~"$job", node=~"$node"}'  # rank and job-level selectors
N = '{node=~"$node"}'  # host-level selectors
RI = "$__rate_interval"


@dataclass(frozen=True)
class Q:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class P:
    title: str
    queries: tuple[Q, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    description: str = ""
    extra: dict = field(default_factory=dict)


ROWS: tuple[tuple[str, tuple[P, ...]], ...] = (
    (
        "Health",
        (
            P(
                "Ranks hung",
                (Q(f"sum(diag_rank_hung{R}) or vector(0)"),),
                kind="stat",
                width=4,
                height=5,
                description="Ranks over their hang limit now",
                extra={"thresholds": [("green", None), ("red", 1)]},
            ),
            P(
                "Open incidents",
                (Q(f"sum by (kind) (diag_incident_open{R})", "{{kind}}"),),
                kind="stat",
                width=5,
                height=5,
                extra={"thresholds": [("green", None), ("red", 1)]},
            ),
            P(
                "Incidents in range",
                (Q(f"sum by (kind) (increase(diag_incidents_total{R}[$__range]))", "{{kind}}"),),
                kind="stat",
                width=5,
                height=5,
                extra={"thresholds": [("green", None), ("orange", 1)]},
            ),
            P(
                "Ranks alive",
                (Q(f"sum(diag_rank_alive{R})"),),
                kind="stat",
                width=3,
                height=5,
            ),
            P(
                "Last incident",
                (Q(f"max(diag_incident_last_timestamp_seconds{R}) * 1000"),),
                unit="dateTimeFromNow",
                kind="stat",
                width=3,
                height=5,
            ),
            P(
                "Likely culprit",
                (Q(f"diag_rank_culprit{R} == 1", "rank {{rank}} on {{node}}"),),
                kind="table",
                width=4,
                height=5,
                description="The rank the open incident blames",
                extra={"instant": True},
            ),
        ),
    ),
    (
        "Progress",
        (
            P("Steps", (Q(f"diag_rank_step{R}", "rank {{rank}}"),)),
            P("Step time", (Q(f"diag_rank_step_seconds{R}", "rank {{rank}}"),), unit="s"),
            P(
                "Silence vs hang limit",
                (
                    Q(f"diag_rank_seconds_since_progress{R}", "rank {{rank}} silent"),
                    Q(f"max by (job, node) (diag_rank_hang_limit_seconds{R})", "limit {{node}}"),
                ),
                unit="s",
                description="A rank is hung when its silence (or oldest pending op) crosses its "
                "limit",
            ),
            P("Hung ranks", (Q(f"diag_rank_hung{R}", "rank {{rank}}"),)),
            P("Pending ops", (Q(f"diag_rank_pending_ops{R}", "rank {{rank}}"),)),
            P("Rank CPU", (Q(f"diag_rank_cpu_ratio{R}", "rank {{rank}}"),), unit="percentunit"),
        ),
    ),
    (
        "Stragglers",
        (
            P(
                "Straggler score",
                (Q(f"diag_rank_straggler_score{R}", "rank {{rank}}"),),
                unit="percentunit",
                width=12,
                description="Share of wall time the others wait for this rank (alert >= 10%)",
            ),
            P(
                "Last to arrive",
                (Q(f"diag_rank_straggler_late_ratio{R}", "rank {{rank}}"),),
                unit="percentunit",
                width=6,
            ),
            P(
                "Share of all waiting",
                (Q(f"diag_rank_straggler_wait_share{R}", "rank {{rank}}"),),
                unit="percentunit",
                width=6,
                description="Share of the waiting in recent collectives this rank caused "
                "(alert >= 50%, with a score >= 10%)",
            ),
        ),
    ),
    (
        "Collectives",
        (
            P(
                "Latency p50 / p99 by op",
                (
                    Q(
                        "histogram_quantile(0.5, sum by (op, le) "
                        f"(rate(diag_collective_latency_seconds_bucket{R}[{RI}])))",
                        "p50 {{op}}",
                    ),
                    Q(
                        "histogram_quantile(0.99, sum by (op, le) "
                        f"(rate(diag_collective_latency_seconds_bucket{R}[{RI}])))",
                        "p99 {{op}}",
                    ),
                ),
                unit="s",
            ),
            P(
                "Mean latency by rank",
                (
                    Q(
                        f"sum by (rank) (rate(diag_collective_latency_seconds_sum{R}[{RI}])) / "
                        f"sum by (rank) (rate(diag_collective_latency_seconds_count{R}[{RI}]))",
                        "rank {{rank}}",
                    ),
                ),
                unit="s",
            ),
            P(
                "Bus bandwidth",
                (Q(f"diag_collective_busbw_bytes_per_second{R}", "rank {{rank}} {{op}}"),),
                unit="Bps",
            ),
            P(
                "Message bytes per second",
                (
                    Q(
                        f"sum by (rank, op) (rate(diag_collective_bytes_total{R}[{RI}]))",
                        "rank {{rank}} {{op}}",
                    ),
                ),
                unit="Bps",
                width=12,
            ),
            P(
                "Ops per second",
                (
                    Q(
                        f"sum by (op) (rate(diag_collective_latency_seconds_count{R}[{RI}]))",
                        "{{op}}",
                    ),
                ),
                unit="ops",
                width=12,
            ),
        ),
    ),
    (
        "Incidents and evidence",
        (
            P(
                "Incidents",
                (
                    Q(f"sum by (kind) (increase(diag_incidents_total{R}[{RI}]))", "{{kind}}"),
                    Q(
                        f"sum by (trigger) (increase(diag_job_stops_total{R}[{RI}]))",
                        "stopped with the job: {{trigger}}",
                    ),
                    Q(
                        f"sum by (outcome) (increase(diag_in_place_recoveries_total{R}[{RI}]))",
                        "ranks asked to recover in place: {{outcome}}",
                    ),
                ),
                kind="bars",
            ),
            P(
                "Detection delay (mean)",
                (
                    Q(
                        f"sum(diag_incident_detection_delay_seconds_sum{R}) / "
                        f"sum(diag_incident_detection_delay_seconds_count{R})",
                        "after the limit ran out",
                    ),
                ),
                unit="s",
                description="From the moment a limit ran out (or a rank died) to the verdict",
            ),
            P(
                "Evidence capture (mean, p99 bucket)",
                (
                    Q(
                        f"sum by (stage) (diag_evidence_seconds_sum{R}) / "
                        f"sum by (stage) (diag_evidence_seconds_count{R})",
                        "mean {{stage}}",
                    ),
                    Q(
                        "histogram_quantile(0.99, sum by (stage, le) "
                        f"(diag_evidence_seconds_bucket{R}))",
                        "p99 {{stage}}",
                    ),
                ),
                unit="s",
            ),
        ),
    ),
    (
        "Checkpoints",
        (
            P(
                "Checkpoint steps",
                (
                    Q(f"max by (job) (diag_checkpoint_memory_step{R})", "in memory"),
                    Q(f"min by (job) (diag_checkpoint_persisted_step{R})", "on storage"),
                ),
                width=6,
            ),
            P(
                "Checkpoint age",
                (
                    Q(
                        f"time() - max by (job) (diag_checkpoint_memory_timestamp_seconds{R})",
                        "in memory",
                    ),
                    Q(
                        f"time() - max by (job) (diag_checkpoint_persisted_timestamp_seconds{R})",
                        "on storage",
                    ),
                ),
                unit="s",
                width=6,
            ),
            P(
                "Save and persist time",
                (
                    Q(f"diag_checkpoint_save_seconds{R}", "save rank {{rank}}"),
                    Q(f"diag_checkpoint_persist_seconds{R}", "persist rank {{rank}}"),
                ),
                unit="s",
                width=6,
            ),
            P(
                "Persisted bytes",
                (Q(f"diag_checkpoint_persist_bytes{R}", "rank {{rank}}"),),
                unit="bytes",
                width=6,
            ),
        ),
    ),
    (
        "Replicas in peer nodes",
        (
            P(
                "Replica steps",
                (
                    Q(f"min by (job) (diag_replica_sent_step{R})", "held by every node's holders"),
                    Q(f"diag_replica_held_step{R}", "{{node}} holds {{peer}}"),
                    Q(f"diag_replica_handed_over_step{R}", "{{node}} wrote lost {{peer}}'s"),
                ),
                width=6,
            ),
            P(
                "Restore at agent start",
                (
                    Q(f"diag_replica_restore_step{R}", "{{node}} from {{source}}"),
                    Q(f"diag_replica_restore_seconds{R}", "{{node}} seconds"),
                ),
                kind="table",
                extra={"instant": True},
                width=6,
            ),
            P(
                "Replica sends",
                (
                    Q(f"sum by (node) (rate(diag_replica_pushes_total{R}[5m]))", "{{node}} sent"),
                    Q(
                        f"sum by (node) (rate(diag_replica_push_failures_total{R}[5m]))",
                        "{{node}} failed",
                    ),
                    Q(
                        f"sum by (node) (rate(diag_replica_handover_failures_total{R}[5m]))",
                        "{{node}} lost peers' parts not written",
                    ),
                    Q(
                        f"sum by (node) (increase(diag_restore_fallbacks_total{R}[1h]))",
                        "{{node}} resumed from storage with steps in memory",
                    ),
                    Q(
                        f"sum by (node) (increase(diag_node_name_mismatches_total{R}[1h]))",
                        "{{node}} ranks naming another node",
                    ),
                ),
                unit="ops",
                width=6,
            ),
            P(
                "Replica send time and size",
                (
                    Q(f"diag_replica_push_seconds{R}", "{{node}} seconds"),
                    Q(f"diag_replica_push_bytes{R}", "{{node}} bytes"),
                ),
                width=6,
            ),
        ),
    ),
    (
        "Precheck",
        (
            P(
                "Node status",
                (Q('diag_precheck_node_status{job=~"$job"} == 1', "{{node}} {{status}}"),),
                kind="table",
                extra={"instant": True},
            ),
            P(
                "Precheck exit code",
                (Q('max by (job) (diag_precheck_exit_code{job=~"$job"})', "{{job}}"),),
                kind="stat",
                width=4,
                extra={"thresholds": [("green", None), ("red", 4)]},
            ),
            P(
                "Inter-node bus bandwidth",
                (
                    Q(
                        'max by (node) (diag_precheck_busbw_bytes_per_second{job=~"$job"})',
                        "{{node}}",
                    ),
                ),
                unit="Bps",
                kind="bars",
                width=6,
            ),
            P(
                "Failed links",
                (
                    Q(
                        'max by (node, peer) (diag_precheck_link_failed{job=~"$job"}) == 1',
                        "{{node}} - {{peer}}",
                    ),
                ),
                kind="table",
                width=6,
                extra={"instant": True},
            ),
        ),
    ),
    (
        "Host",
        (
            P(
                "Host CPU",
                (
                    Q(
                        f"rate(diag_host_cpu_busy_seconds_total{N}[{RI}]) / diag_host_cpu_cores{N}",
                        "{{node}}",
                    ),
                ),
                unit="percentunit",
            ),
            P(
                "Host memory",
                (
                    Q(f"diag_host_memory_total_bytes{N}", "total {{node}}"),
                    Q(f"diag_host_memory_available_bytes{N}", "available {{node}}"),
                ),
                unit="bytes",
            ),
            P(
                "/dev/shm",
                (
                    Q(f"diag_host_shm_used_bytes{N}", "used {{node}}"),
                    Q(f"diag_host_shm_free_bytes{N}", "free {{node}}"),
                ),
                unit="bytes",
                description="Alert at 90% used",
            ),
        ),
    ),
    (
        "GPU",
        (
            P(
                "GPU utilization",
                (Q(f"diag_gpu_utilization_ratio{N}", "{{node}} gpu {{gpu}}"),),
                unit="percentunit",
                width=6,
            ),
            P(
                "GPU memory",
                (
                    Q(f"diag_gpu_memory_used_bytes{N}", "used {{node}} gpu {{gpu}}"),
                    Q(f"diag_gpu_memory_total_bytes{N}", "total {{node}} gpu {{gpu}}"),
                ),
                unit="bytes",
                width=6,
            ),
            P(
                "GPU temperature",
                (Q(f"diag_gpu_temperature_celsius{N}", "{{node}} gpu {{gpu}}"),),
                unit="celsius",
                width=6,
            ),
            P(
                "GPU power",
                (Q(f"diag_gpu_power_watts{N}", "{{node}} gpu {{gpu}}"),),
                unit="watt",
                width=6,
            ),
            P(
                "XID errors",
                (
                    Q(f"increase(diag_gpu_xid_errors_total{N}[{RI}])", "{{node}} gpu {{gpu}}"),
                    Q(f"diag_gpu_last_xid{N} > 0", "last XID {{node}} gpu {{gpu}}"),
                ),
                width=12,
            ),
            P(
                "ECC errors",
                (
                    Q(
                        f"increase(diag_gpu_ecc_errors_total{N}[{RI}])",
                        "{{type}} {{node}} gpu {{gpu}}",
                    ),
                ),
                width=12,
            ),
        ),
    ),
    (
        "Agent",
        (
            P(
                "Agent scrape up",
                (Q('up{job=~"(.+/)?diag-agent"}', "{{instance}}"),),
                width=4,
            ),
            P(
                "Agent version",
                (Q(f"diag_agent_info{N}", "{{node}} {{version}}"),),
                kind="table",
                width=4,
                extra={"instant": True},
            ),
            P(
                "Agent memory",
                (Q(f"diag_agent_resident_memory_bytes{N}", "{{node}}"),),
                unit="bytes",
                width=4,
            ),
            P(
                "Agent CPU",
                (Q(f"rate(diag_agent_cpu_seconds_total{N}[{RI}])", "{{node}}"),),
                unit="percentunit",
                width=4,
            ),
            P(
                "Loop time per check",
                (
                    Q(
                        f"rate(diag_agent_iteration_seconds_total{N}[{RI}]) / "
                        f"rate(diag_agent_iterations_total{N}[{RI}])",
                        "{{node}}",
                    ),
                ),
                unit="s",
                width=4,
            ),
            P(
                "Since last check",
                (Q(f"time() - diag_agent_last_iteration_timestamp_seconds{N}", "{{node}}"),),
                unit="s",
                width=4,
            ),
        ),
    ),
)

ANNOTATIONS = (
    (
        "Incidents",
        f"sum by (job, node, kind) (changes(diag_incidents_total{R}[1m])) > 0",
        "{{kind}} on {{node}}",
    ),
)
