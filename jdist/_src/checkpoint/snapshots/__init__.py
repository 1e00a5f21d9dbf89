"""In-memory snapshots of a train state: `CheckpointManager`'s fast tier.

Each host holds its processes' parts and the replicas of the processes
before them, so a snapshot survives the loss of one host (the next host's
replicas stand in); two hosts adjacent in process order lost together take
a part and its replica, and the job resumes from the persistent directory.
"""

from jdist._src.checkpoint.snapshots.files import say
from jdist._src.checkpoint.snapshots.store import Snapshots

__all__ = ["Snapshots", "say"]
