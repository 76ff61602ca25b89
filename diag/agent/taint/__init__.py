"""Node taints with evidence: the evidence sources (incidents, GPU health, node monitors), the pure
planner (`planner`, `model`), the job's taint ledger, and the Kubernetes adapter that applies a plan.

May import: formats, agent.detect, agent.evidence, agent.job, agent.precheck, agent.node, agent.optiontable,
agent.retention. `planner` and `model` are pure.
"""
