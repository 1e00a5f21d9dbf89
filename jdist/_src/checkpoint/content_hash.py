"""A content hash of a checkpoint's arrays that any mesh can verify.

A checkpoint saved on 4 devices of 2 processes may be restored onto 2
devices of 1 process: the blocks each process holds when it saves are not
those it holds when it restores, and no process ever holds a whole leaf that
is split over the processes. So the hash of a leaf is defined over its
elements, not over any process's bytes: each 32-bit word `w` of the leaf's
bits, at position `i`, is mixed with its position by murmur3's 32-bit
finalizer (`_fmix`, a bijection of uint32): `h = fmix(w ^ i * 0x9E3779B9)`;
the digest is two sums modulo 2**32, of `h` and of `h * (2i + 1)` (64 bits in
all). A sum does not depend on the order of its terms, so each device sums
its own block, XLA adds the blocks' sums (one small all-reduce), and every
mesh computes the same value for the same content: what is hashed is the
leaf, wherever it lies.

What it catches: for a given position, `h` is a bijection of `w` and so is
multiplying by an odd number, so any change confined to one word, such as a
flipped bit, always changes both sums; moving a word changes its mix; other
corruption goes undetected with a probability of about 2**-64. It is not a
cryptographic hash: it finds damage, not forgery.

The same program also says whether each leaf's values are all finite (a
state with NaN or infinities is not saved), so a save reads the state once,
on its devices, and moves 9 bytes a leaf to the host. A leaf whole on every
device (a mirrored one) is read on one device only.

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
  """murmur3's 32-bit finalizer: a bijection of uint32 that spreads every
  input bit over the output."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """`x`'s bits as uint32 words: one word per element of 32 bits or fewer
  (widened), several along a last axis for wider ones (64-bit types,
  complex values as their real and imaginary parts)."""
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
  """Each element's row-major position in an array of `shape`, as uint32
  (an array over 2**32 elements repeats positions: harmless for a hash)."""
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
  """What to hash of leaf `x`: one device's copy of a leaf whole on every
  device (the others hold the same bytes: hashing each would repeat the
  work), else the leaf itself (each device hashes its block)."""
  if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
    return x.addressable_data(0)
  return x


def digests(leaves: list) -> tuple[list[str], list[bool]]:
  """`(digests, finite)` of `leaves` (arrays, PRNG keys as their data): each
  leaf's digest as 16 hexadecimal digits, the same on every mesh and every
  process, and whether its values are all finite (every process calls it
  for a leaf split over the processes: one program over the global arrays;
  a leaf whole on every device is hashed from one device's copy)."""
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
