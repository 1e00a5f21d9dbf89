"""Loss scaling for synchronous training: divide by the global batch (the
gradients are summed over replicas), whose valid examples jdist counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.core import in_step
from jdist._src.core.replica_context import resolve_batch
from jdist._src.errors import LossScalingError


def _fit_weights(sample_weight, loss):
  """`sample_weight` shaped for `loss` by TensorFlow's rule (not plain
  broadcasting, which makes (b, 1) against (b,) a (b, b))."""
  w = jnp.asarray(sample_weight, loss.dtype)
  fitted = w
  if w.ndim and w.ndim == loss.ndim + 1 and w.shape[-1] == 1:
    fitted = w.reshape(w.shape[:-1])
  elif w.ndim and w.ndim == loss.ndim - 1:
    fitted = w[..., None]
  try:
    shape = jnp.broadcast_shapes(fitted.shape, loss.shape)
  except ValueError:
    shape = None
  if shape != loss.shape:
    b = loss.shape[0]
    raise ValueError(
        f"sample_weight of shape {tuple(w.shape)} does not fit the per-example "
        f"loss of shape {tuple(loss.shape)}. Pass a scalar, one weight per "
        f"example of this replica (shape ({b},) or ({b}, 1)), or weights of "
        "the loss's own shape; inside a step, the weights are this replica's "
        "rows of the batch, not the global batch's.")
  return fitted


def _check_divisor(global_batch_size):
  """TF's checks of `global_batch_size`: a positive integer scalar."""
  n = global_batch_size
  dtype = n.dtype if hasattr(n, "dtype") else np.asarray(n).dtype
  if np.ndim(n) != 0 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(
        f"global_batch_size must be a positive integer (the number of examples "
        f"in the global batch), got {n!r}.")
  try:
    value = int(n)
  except TypeError:  # jax.errors.ConcretizationTypeError: a traced value
    return  # computed inside the step: its value is not known while tracing
  if value <= 0:
    raise ValueError(
        f"global_batch_size must be a positive integer (the number of examples "
        f"in the global batch), got {value}. Leave it out to divide by the "
        "step's count of valid examples.")


def compute_average_loss(per_example_loss, sample_weight=None,
                         global_batch_size=None, *, mask=None) -> jax.Array:
  """Scales per-example losses by the global (valid) example count.

  Args:
    per_example_loss: this replica's losses, `(b, ...)` (extra axes summed).
    sample_weight: a scalar, one weight per example, or one per loss.
    global_batch_size: the divisor (default: the step's global count of
      valid examples, else `b * num_replicas_in_sync`).
    mask: which of this replica's rows are real, instead of the batch mask.

  Returns:
    This replica's scalar loss; summed over replicas it is the global mean.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> float(jdist.compute_average_loss(jnp.array([1.0, 3.0, 0.0]),
    ...                                  mask=jnp.array([True, True, False])))
    2.0
  """
  loss = jnp.asarray(per_example_loss)
  if loss.ndim == 0:
    raise ValueError(
        "compute_average_loss needs per-example losses (shape (batch, ...)), "
        "got a scalar. Return the loss of each example, e.g. "
        "optax.softmax_cross_entropy_with_integer_labels(logits, labels).")
  if sample_weight is not None:
    loss = loss * _fit_weights(sample_weight, loss)
  if global_batch_size is not None:
    _check_divisor(global_batch_size)
  batch = resolve_batch(mask=mask)
  if global_batch_size is None and batch.mask is None and \
      batch.num_valid is None:  # the divisor b * num_replicas assumes a split
    _check_varies(loss, batch)
  if batch.mask is not None:
    if batch.mask.shape[0] != loss.shape[0]:
      raise ValueError(
          f"The per-example loss has {loss.shape[0]} rows but this replica's "
          f"batch has {batch.mask.shape[0]} examples. Pass one loss per example.")
    m = batch.mask.reshape(batch.mask.shape + (1,) * (loss.ndim - 1))
    loss = jnp.where(m, loss, jnp.zeros_like(loss))
  total = jnp.sum(loss)
  if global_batch_size is not None:
    divisor = global_batch_size
  elif batch.num_valid is not None:
    divisor = batch.num_valid
  elif batch.mask is not None:  # an explicit mask: count it on every replica
    divisor = jnp.sum(batch.mask, dtype=jnp.int32)
    if batch.replica_context is not None:
      divisor = batch.replica_context.all_reduce("sum", divisor)
  else:
    divisor = loss.shape[0] * batch.num_replicas
  return total / jnp.maximum(jnp.asarray(divisor, total.dtype), 1)


def _check_varies(loss, batch) -> None:
  """Refuses per-example losses that are the same on every replica (each
  saw the whole batch: gradients `num_replicas` times too small)."""
  ctx = batch.replica_context
  axis = getattr(ctx, "axis_name", None)
  if batch.num_replicas < 2 or axis is None or in_step.is_varying(loss, axis):
    return
  raise LossScalingError(
      f"compute_average_loss got per-example losses that are the same on all "
      f"{batch.num_replicas} replicas: every replica computed them from the "
      "same whole batch (an array passed to the step as it is reaches every "
      "replica whole), so the gradients would be "
      f"{batch.num_replicas} times too small. Split the batch over the "
      "replicas: iterate strategy.experimental_distribute_dataset(batches) "
      "(or use distribute_datasets_from_function / "
      "experimental_distribute_values_from_function) and pass its batches "
      "to the step.")


def scale_regularization_loss(regularization_loss) -> jax.Array:
  """Divides a loss added on every replica by the number of replicas, so
  its gradients, summed over replicas, weigh as on one device.

  Args:
    regularization_loss: a scalar, an array or a list of them.

  Returns:
    A scalar: their sum divided by `num_replicas_in_sync`.

  Example:
    >>> import jdist
    >>> round(float(jdist.scale_regularization_loss([2.5, 6.2, 5.0])), 5)
    13.7
  """
  if isinstance(regularization_loss, (list, tuple)):
    if not regularization_loss:
      raise ValueError("scale_regularization_loss got an empty list of losses.")
    regularization_loss = sum(jnp.sum(jnp.asarray(x))
                              for x in regularization_loss)
  return jnp.sum(jnp.asarray(regularization_loss)) / resolve_batch().num_replicas
