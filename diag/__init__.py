"""diag: fault tolerance and diagnostics for distributed PyTorch/DeepSpeed training.

The rooms: `formats` (what the parts exchange), `proto` (gRPC stubs), `collector` and
`trainer` (inside the ranks), `agent` (the node sidecar), `viewer` (`diag merge`), `cli` (the
`diag` command). docs/architecture.md draws them.
"""
