"""Where journals live and who this process is: read from the environment the launchers set.

torchrun, the deepspeed launcher and dlrover-run all export RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE; the agent and the trainer agree on the directory through DIAG_RUN_DIR (in a pod:
an emptyDir shared by the trainer and the sidecar, ideally memory-backed).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diag.formats.journalmeta import safe_job_name

RUN_DIR_ENV = "DIAG_RUN_DIR"
CONTROL_SUFFIX = ".control.sock"
ANY_JOB_SOCKET = "diag" + CONTROL_SUFFIX


def default_run_dir(env: Mapping[str, str] = os.environ) -> Path:
    """DIAG_RUN_DIR, else a directory in /dev/shm (journals are mmapped: tmpfs keeps them off disk),
    else the temp directory. Agent and trainer use the same rule, so they meet without config."""
    if env.get(RUN_DIR_ENV):
        return Path(env[RUN_DIR_ENV])
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return Path("/dev/shm/diag")
    return Path(os.environ.get("TMPDIR", "/tmp")) / "diag"


def make_run_dir(path: Path) -> None:
    """Creates a missing run directory private (0700, whatever the umask): whoever can write it
    could plant journals and slots that the agent acts on. An existing one is left as it is:
    the agent judges it (diag/agent/observe/rundircheck.py)."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return  # made meanwhile by another rank or the agent
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def job_name(env: Mapping[str, str] = os.environ) -> str:
    for key in ("DIAG_JOB", "ELASTIC_JOB_NAME", "DLROVER_JOB_NAME", "TORCHELASTIC_RUN_ID"):
        value = env.get(key, "")
        if value and value != "none":
            return value
    return "job"


def control_socket_path(run_dir: Path, job: str | None) -> Path:
    """Where an agent serves its control channel: per job when it watches one job, else one
    socket for every job in the run directory."""
    return run_dir / (f"{safe_job_name(job)}{CONTROL_SUFFIX}" if job else ANY_JOB_SOCKET)


def control_socket_candidates(run_dir: Path, job: str) -> list[Path]:
    """Where a rank looks for its agent, best first."""
    return [control_socket_path(run_dir, job), control_socket_path(run_dir, None)]


def pid_namespace(pid: int | None = None) -> int:
    """The inode of a process's PID namespace (this process's by default), 0 when unreadable.
    Processes with the same one see each other's PIDs: the agent can watch a trainer whose
    namespace is its own, and a PID of that namespace it cannot see is a process that is gone."""
    try:
        return os.stat(f"/proc/{pid or 'self'}/ns/pid").st_ino
    except OSError:
        return 0


def node_name(env: Mapping[str, str] = os.environ) -> str:
    return env.get("DIAG_NODE") or env.get("NODE_NAME") or socket.gethostname()


# What dlrover-run's elastic agent gives its workers (the master it reports to, its parallelism
# config); not any DLROVER_* variable: DLRover's own settings (DLROVER_EVENT_FILE_DIR, ...) may be
# set for a pod whatever launcher it runs.
DLROVER_WORKER_ENV = ("DLROVER_MASTER_ADDR", "DLROVER_PARAL_CONFIG_PATH")


def launcher_name(env: Mapping[str, str] = os.environ) -> str:
    if any(k in env for k in DLROVER_WORKER_ENV):
        return "dlrover-run"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "CROSS_RANK" in env or "DEEPSPEED_LAUNCHER" in env:
        return "deepspeed"
    return "unknown"


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    attempt: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RankIdentity:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise RuntimeError(
                f"diag: {', '.join(missing)} not set; start the job with torchrun, the deepspeed "
                "launcher or dlrover-run, or call attach() after init_process_group()"
            )
        world = int(env["WORLD_SIZE"])
        return cls(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or world),
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        )
