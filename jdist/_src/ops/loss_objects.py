"""Keras' loss classes: `loss(y_true, y_pred)`, probabilities unless
`from_logits=True`, with Keras' reductions; inside a step the default one
is refused, as TensorFlow refuses it under a strategy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jdist._src.core import context

EPSILON = 1e-7  # Keras' clip of probabilities before the log
REDUCTIONS = ("sum_over_batch_size", "sum", "none", None)


def _float(x) -> jax.Array:
  x = jnp.asarray(x)
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


class Loss:
  """Base class of the loss objects.

  Args:
    reduction: "sum_over_batch_size" (the mean), "sum" or "none".
    name: the loss's name.

  Attributes:
    from_logits: whether predictions are logits (None: not a class loss).
    kind: "categorical", "sparse", "binary" or "regression".
  """

  from_logits = None
  kind = "regression"

  def __init__(self, reduction="sum_over_batch_size", name: str | None = None):
    if reduction not in REDUCTIONS:
      raise ValueError(f"reduction must be one of {REDUCTIONS}, got "
                       f"{reduction!r}.")
    self.reduction = reduction
    self.name = name or _snake(type(self).__name__)

  def call(self, y_true, y_pred) -> jax.Array:
    """One loss per example (the batch's leading axis)."""
    raise NotImplementedError

  def __call__(self, y_true, y_pred, sample_weight=None) -> jax.Array:
    losses = self.call(y_true, y_pred)
    if sample_weight is not None:
      sw = _float(sample_weight)
      sw = sw.reshape(sw.shape + (1,) * (losses.ndim - sw.ndim))
      losses = losses * sw
    if self.reduction in ("none", None):
      return losses
    if self.reduction == "sum":
      return jnp.sum(losses)
    if context.current_replica_context() is not None:
      raise ValueError(
          f"{type(self).__name__}(reduction='sum_over_batch_size') was called "
          "inside a jdist step: it averages over this replica's batch, and "
          "the gradients, summed over replicas, would be num_replicas times "
          "too large (TensorFlow refuses it under a strategy too). Build it "
          "with reduction='none' and pass the per-example losses to "
          "jdist.compute_average_loss(per_example_loss), which divides by the "
          "global batch.")
    return jnp.sum(losses) / losses.size

  def get_config(self) -> dict:
    config = {"name": self.name, "reduction": self.reduction}
    if self.from_logits is not None:
      config["from_logits"] = self.from_logits
    return config

  def __repr__(self) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
    return f"{type(self).__name__}({args})"


def _snake(name: str) -> str:
  out = [name[0].lower()]
  for c in name[1:]:
    out.append("_" + c.lower() if c.isupper() else c)
  return "".join(out)


class SparseCategoricalCrossentropy(Loss):
  """Cross-entropy of integer labels, as `keras.losses.SparseCategoricalCrossentropy`.

  Args:
    from_logits: predictions are logits (True) or probabilities (False).
    reduction, name: see `Loss`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> loss = jdist.losses.SparseCategoricalCrossentropy(from_logits=True,
    ...                                                   reduction="none")
    >>> loss(jnp.array([0, 1]), jnp.array([[2.0, 0.0], [0.0, 0.0]])).round(4)
    Array([0.1269, 0.6931], dtype=float32)
  """

  kind = "sparse"

  def __init__(self, from_logits: bool = False,
               reduction="sum_over_batch_size",
               name: str = "sparse_categorical_crossentropy"):
    super().__init__(reduction, name)
    self.from_logits = bool(from_logits)

  def call(self, y_true, y_pred):
    y_pred = _float(y_pred)
    labels = jnp.asarray(y_true)
    if labels.ndim == y_pred.ndim and labels.shape[-1] == 1:
      labels = labels[..., 0]
    labels = labels.astype(jnp.int32)
    if self.from_logits:
      return optax.softmax_cross_entropy_with_integer_labels(y_pred, labels)
    probs = jnp.clip(y_pred / jnp.sum(y_pred, -1, keepdims=True), EPSILON,
                     1 - EPSILON)
    return -jnp.take_along_axis(jnp.log(probs), labels[..., None], -1)[..., 0]


class CategoricalCrossentropy(Loss):
  """Cross-entropy of one-hot (or soft) targets, as in Keras.

  Args:
    from_logits: predictions are logits (True) or probabilities (False).
    label_smoothing: mixes the targets with the uniform distribution.
    reduction, name: see `Loss`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> loss = jdist.losses.CategoricalCrossentropy()
    >>> round(float(loss(jnp.array([[0.0, 1.0]]), jnp.array([[0.5, 0.5]]))), 4)
    0.6931
  """

  kind = "categorical"

  def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0,
               reduction="sum_over_batch_size",
               name: str = "categorical_crossentropy"):
    super().__init__(reduction, name)
    self.from_logits = bool(from_logits)
    self.label_smoothing = float(label_smoothing)

  def call(self, y_true, y_pred):
    y_pred = _float(y_pred)
    y_true = _float(y_true)
    if self.label_smoothing:
      k = y_pred.shape[-1]
      y_true = y_true * (1 - self.label_smoothing) + self.label_smoothing / k
    if self.from_logits:
      return optax.softmax_cross_entropy(y_pred, y_true)
    probs = jnp.clip(y_pred / jnp.sum(y_pred, -1, keepdims=True), EPSILON,
                     1 - EPSILON)
    return -jnp.sum(y_true * jnp.log(probs), -1)


class BinaryCrossentropy(Loss):
  """Cross-entropy of 0/1 targets, as `keras.losses.BinaryCrossentropy`.

  Args:
    from_logits: predictions are logits (True) or probabilities (False).
    label_smoothing: squeezes the targets towards 0.5.
    reduction, name: see `Loss`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> loss = jdist.losses.BinaryCrossentropy(from_logits=True)
    >>> round(float(loss(jnp.array([[1.0]]), jnp.array([[0.0]]))), 4)
    0.6931
  """

  kind = "binary"

  def __init__(self, from_logits: bool = False, label_smoothing: float = 0.0,
               reduction="sum_over_batch_size",
               name: str = "binary_crossentropy"):
    super().__init__(reduction, name)
    self.from_logits = bool(from_logits)
    self.label_smoothing = float(label_smoothing)

  def call(self, y_true, y_pred):
    y_pred = _float(y_pred)
    y_true = _float(y_true)
    if y_true.ndim == y_pred.ndim - 1 and y_pred.shape[-1] == 1:
      y_true = y_true[..., None]
    y_true = jnp.broadcast_to(y_true, y_pred.shape).astype(y_pred.dtype)
    if self.label_smoothing:
      y_true = y_true * (1 - self.label_smoothing) + 0.5 * self.label_smoothing
    if self.from_logits:
      per = optax.sigmoid_binary_cross_entropy(y_pred, y_true)
    else:
      p = jnp.clip(y_pred, EPSILON, 1 - EPSILON)
      per = -(y_true * jnp.log(p) + (1 - y_true) * jnp.log(1 - p))
    return jnp.mean(per, axis=-1) if per.ndim > 1 else per


def same_shape(y_true, y_pred) -> tuple[jax.Array, jax.Array]:
  """Targets and predictions as floats of one shape (a trailing 1 added)."""
  y_pred, y_true = _float(y_pred), _float(y_true)
  if y_true.ndim == y_pred.ndim - 1 and y_pred.shape[-1] == 1:
    y_true = y_true[..., None]
  if y_true.shape != y_pred.shape:
    raise ValueError(
        f"targets of shape {y_true.shape} do not match predictions of shape "
        f"{y_pred.shape}; this loss or metric compares them element by element.")
  return y_true, y_pred


def _per_example_error(op):
  def error(y_true, y_pred) -> jax.Array:
    y_true, y_pred = same_shape(y_true, y_pred)
    per = op(y_pred - y_true)
    return jnp.mean(per, axis=-1) if per.ndim > 1 else per
  return error


# Per example: the mean over the last axis of the squared (absolute) error.
squared_error = _per_example_error(jnp.square)
absolute_error = _per_example_error(jnp.abs)


class MeanSquaredError(Loss):
  """Mean over the last axis of `(y_true - y_pred) ** 2`, as in Keras.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> float(jdist.losses.MeanSquaredError()(jnp.array([1.0, 2.0]), jnp.array([2.0, 4.0])))
    2.5
  """

  def __init__(self, reduction="sum_over_batch_size",
               name: str = "mean_squared_error"):
    super().__init__(reduction, name)

  def call(self, y_true, y_pred):
    return squared_error(y_true, y_pred)


class MeanAbsoluteError(Loss):
  """Mean over the last axis of `|y_true - y_pred|`, as in Keras.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> float(jdist.losses.MeanAbsoluteError()(jnp.array([1.0, 2.0]), jnp.array([2.0, 4.0])))
    1.5
  """

  def __init__(self, reduction="sum_over_batch_size",
               name: str = "mean_absolute_error"):
    super().__init__(reduction, name)

  def call(self, y_true, y_pred):
    return absolute_error(y_true, y_pred)


class LossFunctionWrapper(Loss):
  """A per-example function `fn(y_true, y_pred)` as a loss object.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> loss = jdist.losses.LossFunctionWrapper(lambda t, p: jnp.abs(t - p))
    >>> float(loss(jnp.array([1.0, 3.0]), jnp.array([2.0, 2.0])))
    1.0
  """

  def __init__(self, fn, reduction="sum_over_batch_size", name=None):
    if not callable(fn):
      raise TypeError(f"LossFunctionWrapper needs a function, got {fn!r}.")
    super().__init__(reduction, name or getattr(fn, "__name__", "loss"))
    self.fn = fn

  def call(self, y_true, y_pred):
    return self.fn(y_true, y_pred)


# Keras' string names: the classes with their defaults (probabilities).
BY_NAME = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
}
