"""Evidence of an incident, captured once before anything is killed: every local rank's Python and
native stacks (py-spy), journal tails, flight recorders and a machine snapshot, written into an
incident directory.

May import: formats, agent.detect, agent.observe.
"""
