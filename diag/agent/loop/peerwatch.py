"""The claimant's probes of its peers' agents for the job verdict of a death (job/silence.py
decides): the peers this node exchanges replicas with (those whose replicas it holds, and those
that hold its own), each asked once per look whether its agent answers, as the handover asks.

Only those: a look costs one connection per neighbour in the ring, whatever the job's size."""

from __future__ import annotations

import time
from collections.abc import Callable

from diag.agent.job.silence import PeerLook
from diag.agent.replica.handover import Reach, next_reach
from diag.agent.replica.handshake import NotAuthenticated
from diag.agent.replica.replicator import Replicator
from diag.agent.replica.transport import ask_offer
from diag.formats.untrusted import UntrustedInput

PROBE_TIMEOUT_S = 5.0  # a peer's agent that does not accept within this is silent
# A reach not probed for this long is forgotten: the peer may have come back and gone again
# since, and its silence counts from the next probe that finds it so.
STALE_S = 30.0


def agent_answers(replicator: Replicator, peer: str) -> bool:
    """Whether the peer's agent answers a replica offer (refusing counts: it is there)."""
    return probe_agent(replicator, peer)[0]


def probe_agent(replicator: Replicator, peer: str) -> tuple[bool, float | None]:
    """Whether the peer's agent answers a replica offer (refusing counts: it is there), and
    when it started, if it said (an agent of an older version, or a refusal, does not)."""
    timeout = min(PROBE_TIMEOUT_S, replicator.settings.timeout)
    try:
        offer = ask_offer(replicator.peers, peer, timeout=timeout)
    except NotAuthenticated:
        return False, None  # whatever answers there is not an agent of the job
    except UntrustedInput:
        return True, None  # the peer's agent answered, if only to refuse
    except OSError:
        return False, None
    return True, offer.agent_started or None


class PeerWatch:
    """Called at each look of a claimant: one probe per neighbour, its reach kept between looks
    (a peer's silence counts from the first probe that found it silent)."""

    def __init__(
        self,
        replicator: Replicator,
        *,
        probe: Callable[[str], tuple[bool, float | None]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.replicator = replicator
        self.probe = probe or (lambda peer: probe_agent(replicator, peer))
        self.clock = clock
        self._reach: dict[str, Reach] = {}
        self._probed: dict[str, float] = {}

    def neighbours(self) -> list[str]:
        r = self.replicator
        ring = r.peers.ring
        names = [*ring.held_by(r.node), *r.holders]
        return [n for n in dict.fromkeys(names) if n != r.node and n in r.peers.addresses]

    def __call__(self) -> list[PeerLook]:
        out = []
        store = self.replicator.store
        for peer in self.neighbours():
            held = store.held(peer) if store is not None else None
            ranks = tuple(held.manifest.ranks) if held is not None else ()
            answers, started = self.probe(peer)
            now = self.clock()
            before = self._reach.get(peer)
            if now - self._probed.get(peer, now) > STALE_S:
                before = None
            reach = self._reach[peer] = next_reach(before, answers, now)
            self._probed[peer] = now
            out.append(PeerLook(peer, ranks, reach.answers, reach.since, started))
        return out
