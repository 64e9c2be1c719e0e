"""norms rules (being written)."""

RULES = ()
