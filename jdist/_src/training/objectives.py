"""The trainer's losses and metrics: Keras' names, order and meanings.

A name jdist does not mirror is looked up in Keras. Beyond Keras, the first
batch is checked on the host (docs/fit.md).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.keras import loading as keras_loading
from jdist._src.keras import objectives as keras_objectives
from jdist._src.ops import loss_objects
from jdist._src.ops import metrics as metrics_lib


def resolve_loss(loss) -> loss_objects.Loss:
  """The loss object for `loss`: a name, a `jdist.losses.Loss`, a Keras loss
  object, a function."""
  if keras_loading.is_loss(loss):
    return keras_objectives.KerasLoss(loss)
  if isinstance(loss, str):
    if loss not in loss_objects.BY_NAME and keras_loading.is_loaded():
      return keras_objectives.resolve_loss(loss)
    if loss not in loss_objects.BY_NAME:
      raise ValueError(
          f"Unknown loss {loss!r}. Use one of {sorted(loss_objects.BY_NAME)}, "
          "a jdist.losses object, or a function loss(y_true, y_pred) "
          "returning one value per example.")
    return loss_objects.BY_NAME[loss]()
  if isinstance(loss, loss_objects.Loss):
    return loss
  if not callable(loss):
    raise TypeError(f"loss must be a name, a jdist.losses object or a "
                    f"function, got {loss!r}.")
  return loss_objects.LossFunctionWrapper(loss)


_NAMED = {
    "sparse_categorical_accuracy": metrics_lib.SparseCategoricalAccuracy,
    "categorical_accuracy": metrics_lib.CategoricalAccuracy,
    "binary_accuracy": metrics_lib.BinaryAccuracy,
    "mse": metrics_lib.MeanSquaredError,
    "mean_squared_error": metrics_lib.MeanSquaredError,
    "mae": metrics_lib.MeanAbsoluteError,
    "mean_absolute_error": metrics_lib.MeanAbsoluteError,
}
_ACCURACY = ("accuracy", "acc")
METRIC_NAMES = sorted(_NAMED) + list(_ACCURACY)


def metric_items(metrics, what: str = "metrics") -> list[tuple[str, Any]]:
  """`[(name, metric spec)]` for `metrics=`; a single name or metric is a
  list of one (a string would otherwise be read letter by letter)."""
  if metrics is None:
    return []
  if isinstance(metrics, (str, metrics_lib.Metric)) or keras_loading.is_metric(
      metrics) or (
      callable(metrics) and not isinstance(metrics, Mapping)):
    metrics = [metrics]
  if isinstance(metrics, Mapping):
    items = list(metrics.items())
  else:
    items = []
    for m in metrics:
      if isinstance(m, str):
        items.append((m, m))
      elif isinstance(m, metrics_lib.Metric) or keras_loading.is_metric(m):
        items.append((m.name, m))
      elif callable(m):
        items.append((getattr(m, "__name__", type(m).__name__), m))
      else:
        raise TypeError(
            f"A metric must be a name, a jdist.metrics object or a function "
            f"metric(y_true, y_pred), got {m!r} in {what}=.")
  names = set()
  for name, spec in items:
    if isinstance(spec, str) and spec not in _NAMED and spec not in _ACCURACY \
        and keras_objectives.metric_for_name(spec) is None:
      raise ValueError(
          f"Unknown metric {spec!r}. Use one of {METRIC_NAMES}, a "
          "jdist.metrics object, or a function metric(y_true, y_pred) "
          "returning one value per example.")
    if name == "loss" or name in names:
      raise ValueError(f"Metric name {name!r} is taken; give metrics as a "
                       "dict {name: metric} to name them.")
    names.add(name)
  return items


def _accuracy(name: str, loss: loss_objects.Loss, y, y_pred):
  """Keras' choice for "accuracy": by the loss, then by the shapes."""
  kind = loss.kind
  if kind == "regression":  # a custom loss: the shapes decide, as in Keras
    if y_pred.shape[-1:] == (1,):
      kind = "binary"
    elif len(y.shape) < len(y_pred.shape) or y.shape[-1:] == (1,):
      kind = "sparse"
    else:
      kind = "categorical"
  if kind == "binary":
    return metrics_lib.BinaryAccuracy(
        name, threshold=0.0 if loss.from_logits else 0.5)
  if kind == "sparse":
    return metrics_lib.SparseCategoricalAccuracy(name)
  return metrics_lib.CategoricalAccuracy(name)


def build_metrics(items, loss: loss_objects.Loss, y, y_pred) -> dict:
  """`{name: jdist.metrics.Metric}`, fresh, given the data's shapes."""
  out = {}
  for name, spec in items:
    if isinstance(spec, metrics_lib.Metric):
      metric = spec.reset()
    elif keras_loading.is_metric(spec):
      metric = keras_objectives.KerasMetric.of(spec, name)
    elif isinstance(spec, str) and spec in _ACCURACY:
      metric = _accuracy(name, loss, y, y_pred)
    elif isinstance(spec, str) and spec in _NAMED:
      metric = _NAMED[spec](name)
    elif isinstance(spec, str):
      metric = keras_objectives.KerasMetric.of(
          keras_objectives.metric_for_name(spec), name)
    else:
      metric = metrics_lib.MeanMetricWrapper(spec, name)
    out[name] = metric
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


# --- the first batch, on the host -------------------------------------------


def _ref(loss: loss_objects.Loss, from_logits: bool) -> str:
  return f"jdist.losses.{type(loss).__name__}(from_logits={from_logits})"


def check_predictions(loss: loss_objects.Loss, y_pred: np.ndarray) -> None:
  """Raises if the first batch's predictions contradict `loss.from_logits`
  (Keras silently clips logits given to a probability loss)."""
  if loss.from_logits is None or loss.kind == "regression":
    return
  y_pred = np.asarray(y_pred, np.float64)
  if not y_pred.size or not np.all(np.isfinite(y_pred)):
    return
  lo, hi = float(y_pred.min()), float(y_pred.max())
  classes = loss.kind in ("sparse", "categorical") and y_pred.shape[-1] > 1
  sums = np.sum(y_pred, axis=-1) if classes else None
  if not loss.from_logits:
    if lo < 0 or hi > 1:
      raise ValueError(
          f"The loss {loss.name} expects probabilities (Keras' default, "
          f"from_logits=False), but the model's predictions on the first "
          f"batch range from {lo:.4g} to {hi:.4g}: they look like logits. Use "
          f"{_ref(loss, True)}, or end the model with a "
          f"{'softmax' if classes else 'sigmoid'}.")
    if classes and np.max(np.abs(sums - 1)) > 1e-3:
      raise ValueError(
          f"The loss {loss.name} expects probabilities (from_logits=False), "
          f"but the rows of the model's predictions on the first batch sum to "
          f"{float(sums.min()):.4g} .. {float(sums.max()):.4g}, not 1. If they "
          f"are logits, use {_ref(loss, True)}; if they are scores, end the "
          "model with a softmax.")
  elif classes and lo >= 0 and hi <= 1 and np.max(np.abs(sums - 1)) < 1e-5:
    raise ValueError(
        f"The loss {loss.name} was built with from_logits=True, but the "
        "model's predictions on the first batch are probabilities (in [0, 1], "
        f"each row summing to 1): a softmax already ran. Use "
        f"{_ref(loss, False)}, or drop the model's final softmax.")


def check_targets(loss: loss_objects.Loss, y, where: Callable[[int], str], *,
                  num_classes: int | None) -> None:
  """Raises if host targets `y` cannot be what `loss` reads, naming an
  example by `where(row)`: integer class losses need integral labels in
  [0, num_classes) (else truncation or a NaN loss), binary ones [0, 1]."""
  if loss.kind not in ("sparse", "binary"):
    return
  y = np.asarray(y)
  if y.dtype.kind not in "biuf" or not y.size:
    return
  flat = y.reshape(y.shape[0], -1) if y.ndim else y.reshape(1, 1)
  if loss.kind == "binary":
    bad = np.nonzero(np.any((flat < 0) | (flat > 1), axis=1))[0]
    if bad.size:
      raise ValueError(
          f"{loss.name} needs targets between 0 and 1, but {where(bad[0])} "
          f"has {flat[bad[0]].tolist()}.")
    return
  if y.dtype.kind == "f":
    bad = np.nonzero(np.any(flat != np.floor(flat), axis=1))[0]
    if bad.size:
      raise ValueError(
          f"{loss.name} needs integer class labels, but {where(bad[0])} has "
          f"the label {flat[bad[0]].tolist()}, which would be truncated. "
          "Pass labels as integers (or use CategoricalCrossentropy for "
          "one-hot or soft targets).")
  if num_classes is not None:
    bad = np.nonzero(np.any((flat < 0) | (flat >= num_classes), axis=1))[0]
    if bad.size:
      raise ValueError(
          f"{loss.name} needs class labels in [0, {num_classes}) for a model "
          f"with {num_classes} outputs, but {where(bad[0])} has the label "
          f"{flat[bad[0]].tolist()} (the loss would be NaN). Check the labels, "
          "or give the model one output per class.")


def check_loss_order(loss: loss_objects.Loss, y, y_pred) -> str | None:
  """A hint when a function loss takes `(y_pred, y_true)`: the Keras order
  fails on these shapes and the swapped one does not."""
  if not isinstance(loss, loss_objects.LossFunctionWrapper):
    return None
  try:
    jax.eval_shape(loss.fn, y_pred, y)
  except Exception:  # the swapped order fails too: not an order problem
    return None
  return (" jdist calls loss(y_true, y_pred), as Keras does, and this "
          "function works with the arguments the other way round: swap its "
          "parameters.")
