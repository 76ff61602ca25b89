"""Trainer-side API of diag: attach the collector, phases and steps, flash checkpoints.
Never imports diag.agent."""

from diag.trainer.attach import Session, attach, current, mark, phase, step
from diag.trainer.flash import FlashCheckpointer, FlashCheckpointError, FlashStats
from diag.trainer.teardown import exit_process

__all__ = [
    "FlashCheckpointError",
    "FlashCheckpointer",
    "FlashStats",
    "Session",
    "attach",
    "current",
    "exit_process",
    "mark",
    "phase",
    "step",
]
