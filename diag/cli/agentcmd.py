"""`diag agent`: the per-node sidecar. Its options (agent/config), its start-up in the order
that keeps privilege where it is needed (agent/loop/startup.py), then the agent's loop until a
signal, the end of the job or an incident (`--until`)."""

from __future__ import annotations

import argparse
import signal
import time
from types import FrameType

from diag.agent.config import agentconfig
from diag.agent.drain.plan import DrainRequest
from diag.agent.loop.daemon import Agent
from diag.agent.loop.startup import AgentStart


def add_arguments(parser: argparse.ArgumentParser) -> None:
    agentconfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = agentconfig.load(args)
    with AgentStart(cfg) as start:
        agent = Agent(
            start.cfg,
            start.owners,
            launcher=start.launcher,
            metrics_listener=start.metrics_listener,
            kube_api=start.kube_api,
            exclusive=True,
        )

        def on_signal(signum: int, frame: FrameType | None) -> None:
            # Only flags here: the agent's loop logs and acts.
            if signum == signal.SIGTERM and agent.drainer is not None:
                agent.request_drain(DrainRequest("SIGTERM", time.monotonic()))
            else:
                agent.request_stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        return agent.run()
