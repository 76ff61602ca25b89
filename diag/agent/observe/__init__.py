"""Turns what the node shows into the detection core's Observation: the ranks' journals in the run
directory, read as untrusted input, each rank's process proven before it is believed, and the
container's limits.

Owns: reading journals and /proc; the run directory's trust check.
May import: formats, agent.detect (the Observation types).
"""
