"""Replicas of flash checkpoints across nodes: each node's newest complete snapshot also lives in
the memory of the next nodes of a ring, so a node that comes back empty restores its ranks from a
peer's memory instead of from storage.

Pure: `ring` (placement and choices), `auth` (the proofs of the job's token), `admission` (whom
the server keeps waiting and serves), `handover`, `pace`. Adapters: `wire` the protocol between
agents (TCP), `handshake` its authentication, `holder` the server, `transport` the client calls,
`deadline` whole-call deadlines, `tls` the optional TLS, `store` the replicas a node holds for its
peers, `source` what a node sends of its own slots and installs back.
May import: formats.
"""
