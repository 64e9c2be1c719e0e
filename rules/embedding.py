"""embedding rules (being written)."""

RULES = ()
