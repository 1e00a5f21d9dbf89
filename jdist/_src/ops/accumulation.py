"""Gradient accumulation: K micro-batches in a `lax.scan` (one micro-batch's
activations alive at a time), one gradient reduction per step."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdist._src.core import context
from jdist._src.core import conv_layout
from jdist._src.core import in_step
from jdist._src.core.replica_context import ReplicaContext
from jdist._src.core.validity import Validity


def check_steps(num_micro_batches) -> int:
  """`num_micro_batches` as an int, checked to be a whole number >= 1."""
  k = num_micro_batches
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
    raise TypeError(
        f"The number of gradient accumulation steps (micro-batches per "
        f"optimizer step) must be a whole number, got {k!r}.")
  if k < 1:
    raise ValueError(
        f"The number of gradient accumulation steps (micro-batches per "
        f"optimizer step) must be at least 1, got {k}. Use 1 for no "
        "accumulation.")
  return int(k)


class MicroBatchContext(ReplicaContext):
  """The replica context of one micro-batch: validity and `example_index`
  are the whole step's (random draws are the whole batch's)."""

  def __init__(self, parent: ReplicaContext, validity: Validity | None,
               index, num_micro_batches: int):
    super().__init__(parent.strategy, validity)
    self._parent = parent
    self._index = index
    self._k = num_micro_batches

  def example_index(self, batch_size: int) -> jax.Array:
    # Micro-batch `index` is part `index % k` of the `index // k`-th
    # distributed batch joined into the step (one, unless the Trainer
    # accumulates over batches); each such batch holds `b * replicas` rows.
    b = batch_size * self._k
    batch, part = self._index // self._k, self._index % self._k
    return (batch * b * self.num_replicas_in_sync +
            self.replica_id_in_sync_group * b + part * batch_size +
            jnp.arange(batch_size, dtype=jnp.int32))


def _split(batch, k: int):
  """Every leaf `(b, ...)` as `(k, b // k, ...)`, or a clear error."""
  def split(path, x):
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] % k:
      rows = "a scalar" if x.ndim == 0 else f"{x.shape[0]} rows"
      raise ValueError(
          f"Cannot split the batch into {k} micro-batches: "
          f"{jax.tree_util.keystr(path) or 'the batch'} has {rows} on this "
          f"replica. Each replica's batch (the global batch divided by the "
          f"number of replicas) must be a multiple of {k}; choose a batch "
          "size or a number of accumulation steps that divide.")
    return x.reshape((k, x.shape[0] // k) + x.shape[1:])
  return jax.tree_util.tree_map_with_path(split, batch)


def merge_micro_batches(tree):
  """`(k, m, ...)` leaves back to `(k * m, ...)`: rows of the whole batch."""
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tree)


def scan_micro_batches(loss_fn: Callable, params, carry, batch, *,
                       num_micro_batches: int, num_batches: int = 1,
                       sum_over_replicas: bool = True):
  """`accumulate_gradients` with a `carry` between micro-batches: `loss_fn(
  params, carry, micro_batch, index) -> (loss, (carry, aux))`; returns
  `((loss, (carry, aux)), grads)` with `aux` stacked."""
  per_batch = check_steps(num_micro_batches)
  k = per_batch * num_batches
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if k == 1:
    (loss, (carry, aux)), grads = grad_fn(params, carry, batch, 0)
    return (loss, (carry, jax.tree.map(lambda a: a[None], aux))), grads
  micro = _split(batch, k)
  ctx = context.current_replica_context()
  if conv_layout.runs_on_cpu(None if ctx is None else ctx.strategy):
    grad_fn = conv_layout.canonical_convolutions(grad_fn)
  masks = None
  if ctx is not None:
    axis = ctx.axis_name
    invariant = jax.tree.map(lambda p: not in_step.is_varying(p, axis), params)
    # Typed as varying, the parameters get per-replica gradients: autodiff
    # inserts no all-reduce per micro-batch (its psum is the transpose of the
    # implicit broadcast of an invariant input, which this makes explicit).
    params = jax.tree.map(lambda p: in_step.to_varying(p, axis), params)
    # A scan's carry keeps its type: state that one micro-batch may make
    # differ between replicas is typed as varying from the start.
    carry = jax.tree.map(lambda c: in_step.to_varying(c, axis), carry)
    if ctx.validity is not None:
      masks = ctx.validity.mask.reshape(k, -1)

  def body(acc, xs):
    index, micro_batch, mask = xs
    loss_acc, grad_acc, carry = acc
    if ctx is None:
      (loss, (carry, aux)), grads = grad_fn(params, carry, micro_batch, index)
    else:
      sub = (None if mask is None else
             Validity.pack(mask, ctx.validity.num_valid))
      with context.replica_scope(
          MicroBatchContext(ctx, sub, index, per_batch)):
        (loss, (carry, aux)), grads = grad_fn(params, carry, micro_batch,
                                              index)
      carry = jax.tree.map(lambda c: in_step.to_varying(c, axis), carry)
    grads = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_acc, grads)
    return (loss_acc + loss.astype(loss_acc.dtype), grads, carry), aux

  loss0 = jnp.zeros((), jnp.result_type(float))
  if ctx is not None:
    loss0 = in_step.to_varying(loss0, axis)
  zeros = jax.tree.map(jnp.zeros_like, params)
  xs = (jnp.arange(k, dtype=jnp.int32), micro, masks)
  (loss, grads, carry), aux = lax.scan(body, (loss0, zeros, carry), xs)
  if ctx is None:  # plain code: the micro-batches' losses are means
    return (loss / k, (carry, aux)), jax.tree.map(lambda g: g / k, grads)
  if not sum_over_replicas:
    return (loss, (carry, aux)), grads
  # The one reduction of the step.
  grads = jax.tree.map(lambda g, inv: lax.psum(g, axis) if inv else g,
                       grads, invariant)
  return (loss, (carry, aux)), grads


def accumulate_gradients(loss_fn: Callable, params, batch, *,
                         num_micro_batches: int, has_aux: bool = False) -> Any:
  """`jax.value_and_grad` over a batch split into micro-batches.

  With the loss scaled by `jdist.compute_average_loss` the result equals
  `jax.value_and_grad` of the whole batch
  (docs/accumulation_and_precision.md).

  Args:
    loss_fn: `loss_fn(params, micro_batch) -> loss` (or `(loss, aux)`).
    params: what to differentiate.
    batch: this replica's batch (rows: a multiple of `num_micro_batches`).
    num_micro_batches: micro-batches per step (K >= 1).
    has_aux: whether `loss_fn` returns `(loss, aux)` (`aux` stacked).

  Returns:
    `(loss, grads)`, or `((loss, aux), grads)` with `has_aux`.

  Raises:
    ValueError: K below 1, or a batch that does not split into K.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> def loss_fn(w, batch):
    ...   return jdist.compute_average_loss((batch["x"] @ w - batch["y"]) ** 2)
    >>> data = {"x": jnp.ones((8, 2)), "y": jnp.ones(8)}
    >>> loss, grad = jdist.accumulate_gradients(loss_fn, jnp.zeros(2), data,
    ...                                         num_micro_batches=4)
    >>> float(loss), grad.tolist()
    (1.0, [-2.0, -2.0])
  """
  def with_carry(p, carry, micro_batch, index):
    del index
    out = loss_fn(p, micro_batch)
    loss, aux = out if has_aux else (out, None)
    return loss, (carry, aux)

  (loss, (_, aux)), grads = scan_micro_batches(
      with_carry, params, None, batch, num_micro_batches=num_micro_batches)
  return ((loss, aux), grads) if has_aux else (loss, grads)

