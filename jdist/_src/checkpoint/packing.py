"""A process's blocks of a snapshot as bytes, in one program on one device.

One program per layout packs this process's part and the copy the next
process lacks; each buffer (a copy) ends with a byte, 1 when all is finite.

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
  """`x`'s raw bytes, as numpy's `.view(np.uint8)` gives them.

  numpy (ml_dtypes) stores a value under a byte wide (int4, float4_e2m1fn)
  in a byte of its own, its bits low; complex values are real, then imag.
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
  """One byte: 1 when every inexact value of `blocks` is finite, else 0."""
  checks = [jnp.isfinite(b).all() for b in blocks
            if jnp.issubdtype(b.dtype, jnp.inexact) and b.size]
  ok = jnp.stack(checks).all() if checks else jnp.bool_(True)
  return ok.astype(jnp.uint8).reshape(1)


def pack(blocks: list, sent: list | None, length: int) -> tuple:
  """`(mine, copy)` of `blocks`, traced (see `packer`)."""
  data = [as_bytes(b) for b in blocks]
  flag = finite_flag(blocks)
  copy = None if sent is None else jnp.concatenate(
      [_joined([data[i] for i in sent], length), flag])
  return jnp.concatenate([_joined(data), flag]), copy


def packer(sent: list | None, length: int):
  """The jitted `blocks -> (mine, copy)` for one layout: the blocks' bytes,
  and those of the blocks at the positions `sent` padded to `length` (None
  without `sent`), each followed by the finite byte."""
  return jax.jit(lambda blocks: pack(blocks, sent, length))


def packer_across(mesh, specs: list, sent: list, length: int):
  """The jitted `leaves -> mine + received` over `mesh` (one device per
  process, leaves laid out by `specs`): `packer` on each device, then a
  `ppermute` of the copy to the next process."""
  axes = tuple(mesh.axis_names)
  at = {d.process_index: i for i, d in enumerate(mesh.devices.flat)}
  ring = [(at[p], at[(p + 1) % len(at)]) for p in range(len(at))]

  def body(*blocks):
    mine, copy = pack(list(blocks), sent, length)
    return jnp.concatenate([mine, lax.ppermute(copy, axes, ring)])

  mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                         out_specs=P(axes), check_vma=False)
  return jax.jit(lambda leaves: mapped(*leaves))
