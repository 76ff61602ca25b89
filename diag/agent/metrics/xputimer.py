"""xpu_timer's hang gauge, so DLRover's diagnosis can act on our detection. Pure text rendering.

DLRover's agent GETs `http://127.0.0.1:$XPU_TIMER_PORT/metrics` every minute and ships the text to
its master. The master keeps the lines that start with `XPU_TIMER_COMMON_HANG`, reads the *last
run of digits* on each line as the flag, and calls a worker hung when every such line reads 1;
the job is hung when all workers stay hung for more than 5 minutes. Hence:
- values are written as integers (`1`, not prometheus-client's `1.0`, whose last digits are 0)
  and without timestamps;
- there is one line per local rank, alive or not (an ended rank is not hung);
- with no rank to report there is still one line, reading 0: a page without the gauge would
  count as "all lines hung" (zero of zero).
Labels are xpu_timer's: `ip` (POD_IP), `pod_name` (POD_NAME), `job_name`
(ENV_ARGO_WORKFLOW_NAME, else our job name), `rank`, `local_rank`; unset ones read NOT_SET as in
xpu_timer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diag.agent.metrics.families import XPU_TIMER_HANG
from diag.agent.metrics.rankstate import RankMetrics

NOT_SET = "NOT_SET"
PORT_ENV = "XPU_TIMER_PORT"
DEFAULT_PORT = 18889  # xpu_timer's default Prometheus port


@dataclass(frozen=True)
class XpuTimerIdentity:
    ip: str = NOT_SET
    pod_name: str = NOT_SET
    job_name: str = NOT_SET

    @classmethod
    def from_env(cls, env: Mapping[str, str], job: str | None) -> XpuTimerIdentity:
        return cls(
            ip=env.get("POD_IP") or NOT_SET,
            pod_name=env.get("POD_NAME") or NOT_SET,
            job_name=env.get("ENV_ARGO_WORKFLOW_NAME") or job or NOT_SET,
        )


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _line(ident: XpuTimerIdentity, rank: str, local_rank: str, hung: bool) -> str:
    labels = {
        "ip": ident.ip,
        "job_name": ident.job_name,
        "local_rank": local_rank,
        "pod_name": ident.pod_name,
        "rank": rank,
    }
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{XPU_TIMER_HANG.name}{{{text}}} {int(hung)}"


def render(ident: XpuTimerIdentity, ranks: Sequence[RankMetrics]) -> str:
    """The gauge in the Prometheus text format (0.0.4), ready to append to a scrape."""
    lines = [
        f"# HELP {XPU_TIMER_HANG.name} {XPU_TIMER_HANG.help}",
        f"# TYPE {XPU_TIMER_HANG.name} gauge",
    ]
    if ranks:
        lines += [_line(ident, str(r.rank), str(r.local_rank), r.hung) for r in ranks]
    else:
        lines.append(_line(ident, NOT_SET, NOT_SET, False))
    return "\n".join(lines) + "\n"
