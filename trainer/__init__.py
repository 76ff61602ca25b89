"""Trainer-side API of diag: attach the collector, flash checkpoints, graceful exit."""
