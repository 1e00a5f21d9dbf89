"""Sending each process's part of an in-memory snapshot to the next process.

So that a snapshot outlives a host, process k's part is also held by process
(k+1) mod n, which writes it next to its own part, on its own host, as the
replica of process k (`snapshots.py`). The bytes go through the JAX runtime,
as one jitted collective over a mesh of one device per process: each process
packs the blocks of its part that the next process does not hold itself (of
the state's addressable shards, one copy of each, as raw bytes) into one
buffer on its first device, and a `ppermute` inside `jax.shard_map` moves
every buffer to the next process's device. Every process sends once to one
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
that computed it, and read back on the host when the part is written, so the
loop does not wait for it.

Example:
  >>> import jax.numpy as jnp
  >>> from jdist._src.checkpoint.peer_copy import PeerCopy
  >>> PeerCopy.for_this_job() is None  # one process: no peer
  True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_AXIS = "process"


# The unsigned type of each width under a byte (int4, float4_e2m1fn, ...).
_NARROW = {2: jnp.uint2, 4: jnp.uint4}


def _as_bytes(x) -> jax.Array:
  """`x`'s raw bytes, as numpy's `.view(np.uint8)` of it gives them.

  numpy (ml_dtypes) stores a value of a type under a byte wide (int4, uint4,
  int2, float4_e2m1fn) in a byte of its own, its bits in the low bits and
  zeros above: its bits as the unsigned type of its width, widened to uint8.
  """
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)  # one byte, 0 or 1, as numpy stores it
  elif bits < 8:
    if bits not in _NARROW:
      raise TypeError(f"a snapshot cannot copy {x.dtype} values ({bits} bits "
                      "each) to the next process; keep such leaves whole on "
                      "every device (not split).")
    x = lax.bitcast_convert_type(x, _NARROW[bits]).astype(jnp.uint8)
  elif x.dtype != jnp.uint8:
    x = lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(-1)


@functools.partial(jax.jit, static_argnums=1)
def _pack(blocks: list, length: int) -> jax.Array:
  """The blocks' bytes end to end, padded with zeros to `length`."""
  data = [_as_bytes(b) for b in blocks]
  used = sum(d.size for d in data)
  data.append(jnp.zeros(length - used, jnp.uint8))
  return jnp.concatenate(data)


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

  def send(self, blocks: list, length: int) -> jax.Array:
    """Dispatches the copy of `blocks` (this process's, as arrays on its
    devices or on the host) to the next process (every process calls it,
    with the same `length`, at least the bytes of every process's blocks).

    Returns:
      The `length` bytes the process before this one sent, on this
      process's device (read them with `np.asarray`, which waits for them).
    """
    moved = [jax.device_put(b, self.device) for b in blocks]
    mine = _pack(moved, max(int(length), 1))
    whole = jax.make_array_from_single_device_arrays(
        (self.world * mine.shape[0],), self._sharding, [mine])
    received = self._shift(whole).addressable_data(0)
    received.copy_to_host_async()
    return received
