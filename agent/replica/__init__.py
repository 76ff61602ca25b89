"""Replicas of flash checkpoints across nodes: each node's newest complete snapshot also lives in
the memory of the next nodes of a ring, so a node that comes back empty restores its ranks from a
peer's memory instead of from storage.

`ring` is pure (placement and choices); `wire` the protocol between agents (TCP), `store` the
replicas a node holds for its peers, `source` what a node sends of its own slots, `transport` the
server and the client.
May import: formats.
"""
