"""The diag agent: a per-node sidecar that watches the ranks' op journals and acts on hangs.

Rooms: `detect` (the pure hang core), `observe` (journals and processes into an Observation),
`evidence` (stacks, journals and flight recorders of an incident), `job` (one verdict for the whole
job), `taint` (node taints with evidence), `health` (the node's own monitors), `drain` (SIGTERM and
preemption notices), `checkpoint` (persisting flash checkpoints), `metrics` (Prometheus),
`precheck` (network and device checks before training). `daemon` is the loop that ties them.

May import: formats, proto. Never collector, trainer, viewer or cli.
"""
