"""The collector runs inside each training rank and records what the rank does: every collective
and point-to-point op (torch.distributed hooks), the device-side timing of CUDA works, the
completion of CPU works, and the rank's flight recorder served on the agent's request.

Owns: instrumentation of torch.distributed inside the rank.
May import: formats (the journal it writes), proto. Never agent, viewer, cli: it runs in the
trainer's process.
"""
