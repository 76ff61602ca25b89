"""The agent's drain on SIGTERM or an early preemption notice: the pure plan (`plan`), the executor
that carries it out, and the notice watcher.

May import: formats, agent.observe, agent.checkpoint.
"""
