"""Protocol definitions and generated gRPC stubs of the agent's control channel."""
