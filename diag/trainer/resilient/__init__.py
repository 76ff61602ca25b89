"""In-place recovery: after a fault the surviving ranks keep their processes, form the next
generation of the world and run the training function again from the newest step every rank
holds in memory.

May import: trainer.attach, trainer.control, trainer.flash.
"""

from diag.trainer.resilient.membership import Interrupted, RecoveryError
from diag.trainer.resilient.recovery import Policy
from diag.trainer.resilient.wrapper import World, interrupt, resilient

__all__ = ["Interrupted", "Policy", "RecoveryError", "World", "interrupt", "resilient"]
