"""The rank's end of the agent's control channel: the gRPC client on a unix socket, the checks of
the peer and of every message, and the step-boundary agreement on commands.

May import: formats, proto, collector.
"""
