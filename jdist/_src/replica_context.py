"""`ReplicaContext`: what a step sees of the other replicas while it runs."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jdist._src import collectives
from jdist._src import context
from jdist._src.types import ReduceOp
from jdist._src.values import PerReplica


class ReplicaContext:
  """The replica a step runs as, and collectives over all replicas.

  Obtain it with `jdist.get_replica_context()` inside a step run by
  `strategy.run` or `strategy.function`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> strategy = jdist.get_strategy()
    >>> def step(x):
    ...   ctx = jdist.get_replica_context()
    ...   return ctx.all_reduce("mean", x * ctx.replica_id_in_sync_group)
    >>> strategy.run(step, args=(jnp.ones(()),))
    Array(0., dtype=float32)
  """

  def __init__(self, strategy, *, mask=None, num_valid=None):
    self._strategy = strategy
    self._mask = mask
    self._num_valid = num_valid

  @property
  def strategy(self):
    """The strategy running this step."""
    return self._strategy

  @property
  def axis_name(self) -> str:
    """The mesh axis replicas run along (for `lax` collectives)."""
    return self._strategy.axis_name

  @property
  def num_replicas_in_sync(self) -> int:
    """How many replicas run this step together."""
    return self._strategy.num_replicas_in_sync

  @property
  def replica_id_in_sync_group(self) -> jax.Array:
    """This replica's position, 0 to `num_replicas_in_sync - 1` (traced)."""
    return lax.axis_index(self.axis_name)

  @property
  def example_mask(self) -> jax.Array | None:
    """Validity mask of this replica's batch rows, or None if no batch was fed."""
    return self._mask

  @property
  def num_valid_examples(self) -> jax.Array | None:
    """Global count of valid examples in the step's batch, or None."""
    return self._num_valid

  def all_reduce(self, reduce_op, value: Any) -> Any:
    """Reduces `value` (a pytree) over replicas; the result is the same on all.

    SUM of a value that is already the same on every replica raises
    `jdist.DoubleReductionError`: see DESIGN.md §2.2.
    """
    return collectives.all_reduce(reduce_op, value, self.axis_name,
                                  self.num_replicas_in_sync)

  def all_gather(self, value: Any, axis: int = 0) -> Any:
    """Concatenates every replica's `value` along `axis`, in replica order."""
    return collectives.all_gather(value, axis, self.axis_name,
                                  self.num_replicas_in_sync)

  def example_index(self, batch_size: int) -> jax.Array:
    """Global positions of this replica's `batch_size` rows in the global batch."""
    return (self.replica_id_in_sync_group * batch_size +
            jnp.arange(batch_size, dtype=jnp.int32))

  def merge_call(self, merge_fn: Callable, args=(), kwargs=None) -> Any:
    """Runs `merge_fn(strategy, *args, **kwargs)` once over all replicas' values.

    Arguments that differ between replicas reach `merge_fn` as `PerReplica`
    values (stacked in replica order); `strategy.reduce` and
    `strategy.experimental_local_results` work on them there. The result is the
    same on every replica.
    """
    kwargs = kwargs or {}
    n = self.num_replicas_in_sync

    def to_cross_replica(tree):
      if not any(collectives.is_varying(x, self.axis_name)
                 for x in jax.tree.leaves(tree)):
        return tree
      def stack(x):
        x = jnp.asarray(x)
        if collectives.is_varying(x, self.axis_name):
          return self.all_gather(x[None], axis=0)
        return jnp.broadcast_to(x, (n,) + x.shape)
      return PerReplica(jax.tree.map(stack, tree))

    args = tuple(to_cross_replica(a) for a in args)
    kwargs = {k: to_cross_replica(v) for k, v in kwargs.items()}
    with context.replica_scope(None):  # merge_fn runs in cross-replica context
      return merge_fn(self._strategy, *args, **kwargs)


class DefaultReplicaContext:
  """The replica context of plain code outside any strategy: one replica."""

  strategy = property(lambda self: _default_strategy())
  num_replicas_in_sync = 1
  replica_id_in_sync_group = 0
  example_mask = None
  num_valid_examples = None
  axis_name = None

  def all_reduce(self, reduce_op, value):
    ReduceOp.of(reduce_op)
    return value

  def all_gather(self, value, axis=0):
    return value

  def example_index(self, batch_size: int):
    return jnp.arange(batch_size, dtype=jnp.int32)

  def merge_call(self, merge_fn, args=(), kwargs=None):
    return merge_fn(self.strategy, *args, **(kwargs or {}))


def _default_strategy():
  from jdist._src.scope import get_strategy
  return get_strategy()
