"""`diag precheck`: device, compute and network checks before training that name bad nodes.

The pure core (`evidence`, `rounds`, `classify`, `report`) holds no I/O and never imports
torch; `measure`, `devicehealth` and `session` are the adapters at the edge (the NIC probe is
the node's: agent.node).

May import: formats, agent.node.
"""
