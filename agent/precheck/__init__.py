"""`diag precheck`: device, compute and network checks before training that name bad nodes.

The pure core (`evidence`, `rounds`, `classify`, `report`) holds no I/O and never imports
torch; `measure`, `devicehealth`, `nic` and `session` are the adapters at the edge.

May import: formats.
"""
