"""Reference flax models with logical axis names and no sharding code (to come)."""
