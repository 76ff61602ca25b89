"""The formats that several packages share, and nothing else: the op journal and its meta, the
run directory, flash-checkpoint slots and snapshots, stack dumps, incident directories, exit codes,
and the one way to read and write files another process could have touched (`untrusted`).

Owns: on-disk and in-memory formats, their parsers into our types, their size caps.
May import: the standard library and third-party parsers only (never agent, collector, trainer,
viewer or cli): the trainer, the agent and the viewer all import it.
"""
