"""What runs inside each process of a run: `jdist.initialize`'s `Runtime`."""
