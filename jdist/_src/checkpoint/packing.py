"""A process's blocks of a snapshot as bytes, in one program on one device.

A snapshot (`snapshots/`) needs the bytes of the blocks of the state this
process holds (its part, written to a file) and of those of them the next
process lacks (its copy, sent to it by `peer_copy.py`). Copying each leaf to
the host on its own costs a dispatch and a transfer per leaf, on the loop's
thread; here one jitted program concatenates the blocks' raw bytes into one
buffer (and the copy's, padded to the length every process sends, into a
second), so that a snapshot costs one dispatch, one transfer to the host and
one collective, whatever the number of leaves. The program is compiled once
per state layout. The buffers hold a copy of the blocks: a step that
donates the state's arrays after the snapshot is taken does not touch them
(the runtime runs the donating step after the program has read them). On an
accelerator they briefly need as much more device memory as the part.
Each buffer ends with one byte, 1 when none of the blocks' inexact values
is NaN or infinite (the writer of the snapshot checks that byte instead of
reading the values). When the state lies on a mesh of one device per
process, `packer_across` packs and copies to the next process in one
program over that mesh, which takes the leaves themselves: one dispatch per
snapshot, and no per-block array to take out of the leaves on the loop's
thread.

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> from jdist._src.checkpoint.packing import packer
  >>> mine, sent = packer(None, 0)([jnp.arange(2, dtype=jnp.int16)])
  >>> np.asarray(mine).tolist(), sent  # the bytes, then 1: all finite
  ([0, 0, 1, 0, 1], None)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

# The unsigned type of each width under a byte (int4, float4_e2m1fn, ...).
_NARROW = {2: jnp.uint2, 4: jnp.uint4}


def as_bytes(x) -> jax.Array:
  """`x`'s raw bytes, as numpy's `.view(np.uint8)` of it gives them.

  numpy (ml_dtypes) stores a value of a type under a byte wide (int4, uint4,
  int2, float4_e2m1fn) in a byte of its own, its bits in the low bits and
  zeros above: its bits as the unsigned type of its width, widened to uint8.
  A complex value is its real part, then its imaginary part.
  """
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)  # one byte, 0 or 1, as numpy stores it
  elif jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = lax.bitcast_convert_type(jnp.stack([x.real, x.imag], -1), jnp.uint8)
  elif bits < 8:
    if bits not in _NARROW:
      raise TypeError(f"a snapshot cannot hold {x.dtype} values ({bits} bits "
                      "each) split over the devices; keep such leaves whole "
                      "on every device (not split).")
    x = lax.bitcast_convert_type(x, _NARROW[bits]).astype(jnp.uint8)
  elif x.dtype != jnp.uint8:
    x = lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(-1)


def _joined(data: list, length: int | None = None) -> jax.Array:
  if length is not None:
    data = [*data, jnp.zeros(length - sum(d.size for d in data), jnp.uint8)]
  return jnp.concatenate(data) if data else jnp.zeros(0, jnp.uint8)


def finite_flag(blocks: list) -> jax.Array:
  """One byte: 1 when no inexact value of `blocks` is NaN or infinite, else
  0 (what the writer checks, without reading the values on the host)."""
  checks = [jnp.isfinite(b).all() for b in blocks
            if jnp.issubdtype(b.dtype, jnp.inexact) and b.size]
  ok = jnp.stack(checks).all() if checks else jnp.bool_(True)
  return ok.astype(jnp.uint8).reshape(1)


def pack(blocks: list, sent: list | None, length: int) -> tuple:
  """`(mine, copy)` of `blocks` (see `packer`), traced."""
  data = [as_bytes(b) for b in blocks]
  flag = finite_flag(blocks)
  copy = None if sent is None else jnp.concatenate(
      [_joined([data[i] for i in sent], length), flag])
  return jnp.concatenate([_joined(data), flag]), copy


def packer(sent: list | None, length: int):
  """The jitted program `blocks -> (mine, copy)` for one layout.

  Args:
    sent: the positions in `blocks` of those the next process lacks, in the
      order it expects them (None: no copy, in a job of one process).
    length: the bytes of the copy (every process's largest; zeros pad it).

  Returns:
    A function of a list of arrays on one device that returns their bytes
    end to end (`mine`), and those of `blocks[i]` for `i` in `sent`, padded
    to `length` (`copy`; None without `sent`), each followed by one byte,
    1 when no inexact value of `blocks` is NaN or infinite, else 0.
  """
  return jax.jit(lambda blocks: pack(blocks, sent, length))


def packer_across(mesh, specs: list, sent: list, length: int):
  """The jitted program `leaves -> mine + received` over `mesh`, which has
  one device per process: each device packs its blocks of `leaves` (sharded
  as `specs` say, one block per leaf) as `packer` does, and sends its copy
  to the device of the next process (a `ppermute` in the same program: one
  dispatch per snapshot for the packing and the copy).

  Args:
    mesh: the leaves' mesh, one device per process.
    specs: each leaf's `PartitionSpec` on `mesh`.
    sent: the positions of the blocks the next process lacks (the same on
      every process).
    length: the bytes of the copy.

  Returns:
    A function of the list of leaves that returns one array over `mesh`
    whose block on each device is its `mine`, then the copy the device of
    the process before it sent (each followed by its finite byte): one
    buffer for the writer to copy to the host.
  """
  axes = tuple(mesh.axis_names)
  at = {d.process_index: i for i, d in enumerate(mesh.devices.flat)}
  ring = [(at[p], at[(p + 1) % len(at)]) for p in range(len(at))]

  def body(*blocks):
    mine, copy = pack(list(blocks), sent, length)
    return jnp.concatenate([mine, lax.ppermute(copy, axes, ring)])

  mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                         out_specs=P(axes), check_vma=False)
  return jax.jit(lambda leaves: mapped(*leaves))
