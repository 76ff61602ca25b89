"""Flash checkpoints on the agent side: persisting snapshots, the control channel, cleanup.

May import: formats, proto, agent.observe.
"""
