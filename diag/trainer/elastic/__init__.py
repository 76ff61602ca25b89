"""Elastic batch sizes (one global batch at every allowed world size) and loading a checkpoint at
another data-parallel size.

May import: formats, trainer.attach (the load phase), trainer.graceful.
"""
