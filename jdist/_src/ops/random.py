"""Random streams keyed by the example's position in the global batch, so
they do not depend on the number of replicas."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdist._src.core.replica_context import resolve_batch


def example_keys(key: jax.Array, batch_size: int, *,
                 replica_id=None) -> jax.Array:
  """One key per example of this replica's batch, keyed by global position.

  Args:
    key: a key that is the same on every replica.
    batch_size: this replica's batch size.
    replica_id: this replica's position (default: the running step's).

  Returns:
    `batch_size` keys, `jax.random.fold_in(key, i)` for global example `i`.

  Example:
    >>> import jdist, jax
    >>> jdist.example_keys(jax.random.key(0), 4).shape
    (4,)
  """
  if replica_id is None:
    ctx = resolve_batch().replica_context
    # The context knows where its rows sit (a micro-batch's are within the
    # step's batch: see jdist.accumulate_gradients).
    index = (jnp.arange(batch_size, dtype=jnp.int32) if ctx is None
             else ctx.example_index(batch_size))
  else:
    index = replica_id * batch_size + jnp.arange(batch_size, dtype=jnp.int32)
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index)


def dropout(key: jax.Array, rate: float, x: jax.Array, *,
            deterministic: bool = False) -> jax.Array:
  """Inverted dropout over a batch `x`, with per-example masks.

  Each example's mask depends only on `key` and its global position, so
  training is the same on any number of replicas.

  Example:
    >>> import jdist, jax, jax.numpy as jnp
    >>> y = jdist.dropout(jax.random.key(0), 0.5, jnp.ones((4, 3)))
    >>> y.shape
    (4, 3)
  """
  if deterministic or rate == 0.0:
    return x
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1), got {rate}.")
  keep = 1.0 - rate
  keys = example_keys(key, x.shape[0])
  masks = jax.vmap(lambda k: jax.random.bernoulli(k, keep, x.shape[1:]))(keys)
  return jnp.where(masks, x / keep, jnp.zeros_like(x))
