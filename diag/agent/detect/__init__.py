"""The hang core, pure: an Observation (plain data, `now` passed in) in, a Verdict and its actions
out. Timeouts, culprit rules, the wait-for graph, deadlocks, stragglers, ranks that left.

Owns: the decisions only; no files, processes, clocks or logging.
May import: formats (its pure modules).
"""
