"""Sending each process's part of an in-memory snapshot to the next process.

So that a snapshot outlives a host, process k's part is also held by process
(k+1) mod n, which writes it after its own part, in its own file on its own
host, as the replica of process k (`snapshots/`). The bytes go through the JAX runtime,
as one jitted collective over a mesh of one device per process: each process
has packed the blocks of its part that the next process does not hold itself
(of the state's addressable shards, one copy of each, as raw bytes) into one
buffer on its first device (`packing.py`, in the program that packs its
part), and a `ppermute` inside `jax.shard_map` moves every buffer to the next
process's device (or, when the state lies on a mesh of one device per
process, the same `ppermute` inside the program that packs it,
`packing.packer_across`). Every process sends once to one
peer and receives once: the cost is at most the size of a part per process
and per snapshot, over the interconnect the training collectives use,
whatever the number of processes; with a replicated (mirrored) state the
next process holds every block already, and nothing is sent.

The distributed client's key-value store was the other way: it needs no
device memory, but every value goes through the coordinator, one process,
which would hold all the parts of every snapshot (the whole state, for a
sharded one) and ship them in messages of bounded size. It serves the
agreement on which snapshot is complete (a few bytes per process), not the
data.

The buffers are the size of the largest copy (known on every process from the
state's shardings, so nothing is exchanged first), on one device per process,
for the time of one copy: a snapshot briefly needs that much more device
memory. The copy is dispatched when the snapshot is taken, after the step
that computed it, and read back on the host by the writer thread when it
writes the replica, so the loop does not wait for it.

Example:
  >>> import jax.numpy as jnp
  >>> from jdist._src.checkpoint.peer_copy import PeerCopy
  >>> PeerCopy.for_this_job() is None  # one process: no peer
  True
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_AXIS = "process"


class PeerCopy:
  """Moves each process's bytes to the next process (one collective).

  Args:
    devices: one device of each process, in the order of the processes.
    rank: this process's index.
  """

  def __init__(self, devices: list, rank: int):
    self.world = len(devices)
    self.rank = rank
    self.device = devices[rank]
    mesh = Mesh(np.array(devices), (_AXIS,))
    self._sharding = NamedSharding(mesh, P(_AXIS))
    perm = [(k, (k + 1) % self.world) for k in range(self.world)]
    self._shift = jax.jit(jax.shard_map(
        lambda x: lax.ppermute(x, _AXIS, perm), mesh=mesh,
        in_specs=P(_AXIS), out_specs=P(_AXIS)))

  @classmethod
  def for_this_job(cls) -> "PeerCopy | None":
    """The copier over the first device of each process, or None in a job
    of one process."""
    if jax.process_count() == 1:
      return None
    first: dict = {}
    for device in jax.devices():
      first.setdefault(device.process_index, device)
    return cls([first[p] for p in range(jax.process_count())],
               jax.process_index())

  def send(self, packed: jax.Array) -> jax.Array:
    """Dispatches the copy of `packed` (this process's bytes for the next
    process, on this process's device `device`, as `packing.packer` makes
    them; every process sends as many) to the next process (every process
    calls it).

    Returns:
      The bytes the process before this one sent, on this process's device
      (read them with `np.asarray`, which waits for them).
    """
    whole = jax.make_array_from_single_device_arrays(
        (self.world * packed.shape[0],), self._sharding, [packed])
    return self._shift(whole).addressable_data(0)
