"""Trainer-side API of diag: attach the collector, phases and steps. Never imports diag.agent."""

from diag.trainer.attach import Session, attach, current, mark, phase, step

__all__ = ["Session", "attach", "current", "mark", "phase", "step"]
