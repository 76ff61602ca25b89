"""The collector runs inside the trainer and records every collective, step and phase of a
rank into its op journal. This package imports no torch at module level: the agent reads
journals with it."""
