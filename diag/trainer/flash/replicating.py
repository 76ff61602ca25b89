"""This rank's side of replication rounds (the decisions are trainer.flash.replicarounds): what its agent
said about its node's holders, its vote at each save, the steps its slots keep.

The agent says it over the control channel (a ReplicaAck when the rank subscribes, and whenever
every holder of the node took a newer round step); that arrives on the control thread, while the
votes and the rounds belong to the training thread.
"""

from __future__ import annotations

import logging
import threading

from diag.trainer.control.message import ReplicaAck
from diag.trainer.flash.replicarounds import Agreed, Rounds, Vote, advance, resumed, vote
from diag.trainer.flash.slots import RankSlots

log = logging.getLogger(__name__)

ROUND_SLOTS = 3  # the kept step, the round step, and one for the newest snapshot at least


class Replication:
    def __init__(self, slots: RankSlots, run: str) -> None:
        self.slots = slots
        self.run = run
        self.rounds = Rounds()
        self._on = False
        self._confirmed: tuple[int, str] | None = None
        self._lock = threading.Lock()
        self._count = len(slots.paths) + 1  # beside its newest steps, the rounds' steps

    @property
    def on(self) -> bool:
        with self._lock:
            return self._on

    def acknowledged(self, ack: ReplicaAck) -> None:
        """The agent's word on replication (the control thread)."""
        with self._lock:
            if ack.on and not self._on:
                log.info("diag: the agent replicates this node's snapshots to peers")
            self._on = ack.on
            self._confirmed = (ack.step, ack.run) if ack.on and ack.step >= 0 else None

    def prepare(self) -> None:
        """Before a save takes a slot: a node that replicates keeps one more, and so does a rank
        in a round (the job's other nodes replicate) whose own agent has not said so yet: its
        two slots both kept (the round step and the one resumed from), every save would be
        skipped on every rank, and the rounds, which move only at a save, would never free them."""
        if self.on or self.rounds.current is not None:
            self.slots.ensure(max(self._count, ROUND_SLOTS))

    def vote(self) -> Vote:
        with self._lock:
            on, confirmed = self._on, self._confirmed
        current = self.rounds.current
        holds = current is not None and current in self.slots.complete()
        return vote(self.rounds, replicating=on, confirmed=confirmed, run=self.run,
                    holds_current=holds)  # fmt: skip

    def agreed(self, step: int, agreed: Agreed) -> bool:
        """The ranks agreed at the save of `step`; True when it is a round step (to be sent)."""
        before = self.rounds
        self.rounds, is_round = advance(before, step, agreed)
        if is_round and agreed.any_abandon and not agreed.all_ready:
            log.warning(
                "diag: replication round of step %s abandoned (a rank lost its snapshot of it); "
                "step %d starts the next, step %s stays kept", before.current, step, before.kept,
            )  # fmt: skip
        self.slots.keep = self.rounds.keep()
        return is_round

    def resumed(self, step: int | None, from_memory: bool) -> None:
        self.rounds = resumed(step, from_memory)
        self.slots.keep = self.rounds.keep()
