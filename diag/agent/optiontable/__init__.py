"""Option tables: each option's flag, environment variable and TOML key, read in that
order of precedence and parsed into typed values.
May import: formats, agent.node (sizes parse as the node's units do).
"""
