"""`diag launch`'s entry: torchrun's arguments turned into torchrun's own launch configuration
(torch.distributed.run parses them, so they mean what they mean there), then the rendezvous
handler and worker spec as torchrun makes them, run by diag's agent (diag.launch.agent)."""

from __future__ import annotations

import logging
import signal
import uuid
from dataclasses import dataclass
from types import FrameType
from typing import Any

from diag.formats.exitcodes import UsageError
from diag.launch import workerpolicy as core

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchArgs:
    """What `diag launch` was given: torchrun's options as torchrun's command line, the script
    and its arguments, the spares per node."""

    torchrun: list[str]
    script: str
    script_args: list[str]
    spares: int
    standalone: bool
    spare_delay: float = 15.0


def launch(a: LaunchArgs) -> int:
    """Runs the job to its end; the exit code torchrun would give (0, or 1 when it failed)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    try:
        config = _config(torchrun, a)
    except (ValueError, AssertionError, SystemExit) as e:  # torchrun's own checks of its input
        raise UsageError(f"torchrun's arguments: {e or 'see diag launch --help'}") from None
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
        run_id=config.run_id or str(uuid.uuid4().int), min_nodes=config.min_nodes,
        max_nodes=config.max_nodes, local_addr=config.local_addr, **config.rdzv_configs,
    )  # fmt: skip
    master_addr, master_port = _static_master(params)
    spec = _spec(config, a, rdzv_registry.get_rendezvous_handler(params), master_addr,
                 master_port)  # fmt: skip
    return _run(spec, core.Policy(spares=a.spares, spare_delay_s=a.spare_delay), SignalException)


def _config(torchrun: Any, a: LaunchArgs) -> Any:
    """torchrun's LaunchConfig from torchrun's parser, with its defaults for one node."""
    args = torchrun.get_args_parser().parse_args([*a.torchrun, a.script, *a.script_args])
    if a.standalone:  # a store of its own on this node, as torchrun --standalone
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, most = torchrun.parse_min_max_nnodes(args.nnodes)
        if most == 1:  # one node and no port named: torchrun takes a free one through c10d
            args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    return config


def _static_master(params: Any) -> tuple[str | None, int | None]:
    """The static rendezvous's store address (its endpoint), as torchrun reads it; None else."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    if params.backend != "static":
        return None, None
    addr, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    return addr, (None if port == -1 else port)


def _spec(config: Any, a: LaunchArgs, handler: Any, master_addr: str | None,
          master_port: int | None) -> Any:  # fmt: skip
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    return WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, rdzv_handler=handler,
        entrypoint=a.script, args=tuple(a.script_args), max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=master_addr,
        master_port=master_port, local_addr=config.local_addr,
    )  # fmt: skip


def _run(spec: Any, rules: core.Policy, signal_exception: Any) -> int:
    from diag.launch.agent import SpareAgent

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise signal_exception(f"diag launch got signal {signum}", signal.Signals(signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    agent = SpareAgent(spec, rules)
    handler = spec.rdzv_handler
    keep_rendezvous = False
    try:
        result = agent.run()
    except signal_exception as e:  # the agent has stopped the workers and spares
        keep_rendezvous = True  # as torchrun: a signalled agent leaves the rendezvous open
        log.warning("diag launch: stopped by signal %d", int(e.sigval))
        return 128 + int(e.sigval)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if not keep_rendezvous:
            handler.shutdown()
    return 1 if result.is_failed() else 0  # the agent has logged why
