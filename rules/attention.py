"""attention rules (being written)."""

RULES = ()
