"""Operator tools: the ``rollout`` command, the demo, the embedded Redis, archive and replay,
and the read-only inspection views (status, tail, pool). They sit on top of the actors and
the projections; nothing in the engine imports them."""
