"""jdist internals: one concept per module; the public API is `jdist`."""
