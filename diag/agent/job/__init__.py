"""One verdict per incident for the whole job, agreed through the shared timeline volume: each
node's view of its ranks, how incidents group, and the verdict's files.

`decisions` is pure; `link`, `verdict` and `files` are the adapters.
May import: formats, agent.detect, agent.evidence (the IncidentReport).
"""
