"""index_put rules (being written)."""

RULES = ()
