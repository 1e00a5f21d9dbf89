"""Losses and metrics as per-example functions, named as in Keras.

Every loss and metric maps `(y_pred, y_true)` to one value per example (shape
`(batch,)`; extra axes are averaged). The trainer masks the padding of a short
last batch and averages over the examples actually seen, so epoch values are
exact on any number of replicas. String losses take logits, as optax does.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax


def _sparse_ce(y_pred, y_true):
  return optax.softmax_cross_entropy_with_integer_labels(
      y_pred, jnp.asarray(y_true).astype(jnp.int32))


def _categorical_ce(y_pred, y_true):
  return optax.softmax_cross_entropy(y_pred, y_true)


def _binary_ce(y_pred, y_true):
  y_true = jnp.reshape(y_true, jnp.shape(y_pred)).astype(y_pred.dtype)
  return optax.sigmoid_binary_cross_entropy(y_pred, y_true)


def _same_shape(y_pred, y_true):
  y_true = jnp.asarray(y_true)
  if y_true.ndim == y_pred.ndim - 1 and y_pred.shape[-1] == 1:
    y_true = y_true[..., None]
  if y_true.shape != y_pred.shape:
    raise ValueError(
        f"targets of shape {y_true.shape} do not match predictions of shape "
        f"{y_pred.shape}; this loss or metric compares them element by element.")
  return y_pred, y_true.astype(y_pred.dtype)


def mean_squared_error(y_pred, y_true):
  """Per-example mean of squared differences."""
  y_pred, y_true = _same_shape(y_pred, y_true)
  return jnp.square(y_pred - y_true)


def mean_absolute_error(y_pred, y_true):
  """Per-example mean of absolute differences."""
  y_pred, y_true = _same_shape(y_pred, y_true)
  return jnp.abs(y_pred - y_true)


def accuracy(y_pred, y_true):
  """1.0 where the prediction is right: class index, one-hot or binary logit."""
  y_true = jnp.asarray(y_true)
  if y_pred.ndim == y_true.ndim + 1:  # integer labels
    return (jnp.argmax(y_pred, -1) == y_true).astype(jnp.float32)
  if y_pred.shape == y_true.shape and y_pred.shape[-1] > 1:  # one-hot
    return (jnp.argmax(y_pred, -1) == jnp.argmax(y_true, -1)).astype(jnp.float32)
  _, y_true = _same_shape(y_pred, y_true)
  return ((y_pred > 0) == (y_true > 0.5)).astype(jnp.float32)


LOSSES: Mapping[str, Callable] = {
    "sparse_categorical_crossentropy": _sparse_ce,
    "categorical_crossentropy": _categorical_ce,
    "binary_crossentropy": _binary_ce,
    "mse": mean_squared_error,
    "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error,
    "mean_absolute_error": mean_absolute_error,
}

METRICS: Mapping[str, Callable] = {
    "accuracy": accuracy,
    "acc": accuracy,
    "sparse_categorical_accuracy": accuracy,
    "categorical_accuracy": accuracy,
    "binary_accuracy": accuracy,
    "mse": mean_squared_error,
    "mae": mean_absolute_error,
}


def resolve_loss(loss) -> Callable:
  """Returns the per-example loss function `loss` names (or `loss` itself)."""
  if isinstance(loss, str):
    if loss not in LOSSES:
      raise ValueError(
          f"Unknown loss {loss!r}. Use one of {sorted(LOSSES)} or a function "
          "loss(y_pred, y_true) returning one value per example.")
    return LOSSES[loss]
  if not callable(loss):
    raise TypeError(f"loss must be a name or a function, got {loss!r}.")
  return loss


def resolve_metrics(metrics) -> dict[str, Callable]:
  """Returns `{name: per-example function}` for a list or dict of metrics."""
  if metrics is None:
    return {}
  if isinstance(metrics, Mapping):
    items = list(metrics.items())
  else:
    items = []
    for m in metrics:
      if isinstance(m, str):
        items.append((m, m))
      elif callable(m):
        items.append((getattr(m, "__name__", type(m).__name__), m))
      else:
        raise TypeError(f"A metric must be a name or a function, got {m!r}.")
  out = {}
  for name, fn in items:
    if isinstance(fn, str):
      if fn not in METRICS:
        raise ValueError(
            f"Unknown metric {fn!r}. Use one of {sorted(METRICS)} or a function "
            "metric(y_pred, y_true) returning one value per example.")
      fn = METRICS[fn]
    if name in ("loss", "count") or name in out:
      raise ValueError(f"Metric name {name!r} is taken; give metrics as a dict "
                       "{name: function} to name them.")
    out[name] = fn
  return out


def check_per_example(shape, batch: int, what: str) -> None:
  """Raises unless `shape` has one row per example of a batch of `batch`."""
  shape = tuple(shape)
  if not shape or shape[0] != batch:
    got = "a scalar" if not shape else f"shape {shape}"
    raise ValueError(
        f"The {what} returned {got}, but it must return one value per example, "
        f"shape ({batch},) for this batch of {batch}. Do not average it (no "
        ".mean()): the trainer averages over the examples seen, exactly, with "
        "the padding of a short last batch left out.")


def per_example(values, batch: int, what: str) -> jax.Array:
  """Checks a loss or metric result and averages axes after the first."""
  values = jnp.asarray(values)
  check_per_example(values.shape, batch, what)
  if values.ndim > 1:
    values = jnp.mean(values.reshape(batch, -1), axis=1)
  return values


def describe(tree: Any) -> str:
  """Shapes of a pytree of arrays, for error messages."""
  shapes = jax.tree.map(lambda x: tuple(jnp.shape(x)), tree)
  return str(shapes)
