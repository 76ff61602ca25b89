"""How much of its own output the agent keeps: the decision (pure) and the pruning.
May import: formats.
"""
