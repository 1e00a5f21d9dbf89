"""The runtime inside each process of a run: `jdist.initialize`'s `Runtime`,
cluster resolution, the monitor thread, health reports to the launcher's
agent, and the program check."""
