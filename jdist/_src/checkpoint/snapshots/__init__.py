"""In-memory snapshots of a train state: `CheckpointManager`'s fast tier.

One concept per module: `naming.py` (the files' names), `layout.py` (which
blocks each process writes, and the program that packs them), `files.py`
(a file's format, its CRC-32, writing and reading it), `writer.py` (the
background thread that writes), `retention.py` (which files are kept, and
the spare the next snapshot is written over), `agreement.py` (which
snapshot every process restores, and reading it), and `store.py`
(`Snapshots`, which ties them together for a manager).

What survives: on one machine, every process's part is in the one /dev/shm,
so a process that dies leaves its part to its successor (a process killed
before its writer renamed its file, a few milliseconds after the `save`
that handed it over, leaves that snapshot to its replica, in the next
process's file, or to the one before). Across hosts, each host holds its
own processes' parts and the replicas of the processes before them: a host
that goes away takes its parts with it, and the next host's replicas stand
in for them, so the job resumes from memory on the hosts that are left.
Two neighbouring hosts (in process order) that go away together take a part
and its replica: the snapshot is incomplete, and the job resumes from the
persistent directory. The copies hold what the next process lacks: with a
replicated (mirrored) state, nothing (the replica is a line of the header);
with state split over the processes, each process's blocks once.
"""

from jdist._src.checkpoint.snapshots.files import say
from jdist._src.checkpoint.snapshots.store import Snapshots

__all__ = ["Snapshots", "say"]
