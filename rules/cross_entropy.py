"""cross_entropy rules (being written)."""

RULES = ()
