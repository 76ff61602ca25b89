"""A DeepSpeed job saves and leaves when told to go: the stop flag, the save on the way out, and
leaving the process safely.

May import: formats, trainer.control, trainer.stephooks.
"""
