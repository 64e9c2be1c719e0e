"""shape rules (being written)."""

RULES = ()
