"""The node's own health, watched as node-problem-detector watches a node: monitors, each a check
with a verdict, and the loop that asks them.

May import: formats, agent.taint (its evidence model, planner and settings), agent.node.
"""
