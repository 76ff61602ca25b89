"""Every metric family the agent exports, declared once: name, type, help text and labels.

Labels stay bounded: `job`, `node`, `rank`, `local_rank`, the op kind (`op`, a dozen values),
the incident kind, the evidence stage, a stop's trigger, the GPU index. Nothing unbounded (op
sequence numbers, group names, PIDs, paths) ever becomes a label. The precheck's own `diag_precheck_*` families are
declared in `diag.agent.precheck.promfile` and re-exported as they are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Kind(enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Family:
    name: str  # without the `_total` suffix prometheus-client adds to counters
    kind: Kind
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this family."""
        if self.kind == Kind.COUNTER:
            return (self.name + "_total",)
        if self.kind == Kind.HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)

    def new(self) -> GaugeMetricFamily | CounterMetricFamily:
        """An empty family for a custom collector to fill at scrape time."""
        if self.kind == Kind.GAUGE:
            return GaugeMetricFamily(self.name, self.help, labels=self.labels)
        if self.kind == Kind.COUNTER:
            return CounterMetricFamily(self.name, self.help, labels=self.labels)
        raise TypeError(f"{self.name}: histograms are kept by prometheus_client.Histogram")


RANK = ("job", "node", "rank", "local_rank")
NODE = ("node",)
GPU = ("node", "gpu")

# Collective latencies from tens of microseconds (small NCCL ops) to minutes (a rank that waits
# for a straggler); the hang limit sits above the last finite bucket.
LATENCY_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
EVIDENCE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# -- per rank, computed at scrape time from the latest observation -------------------------------
RANK_ALIVE = Family(
    "diag_rank_alive", Kind.GAUGE, "1 while the rank's process runs, 0 once it ended", RANK
)
RANK_STEP = Family("diag_rank_step", Kind.GAUGE, "Training steps the rank completed", RANK)
RANK_STEP_SECONDS = Family(
    "diag_rank_step_seconds", Kind.GAUGE, "Duration of the rank's last completed step", RANK
)
RANK_SINCE_PROGRESS = Family(
    "diag_rank_seconds_since_progress",
    Kind.GAUGE,
    "Seconds since the rank's last sign of progress (an op issued or finished, a step, a phase)",
    RANK,
)
RANK_HANG_LIMIT = Family(
    "diag_rank_hang_limit_seconds",
    Kind.GAUGE,
    "The rank's current hang limit (adaptive, per phase, or the warm-up limit)",
    RANK,
)
RANK_HUNG = Family(
    "diag_rank_hung",
    Kind.GAUGE,
    "1 while the rank is judged hung: its oldest pending op or its silence is over its limit",
    RANK,
)
RANK_CULPRIT = Family(
    "diag_rank_culprit",
    Kind.GAUGE,
    "1 for the rank named as the likely culprit of the open incident",
    RANK,
)
RANK_PENDING = Family(
    "diag_rank_pending_ops", Kind.GAUGE, "Collective and p2p ops the rank has not finished", RANK
)
RANK_CPU = Family(
    "diag_rank_cpu_ratio",
    Kind.GAUGE,
    "Share of one core the rank's process used between the agent's last two checks",
    RANK,
)
STRAGGLER_SCORE = Family(
    "diag_rank_straggler_score",
    Kind.GAUGE,
    "Waiting the rank caused the others in recent collectives, as a share of wall time",
    RANK,
)
STRAGGLER_LATE = Family(
    "diag_rank_straggler_late_ratio",
    Kind.GAUGE,
    "Share of recent collectives in which the rank arrived last",
    RANK,
)
STRAGGLER_WAIT_SHARE = Family(
    "diag_rank_straggler_wait_share",
    Kind.GAUGE,
    "Share of all the waiting in recent collectives that this rank caused",
    RANK,
)

# -- collectives, per rank and op kind ------------------------------------------------------------
COLL = (*RANK, "op")
COLL_LATENCY = Family(
    "diag_collective_latency_seconds",
    Kind.HISTOGRAM,
    "Completed collective/p2p ops from enqueue to completion (after the first two steps)",
    COLL,
    LATENCY_BUCKETS,
)
COLL_BYTES = Family(
    "diag_collective_bytes",
    Kind.COUNTER,
    "Message bytes of completed ops (the larger of input and output, as nccl-tests counts)",
    COLL,
)
COLL_BUSBW = Family(
    "diag_collective_busbw_bytes_per_second",
    Kind.GAUGE,
    "Bus bandwidth of the rank's recent ops (nccl-tests factors over their total time)",
    COLL,
)

# -- incidents and evidence -----------------------------------------------------------------------
INCIDENTS = Family(
    "diag_incidents",
    Kind.COUNTER,
    "Incidents detected (kind: hang, no_progress, rank_exited)",
    ("job", "node", "kind"),
)
JOB_STOPS = Family(
    "diag_job_stops",
    Kind.COUNTER,
    "Times the local ranks were stopped (--on-hang stop) for an incident another node of the job "
    "reported (trigger: first-hand, death, job-verdict); a stop at the node's own verdict counts "
    "in diag_incidents only",
    ("job", "node", "trigger"),
)
IN_PLACE = Family(
    "diag_in_place_recoveries",
    Kind.COUNTER,
    "Ranks the agent asked to recover in place at its verdict (--on-hang recover), by outcome: "
    "took (recovering in place), stopped (could not, or did not answer within --stop-grace, and "
    "was stopped; its launcher replaces or restarts it), not_asked (not connected to the agent)",
    ("job", "node", "outcome"),
)
INCIDENT_OPEN = Family(
    "diag_incident_open",
    Kind.GAUGE,
    "1 while an incident is open (until progress resumes or the ranks restart)",
    ("job", "node", "kind"),
)
INCIDENT_TIME = Family(
    "diag_incident_last_timestamp_seconds",
    Kind.GAUGE,
    "Unix time of the last incident",
    ("job", "node"),
)
DETECTION_DELAY = Family(
    "diag_incident_detection_delay_seconds",
    Kind.HISTOGRAM,
    "Seconds from the moment the first limit ran out (or a rank died) to the verdict",
    ("job", "node"),
    EVIDENCE_BUCKETS,
)
EVIDENCE_SECONDS = Family(
    "diag_evidence_seconds",
    Kind.HISTOGRAM,
    "Seconds to capture an incident's evidence (stage on_disk: Python stacks of all ranks "
    "written; complete: native stacks added)",
    ("job", "node", "stage"),
    EVIDENCE_BUCKETS,
)

# -- checkpoints (facts from the flash checkpointer) ----------------------------------------------
CKPT = ("job", "node", "rank")
CKPT_MEMORY_STEP = Family(
    "diag_checkpoint_memory_step", Kind.GAUGE, "Step of the last checkpoint held in memory", CKPT
)
CKPT_PERSISTED_STEP = Family(
    "diag_checkpoint_persisted_step", Kind.GAUGE, "Step of the last checkpoint on storage", CKPT
)
CKPT_SAVE_SECONDS = Family(
    "diag_checkpoint_save_seconds",
    Kind.GAUGE,
    "Seconds the last save to memory blocked training",
    CKPT,
)
CKPT_PERSIST_SECONDS = Family(
    "diag_checkpoint_persist_seconds", Kind.GAUGE, "Seconds the last persist to storage took", CKPT
)
CKPT_PERSIST_BYTES = Family(
    "diag_checkpoint_persist_bytes", Kind.GAUGE, "Bytes the last persist wrote", CKPT
)
CKPT_MEMORY_TIME = Family(
    "diag_checkpoint_memory_timestamp_seconds",
    Kind.GAUGE,
    "Unix time the checkpoint in memory last advanced",
    CKPT,
)
CKPT_PERSISTED_TIME = Family(
    "diag_checkpoint_persisted_timestamp_seconds",
    Kind.GAUGE,
    "Unix time the checkpoint on storage last advanced",
    CKPT,
)

# -- replicas of flash checkpoints in peer nodes' memory (agent.replica) --------------------------
REPLICA = ("job", "node")
REPLICA_SENT_STEP = Family(
    "diag_replica_sent_step",
    Kind.GAUGE,
    "Newest step of this node's checkpoint that every one of its replica holders holds",
    REPLICA,
)
REPLICA_PUSHES = Family(
    "diag_replica_pushes",
    Kind.COUNTER,
    "Replicas of this node's checkpoint sent to a holder",
    REPLICA,
)
REPLICA_PUSH_FAILURES = Family(
    "diag_replica_push_failures",
    Kind.COUNTER,
    "Replicas of this node's checkpoint that a holder did not take (down, refused, cut off)",
    REPLICA,
)
REPLICA_PUSH_SECONDS = Family(
    "diag_replica_push_seconds", Kind.GAUGE, "Seconds the last replica sent took", REPLICA
)
REPLICA_PUSH_BYTES = Family(
    "diag_replica_push_bytes", Kind.GAUGE, "Bytes of the last replica sent", REPLICA
)
REPLICA_HELD_STEP = Family(
    "diag_replica_held_step",
    Kind.GAUGE,
    "Step of the replica this node holds for a peer node",
    ("job", "node", "peer"),
)
REPLICA_RESTORE_STEP = Family(
    "diag_replica_restore_step",
    Kind.GAUGE,
    "Step this node's ranks found in memory at the agent's start, by where it came from "
    "(local: memory survived; peer: pulled from a replica holder; storage, none: nothing pulled)",
    ("job", "node", "source"),
)
REPLICA_RESTORE_SECONDS = Family(
    "diag_replica_restore_seconds",
    Kind.GAUGE,
    "Seconds the start-up choice and pull of a replica took",
    REPLICA,
)
REPLICA_HANDED_OVER_STEP = Family(
    "diag_replica_handed_over_step",
    Kind.GAUGE,
    "Step of a lost peer's replica this node wrote to storage (the peer's agent stopped "
    "answering while this node's ranks were stopped)",
    ("job", "node", "peer"),
)
REPLICA_HANDOVER_FAILURES = Family(
    "diag_replica_handover_failures",
    Kind.COUNTER,
    "Parts of lost peers' replicas this node could not write to storage",
    REPLICA,
)
RESTORE_FALLBACKS = Family(
    "diag_restore_fallbacks",
    Kind.COUNTER,
    "Launches whose ranks resumed from storage although a step was in memory on this node (its "
    "own, or pulled from a peer's replica): the ranks held no step in common",
    REPLICA,
)
NODE_NAME_MISMATCHES = Family(
    "diag_node_name_mismatches",
    Kind.COUNTER,
    "Ranks that registered naming another node than this agent's --node: their snapshots are "
    "not replicated (DIAG_NODE must be the same in the trainer's and the agent's environment)",
    REPLICA,
)

# -- host (psutil) --------------------------------------------------------------------------------
HOST_CPU_BUSY = Family(
    "diag_host_cpu_busy_seconds",
    Kind.COUNTER,
    "CPU seconds the host spent outside idle and iowait, summed over cores",
    NODE,
)
HOST_CPU_CORES = Family("diag_host_cpu_cores", Kind.GAUGE, "Logical CPUs of the host", NODE)
HOST_MEM_TOTAL = Family("diag_host_memory_total_bytes", Kind.GAUGE, "Host memory", NODE)
HOST_MEM_AVAILABLE = Family(
    "diag_host_memory_available_bytes",
    Kind.GAUGE,
    "Host memory available to new allocations without swapping",
    NODE,
)
HOST_SHM_USED = Family(
    "diag_host_shm_used_bytes",
    Kind.GAUGE,
    "Bytes used in /dev/shm (journals, flash checkpoints, NCCL/gloo buffers)",
    NODE,
)
HOST_SHM_FREE = Family("diag_host_shm_free_bytes", Kind.GAUGE, "Bytes free in /dev/shm", NODE)

# -- GPU (NVML; absent on hosts without an NVIDIA driver) -----------------------------------------
GPU_UTIL = Family(
    "diag_gpu_utilization_ratio", Kind.GAUGE, "Share of time a kernel ran (NVML)", GPU
)
GPU_MEM_USED = Family("diag_gpu_memory_used_bytes", Kind.GAUGE, "Device memory in use", GPU)
GPU_MEM_TOTAL = Family("diag_gpu_memory_total_bytes", Kind.GAUGE, "Device memory", GPU)
GPU_TEMP = Family("diag_gpu_temperature_celsius", Kind.GAUGE, "GPU core temperature", GPU)
GPU_POWER = Family("diag_gpu_power_watts", Kind.GAUGE, "GPU power draw", GPU)
GPU_XID = Family(
    "diag_gpu_xid_errors",
    Kind.COUNTER,
    "Critical XID errors the driver reported since the agent started",
    GPU,
)
GPU_LAST_XID = Family(
    "diag_gpu_last_xid", Kind.GAUGE, "Code of the last XID error (0 when none was seen)", GPU
)
GPU_ECC = Family(
    "diag_gpu_ecc_errors",
    Kind.COUNTER,
    "Volatile ECC errors since the driver loaded (type: corrected, uncorrected)",
    (*GPU, "type"),
)

# -- the agent itself -----------------------------------------------------------------------------
AGENT_INFO = Family(
    "diag_agent_info", Kind.GAUGE, "Always 1; the agent's version in a label", ("node", "version")
)
AGENT_RSS = Family(
    "diag_agent_resident_memory_bytes", Kind.GAUGE, "Resident memory of the agent", NODE
)
AGENT_CPU = Family(
    "diag_agent_cpu_seconds", Kind.COUNTER, "CPU seconds the agent used (user + system)", NODE
)
AGENT_ITERATIONS = Family(
    "diag_agent_iterations", Kind.COUNTER, "Checks the agent's loop made", NODE
)
AGENT_ITERATION_SECONDS = Family(
    "diag_agent_iteration_seconds",
    Kind.COUNTER,
    "Seconds the agent's loop spent observing, deciding and acting",
    NODE,
)
AGENT_LAST_ITERATION = Family(
    "diag_agent_last_iteration_timestamp_seconds",
    Kind.GAUGE,
    "Unix time of the agent's last check (a stuck agent stops advancing it)",
    NODE,
)

FAMILIES: tuple[Family, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Family))

# The xpu_timer gauge DLRover's diagnosis reads; only with --xpu-timer-compat. Its labels are
# xpu_timer's, not ours.
XPU_TIMER_HANG = Family(
    "XPU_TIMER_COMMON_HANG",
    Kind.GAUGE,
    "xpu_timer-compatible hang flag: 1 while the rank is judged hung",
    ("ip", "job_name", "local_rank", "pod_name", "rank"),
)
