"""`jdist launch`: the agents, the rendezvous and its transport, the failure
classification and the job's environment. It imports nothing but Python's
standard library, so that the launcher never loads JAX."""
