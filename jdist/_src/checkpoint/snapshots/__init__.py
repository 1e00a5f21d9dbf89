"""In-memory snapshots of a train state: `CheckpointManager`'s fast tier.

Each host holds its processes' parts and the replicas of the processes
before them, so a snapshot survives the loss of one host.
"""

from jdist._src.checkpoint.snapshots.files import say
from jdist._src.checkpoint.snapshots.store import Snapshots

__all__ = ["Snapshots", "say"]
