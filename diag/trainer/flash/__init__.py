"""Flash checkpoints: DeepSpeed checkpoints captured in memory, copied into shared-memory slots the
agent persists, and loaded back from them.

May import: formats, proto, trainer.control, trainer.graceful, trainer.elastic, trainer.attach,
trainer.stephooks.
"""
