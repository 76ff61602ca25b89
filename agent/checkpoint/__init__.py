"""Flash checkpoints on the agent side: persisting snapshots, the control channel, cleanup."""
