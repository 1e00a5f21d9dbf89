"""`ReplicaContext`: what a step sees of the other replicas while it runs.

`resolve_batch` is the one place where the functions a step calls turn
their `mask=` / `num_valid=` arguments, or the running step's, into what
they use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jdist._src.core import context
from jdist._src.core import in_step
from jdist._src.core.reduce_op import ReduceOp
from jdist._src.core.validity import Validity
from jdist._src.core.values import PerReplica


class ReplicaContext:
  """The replica a step runs as (`jdist.get_replica_context()`), and
  collectives over all replicas.

  Args:
    strategy: the strategy running the step.
    validity: this replica's rows' `Validity`, or None (no distributed batch).

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> strategy = jdist.get_strategy()
    >>> def step(x):
    ...   ctx = jdist.get_replica_context()
    ...   return ctx.all_reduce("mean", x * ctx.replica_id_in_sync_group)
    >>> strategy.run(step, args=(jnp.ones(()),))
    Array(0., dtype=float32)
  """

  def __init__(self, strategy, validity: Validity | None = None):
    self._strategy = strategy
    self._validity = validity

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
  def validity(self) -> Validity | None:
    """This replica's rows of the step's distributed batch, or None."""
    return self._validity

  @property
  def example_mask(self) -> jax.Array | None:
    """Validity mask of this replica's batch rows, or None if no batch was fed."""
    return None if self._validity is None else self._validity.mask

  @property
  def num_valid_examples(self) -> jax.Array | None:
    """Global count of valid examples in the step's batch, or None."""
    return None if self._validity is None else self._validity.num_valid

  def all_reduce(self, reduce_op, value: Any) -> Any:
    """Reduces `value` (a pytree) over replicas; the result is the same on all.

    Raises:
      jdist.DoubleReductionError: SUM of a value already the same on every
        replica.
    """
    return in_step.all_reduce(reduce_op, value, self.axis_name,
                              self.num_replicas_in_sync)

  def all_gather(self, value: Any, axis: int = 0) -> Any:
    """Concatenates every replica's `value` along `axis`, in replica order."""
    return in_step.all_gather(value, axis, self.axis_name,
                              self.num_replicas_in_sync)

  def example_index(self, batch_size: int) -> jax.Array:
    """Global positions of this replica's `batch_size` rows in the global batch."""
    return (self.replica_id_in_sync_group * batch_size +
            jnp.arange(batch_size, dtype=jnp.int32))

  def merge_call(self, merge_fn: Callable, args=(), kwargs=None) -> Any:
    """Runs `merge_fn(strategy, *args, **kwargs)` once over all replicas' values.

    Arguments that differ between replicas reach it as `PerReplica` values.
    """
    kwargs = kwargs or {}
    n = self.num_replicas_in_sync
    axis = self.axis_name

    def to_cross_replica(tree):
      if not any(in_step.is_varying(x, axis) for x in jax.tree.leaves(tree)):
        return tree
      def stack(x):
        x = jnp.asarray(x)
        if in_step.is_varying(x, axis):
          return self.all_gather(x[None], axis=0)
        return jnp.broadcast_to(x, (n,) + x.shape)
      return PerReplica(jax.tree.map(stack, tree))

    args = tuple(to_cross_replica(a) for a in args)
    kwargs = {k: to_cross_replica(v) for k, v in kwargs.items()}
    with context.replica_scope(None):  # merge_fn runs in cross-replica context
      return merge_fn(self._strategy, *args, **kwargs)


class DefaultReplicaContext:
  """The replica context of plain code outside any strategy: one replica."""

  num_replicas_in_sync = 1
  replica_id_in_sync_group = 0
  validity = None
  example_mask = None
  num_valid_examples = None
  axis_name = None

  def __init__(self, strategy):
    self._strategy = strategy

  @property
  def strategy(self):
    """The default strategy."""
    return self._strategy

  def all_reduce(self, reduce_op, value):
    ReduceOp.of(reduce_op)
    return value

  def all_gather(self, value, axis=0):
    return value

  def example_index(self, batch_size: int):
    return jnp.arange(batch_size, dtype=jnp.int32)

  def merge_call(self, merge_fn, args=(), kwargs=None):
    return merge_fn(self._strategy, *args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class StepBatch:
  """What a function called inside a step knows of the step's batch: this
  replica's `mask` and the global `num_valid` (None: every row is real, count
  them), and the replicas and context (1 and None outside steps)."""

  mask: Any = None
  num_valid: Any = None
  num_replicas: int = 1
  replica_context: Any = None


def resolve_batch(mask=None, num_valid=None) -> StepBatch:
  """The batch a step function should use: explicit values, else the step's
  (outside steps and in `merge_call`: one replica, no implicit mask)."""
  ctx = context.current_replica_context()
  if ctx is None:
    return StepBatch(mask, num_valid)
  if mask is None and num_valid is None:
    mask, num_valid = ctx.example_mask, ctx.num_valid_examples
  return StepBatch(mask, num_valid, ctx.num_replicas_in_sync, ctx)
