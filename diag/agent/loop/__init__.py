"""The agent's loop: start-up, the observe-decide-act loop, the executor of the core's
actions and the wiring of replication.
May import: formats, proto, every other sub-room of the agent.
"""
