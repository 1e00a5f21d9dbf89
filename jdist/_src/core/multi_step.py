"""`jdist.multi_step`: many steps of a `strategy.function` step per dispatch.

The step is traced once into a `lax.scan` body over a `BatchGroup`
(`DistributedFunction.trace_step`), each iteration with its batch's own
validity.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdist._src.core import kinds
from jdist._src.core.function import DistributedFunction


class MultiStepFunction(DistributedFunction):
  """A step run once per batch of a `BatchGroup`, in one compiled call.

  Called as `multi(*carried, group)`. See `multi_step`.

  Args:
    step: the per-batch step (a `strategy.function`).
    batches_per_step: batches joined into one per call (accumulation).
  """

  def __init__(self, step: DistributedFunction, batches_per_step: int = 1):
    options = step.options
    if options.static_argnums or options.static_argnames:
      raise ValueError(
          f"jdist.multi_step cannot run {step.__name__}: it has static "
          "arguments (static_argnums / static_argnames), which a compiled "
          "loop over steps cannot vary. Pass those values as arrays, or "
          "build a step per value.")
    super().__init__(step.strategy, step.python_function,
                     donate_argnums=options.donate_argnums,
                     check_state=options.check_state,
                     check_loss_scaling=options.check_loss_scaling)
    self._step = step
    self._batches_per_step = batches_per_step

  def _trace(self, args: tuple, kwargs: dict, *, check: bool,
             in_loop: bool = False):
    del in_loop  # this is the loop: the step is traced into its body
    if kwargs:
      raise TypeError(
          f"A multi-step {self._name} takes positional arguments only: the "
          "carried values (state, metrics, ...), then the BatchGroup.")
    if not args or kinds.kind_of(args[-1]) is not kinds.BATCH_GROUP:
      got = type(args[-1]).__name__ if args else "no arguments"
      raise TypeError(
          f"A multi-step {self._name} takes the carried values, then a "
          f"BatchGroup last (got {got}). Make groups with "
          "strategy.experimental_distribute_dataset(data).group(k).")
    carry, group = tuple(args[:-1]), args[-1].merged(self._batches_per_step)
    layout = []

    def body(carried, i):
      out = self._step.trace_step(carried + (group.batch(i),), {}, check=check,
                                  in_loop=True)
      new, extras, single = _split(out, carried, self._name)
      new = _like(new, carried)
      _check_carry(new, carried, self._name)
      layout[:] = [single]
      return new, jax.tree.map(_unmasked, extras, is_leaf=kinds.is_node)

    carry, stacked = jax.lax.scan(body, carry, jnp.arange(group.num_steps))
    stacked = jax.tree.map(_replicas_first, stacked, is_leaf=kinds.is_node)
    if layout[0]:
      return carry[0]
    return carry + stacked


def _split(out: Any, carried: tuple, name: str):
  """`(new carried values, other outputs, whether out was the state alone)`."""
  def shape(tree):  # the structure, distributed values told from arrays
    types = jax.tree.map(lambda x: type(x) if kinds.is_node(x) else None,
                         tree, is_leaf=kinds.is_node)
    return jax.tree.structure(tree, is_leaf=kinds.is_node), jax.tree.leaves(
        types, is_leaf=lambda x: x is None)
  m = len(carried)
  if (isinstance(out, tuple) and len(out) >= m and
      all(shape(o) == shape(c) for o, c in zip(out, carried))):
    return tuple(out[:m]), tuple(out[m:]), False
  if m == 1 and shape(out) == shape(carried[0]):
    return (out,), (), True
  raise TypeError(
      f"jdist.multi_step runs {name} step after step, feeding its outputs "
      "back: it must return the new values of its arguments before the "
      f"batch ({m} of them, in order, with the same structure), then "
      "anything else (losses, outputs: those come back stacked, one entry "
      "per step). Return `(state, loss)` for a step `(state, batch)`.")


def _check_carry(new: tuple, carried: tuple, name: str) -> None:
  """Raises unless every carried output has its argument's shape and dtype."""
  new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(new)
  old_leaves, old_tree = jax.tree_util.tree_flatten(carried)
  if new_tree == old_tree:
    differ = [f"{jax.tree_util.keystr(path)}: argument {_type(o)}, output "
              f"{_type(n)}" for (path, n), o in zip(new_leaves, old_leaves)
              if _signature(n) != _signature(o)]
  else:
    differ = [f"the structure: argument {old_tree}, output {new_tree}"]
  if differ:
    raise TypeError(
        f"{name} returns carried values whose types differ from its "
        "arguments' (a multi-step call feeds each step's outputs to the "
        "next step, so each must keep the shape, dtype and placement of its "
        f"argument): {'; '.join(differ[:5])}. Cast or reshape the new values "
        "to their arguments' types, or return them after the carried ones "
        "(as outputs, stacked per step).")


def _signature(x: Any) -> tuple:
  aval = jax.typeof(x)
  return aval.shape, aval.dtype


def _type(x: Any) -> str:
  return jax.typeof(x).str_short()


def _like(new: tuple, carried: tuple) -> tuple:
  """`new` with each distributed value's validity as its argument had it."""
  def one(n, c):
    rows = kinds.kind_of(n).rows(n)
    if rows is None or kinds.kind_of(c) is not kinds.kind_of(n):
      return n
    return kinds.kind_of(n).with_rows(n, rows[0], kinds.kind_of(c).validity(c))
  return jax.tree.map(one, new, carried, is_leaf=kinds.is_node)


def _unmasked(x: Any) -> Any:
  # Each step's validity is the batch's: stacked, it would no longer be one
  # batch's mask, which `strategy.reduce` reads. The values stay exact.
  rows = kinds.kind_of(x).rows(x)
  return x if rows is None else kinds.kind_of(x).with_rows(x, rows[0])


def _replicas_first(x: Any) -> Any:
  """A stacked per-replica output as `(replicas, steps, ...)`."""
  rows = kinds.kind_of(x).rows(x)
  if rows is None:
    return x
  return kinds.kind_of(x).with_rows(
      x, jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), rows[0]))


def multi_step(step: DistributedFunction) -> MultiStepFunction:
  """Runs `step` once per batch of a `BatchGroup`, all in one compiled call.

  Keras' `steps_per_execution` for a custom loop. `step` takes its carried
  values first and the batch last, and returns the new carried values
  first; other outputs come back stacked on a step axis.

  Args:
    step: a `strategy.function` step without static arguments.

  Returns:
    A `MultiStepFunction`, called as `multi(*carried, group)`.

  Example:
    >>> import jdist, jax, jax.numpy as jnp, numpy as np
    >>> strategy = jdist.get_strategy()
    >>> @strategy.function
    ... def step(w, batch):
    ...   loss = lambda w: jdist.compute_average_loss((batch @ w) ** 2)
    ...   value, grad = jax.value_and_grad(loss)(w)
    ...   return w - 0.1 * grad, value
    >>> data = [np.ones((4, 2), np.float32)] * 3
    >>> w = strategy.replicate(jnp.ones(2))
    >>> run3 = jdist.multi_step(step)
    >>> for group in strategy.experimental_distribute_dataset(data).group(3):
    ...   w, losses = run3(w, group)
    >>> strategy.reduce("sum", losses).shape
    (3,)
  """
  if isinstance(step, MultiStepFunction):
    return step
  if not isinstance(step, DistributedFunction):
    raise TypeError(
        f"jdist.multi_step takes a step built with strategy.function, got "
        f"{type(step).__name__}. Decorate the per-replica step with "
        "@strategy.function first.")
  return MultiStepFunction(step)
