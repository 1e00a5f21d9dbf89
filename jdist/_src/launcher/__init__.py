"""`jdist launch`: standard library only, so the launcher never loads JAX."""
