"""Which strategy and replica context apply where code runs (the only
module that knows the default strategy)."""

from __future__ import annotations

from jdist._src.core import context
from jdist._src.core.replica_context import DefaultReplicaContext
from jdist._src.errors import ReplicaContextError
from jdist._src.strategies.default import default_strategy


def get_strategy():
  """The strategy whose scope is open, or the default (one-replica) strategy.

  Example:
    >>> import jdist
    >>> jdist.get_strategy().num_replicas_in_sync
    1
  """
  strategy = context.current_scope_strategy()
  if strategy is not None:
    return strategy
  replica = context.current_replica_context()
  if replica is not None:
    return replica.strategy
  return default_strategy()


def has_strategy() -> bool:
  """Whether a strategy's scope is open (or a step of a strategy is running).

  Example:
    >>> import jdist
    >>> jdist.has_strategy()
    False
  """
  return (context.current_scope_strategy() is not None or
          context.current_replica_context() is not None)


def get_replica_context():
  """The running step's `ReplicaContext`: None inside `strategy.scope()`
  outside a step, a one-replica default outside any strategy (as in TF).

  Example:
    >>> import jdist
    >>> jdist.get_replica_context().num_replicas_in_sync
    1
  """
  if context.tracing_step():
    return context.current_replica_context()
  if context.current_scope_strategy() is not None:
    return None
  return DefaultReplicaContext(default_strategy())


def in_cross_replica_context() -> bool:
  """True inside `strategy.scope()` (or `merge_call`) but outside a step."""
  return get_replica_context() is None


def all_reduce(reduce_op, value):
  """Shorthand for `jdist.get_replica_context().all_reduce(reduce_op, value)`.

  Raises:
    jdist.ReplicaContextError: called in cross-replica context.
  """
  ctx = get_replica_context()
  if ctx is None:
    raise ReplicaContextError(
        "jdist.all_reduce was called outside a step (in cross-replica context). "
        "Call it inside a function run by strategy.run or strategy.function, or "
        "use strategy.reduce(op, per_replica_value) here.")
  return ctx.all_reduce(reduce_op, value)
