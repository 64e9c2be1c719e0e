"""A zoo of flax models written the way public flax code writes them (no spmdkit in them)."""
