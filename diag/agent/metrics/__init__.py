"""The agent's Prometheus metrics: families (declared in `families`), the exporter the loop
feeds, the `/metrics` server, and the adapters for host, GPU, checkpoint and precheck facts.

May import: formats, agent.detect, agent.evidence, agent.precheck.
"""
