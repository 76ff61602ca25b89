"""Who the agent is while it works. A root agent whose ranks run as another user keeps root for
one thing only, attaching py-spy to a proven rank, in a small helper started before anything
else; the agent itself then becomes the ranks' user, so the kernel holds everything it does in
the run directory, the save directory, the timeline and its replica store to what that user may
do, whatever a path there was renamed to.

`stance` is pure (who the agent is and whom its ranks run as, in; what it becomes, out); `drop`
changes the process's credentials; `dumper` is the helper's loop, `dumpwire` its messages and
`helperspy` the agent's end of it; `statedir` is the agent's own directory and its lock.
May import: formats, agent.observe (the rank proof), agent.evidence (py-spy).
"""
