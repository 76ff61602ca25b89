"""Trainer-side API of diag: attach the collector, phases and steps, flash checkpoints.
Elsewhere in the package: diag.trainer.elastic (elastic batch config), diag.trainer.reshard
(resume at another data-parallel size), diag.trainer.drain (the stop flag), diag.trainer.hf
(HuggingFace Trainer callbacks), diag.trainer.graceful (save and leave on a stop request). Never
imports diag.agent."""

from diag.trainer.attach import Session, attach, current, mark, phase, step
from diag.trainer.flash import FlashCheckpointer, FlashCheckpointError, FlashStats
from diag.trainer.graceful import GracefulExit, graceful_exit
from diag.trainer.teardown import exit_process

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
