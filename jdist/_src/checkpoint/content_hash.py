"""A content hash of a checkpoint's arrays that any mesh can verify
(docs/checkpoints.md defines it).

Each device sums its block's position-mixed 32-bit words; XLA adds them.

Example:
  >>> import jax.numpy as jnp
  >>> from jdist._src.checkpoint import content_hash
  >>> a = jnp.arange(4.0)
  >>> (digest,), (finite,) = content_hash.digests([a])
  >>> digest == content_hash.digests([a.at[2].set(2.0000002)])[0][0], finite
  (False, True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# What `meta["hash"]` names: the algorithm of the digests beside it.
NAME = "jdist-sum-fmix32-x2"
_GOLDEN = 0x9E3779B9  # 2**32 / the golden ratio: spreads positions' bits
_NARROW = {2: jnp.uint2, 4: jnp.uint4}  # unsigned types under a byte wide


def _fmix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer: a bijection of uint32."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """`x`'s bits as uint32 words: one per element of 32 bits or fewer, several
  along a last axis for wider ones (complex: real and imaginary parts)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag], -1)
  bits = jax.dtypes.itemsize_bits(x.dtype)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if bits < 8:
    return lax.bitcast_convert_type(x, _NARROW[bits]).astype(jnp.uint32)
  if bits <= 32:
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  return lax.bitcast_convert_type(x, jnp.uint32)  # (..., bits // 32)


def _positions(shape: tuple) -> jax.Array:
  """Each element's row-major position, as uint32 (wrapping past 2**32)."""
  position = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    position = position + lax.broadcasted_iota(jnp.uint32, shape, axis) * \
        jnp.uint32(stride % (1 << 32))
    stride *= shape[axis]
  return position


def _leaf_digest(x: jax.Array) -> jax.Array:
  """The two 32-bit halves of `x`'s digest (uint32[2])."""
  words = _words(x)
  position = _positions(words.shape)
  h = _fmix(words ^ position * jnp.uint32(_GOLDEN))
  odd = position * jnp.uint32(2) + jnp.uint32(1)
  return jnp.stack([jnp.sum(h, dtype=jnp.uint32),
                    jnp.sum(h * odd, dtype=jnp.uint32)])


def _finite(x: jax.Array) -> jax.Array:
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.bool_(True)
  return jnp.isfinite(x).all()


@jax.jit
def _program(leaves: list) -> tuple:
  return (jnp.stack([_leaf_digest(x) for x in leaves]),
          jnp.stack([_finite(x) for x in leaves]))


def _host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)  # (replicated: every block is the whole)
  return np.asarray(x)


def _one_copy(x):
  """One device's copy of a replicated leaf, else the leaf."""
  if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
    return x.addressable_data(0)
  return x


def digests(leaves: list) -> tuple[list[str], list[bool]]:
  """`(digests, finite)` of `leaves`: 16 hexadecimal digits each, the same on
  every mesh, and whether its values are finite (every process calls it)."""
  groups: dict = {}  # one program per set of devices
  for i, x in enumerate(leaves):
    x = _one_copy(x)
    devices = x.sharding.device_set if isinstance(x, jax.Array) else None
    groups.setdefault(frozenset(devices or ()), []).append((i, x))
  halves, finite = [None] * len(leaves), [None] * len(leaves)
  for group in groups.values():
    h, f = _program([x for _, x in group])
    for (i, _), hi, fi in zip(group, _host(h), _host(f)):
      halves[i], finite[i] = hi, bool(fi)
  return [f"{int(a):08x}{int(b):08x}" for a, b in halves], finite
