"""Trainer-side API of diag: attach the collector, phases and steps, flash checkpoints, graceful
exit, elastic batch sizes.

Rooms: `control` (the rank's end of the agent's control channel), `flash` (flash checkpoints in
shared memory), `graceful` (save and leave when told to go), `elastic` (batch sizes and resharding).
`stephooks` holds the one patch of a DeepSpeed engine's `step` that attach, flash and graceful run in.
May import: collector, formats, proto. Never agent, viewer or cli.
"""

from diag.trainer.attach import Session, attach, current, mark, phase, step
from diag.trainer.flash.checkpointer import FlashCheckpointer, FlashCheckpointError, FlashStats
from diag.trainer.graceful.gracefulexit import GracefulExit, graceful_exit
from diag.trainer.graceful.teardown import exit_process

__all__ = [
    "FlashCheckpointError",
    "FlashCheckpointer",
    "FlashStats",
    "GracefulExit",
    "Session",
    "attach",
    "current",
    "exit_process",
    "graceful_exit",
    "mark",
    "phase",
    "step",
]
