"""The agent's configuration: its options (flag > environment > TOML) gathered from every
sub-room's settings into one `AgentSettings`.
May import: formats, agent.detect, agent.observe, agent.checkpoint, agent.replica,
agent.drain, agent.metrics, agent.taint, agent.health, agent.precheck, agent.node,
agent.optiontable,
agent.retention.
"""
