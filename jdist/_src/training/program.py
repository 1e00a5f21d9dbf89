"""`TrainingProgram`: what training computes, as pure functions.

Model, loss, metrics, optimizer and precision policy in; the initial state
and the per-replica steps out. No strategy, data or loop. Each kind of
model, optimizer and loss enters through one entry point (`model.adapt`,
`optimizers.resolve`, `objectives.resolve_loss`, `metric_items`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdist._src.keras import compiled as keras_compiled
from jdist._src.ops import precision
from jdist._src.ops.loss_objects import Loss
from jdist._src.training import mixed_precision
from jdist._src.training import model as model_lib
from jdist._src.training import objectives
from jdist._src.training import optimizers
from jdist._src.training import outputs
from jdist._src.training import steps
from jdist._src.training.state import TrainState


@dataclasses.dataclass(frozen=True, eq=False)
class TrainingProgram:
  """A model, loss, metrics, optimizer and precision policy as pure functions.

  `init` makes a fresh `TrainState`; `train_step`, `test_step` and
  `predict_step` run per replica inside a strategy's compiled step, each
  one function object so that a strategy compiles it once.

  Attributes:
    model: the `model.ModelAdapter`, computing under `policy`.
    loss: the `jdist.losses.Loss` the train step minimises.
    optimizer: the optax transformation the train step applies (loss
      scaled under "mixed_float16").
    policy: the mixed precision `DTypePolicy`.
    metric_items, weighted_items: `[(name, spec)]` of the metrics and the
      weighted metrics.
    output_metrics: the per-output `(metrics, weighted_metrics)`, or None.
    micro_batches: M micro-batches per replica's batch.
    batches_per_step: K batches per optimizer step (accumulation).
    given_optimizer: the optimizer before loss scaling.

  Example:
    >>> import jdist, jax, numpy as np, optax
    >>> from jdist.examples.models import MLP
    >>> from jdist._src.training.program import TrainingProgram
    >>> program = TrainingProgram.make(
    ...     MLP(classes=2), optimizer=optax.sgd(0.1),
    ...     loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    >>> keys = jax.random.split(jax.random.key(0))
    >>> state = program.init(*keys, np.zeros((1, 4), np.float32))
    >>> int(state.step), program.metrics_names
    (0, ['loss', 'accuracy'])
  """

  model: model_lib.ModelAdapter
  loss: Loss
  optimizer: optax.GradientTransformation
  policy: precision.DTypePolicy
  metric_items: tuple = ()
  weighted_items: tuple = ()
  output_metrics: tuple | None = None
  micro_batches: int = 1
  batches_per_step: int = 1
  given_optimizer: optax.GradientTransformation | None = None

  @classmethod
  def make(cls, model, *, optimizer, loss, metrics=None, weighted_metrics=None,
           params=None, dtype_policy=None, micro_batches: int = 1,
           batches_per_step: int = 1, loss_weights=None) -> "TrainingProgram":
    """The program for what a user passes to `jdist.Trainer` (loss scaling
    decided here, so every step function uses the same optimizer).

    Raises:
      TypeError, ValueError: an argument jdist cannot train with, or metric
        names used twice.
    """
    given = optimizers.resolve(optimizer)
    adapter = model_lib.adapt(model, params)
    # A Keras model computes under its layers' dtype policy: the default.
    policy = precision.policy_of(
        dtype_policy if dtype_policy is not None else
        adapter.dtype_policy or "float32")
    names = adapter.output_names
    output_metrics = None
    if (isinstance(loss, (Mapping, list, tuple)) or loss_weights is not None
        or len(names or ()) > 1):
      # Keras's per-output losses, weights and metrics (`outputs.py`).
      loss = outputs.OutputLosses(loss, loss_weights, names)
      metric_items = weighted_items = ()
      output_metrics = (metrics, weighted_metrics)
    else:
      loss = objectives.resolve_loss(loss)
      metric_items = tuple(objectives.metric_items(metrics))
      weighted_items = _weighted_names(
          metric_items, objectives.metric_items(weighted_metrics,
                                                "weighted_metrics"))
    check_count(batches_per_step, "gradient_accumulation_steps", minimum=1)
    check_count(micro_batches, "micro_batches", minimum=1)
    return cls(
        model=mixed_precision.adapt(adapter, policy), loss=loss,
        optimizer=mixed_precision.optimizer(given, policy), policy=policy,
        metric_items=metric_items, weighted_items=weighted_items,
        output_metrics=output_metrics, micro_batches=int(micro_batches),
        batches_per_step=int(batches_per_step), given_optimizer=given)

  @classmethod
  def with_compile(cls, model, given: dict, **kwargs
                   ) -> tuple["TrainingProgram", int]:
    """The program and `steps_per_execution` for the Trainer's compile
    arguments `given`, completed from a Keras model's own compile.

    Raises:
      TypeError, ValueError: as `make`; no optimizer or loss, given or
        compiled; or an argument given that the compile set otherwise.
    """
    args = keras_compiled.arguments(model, given)
    steps_per_execution = args.pop("steps_per_execution")
    return cls.make(model, **args, **kwargs), (
        1 if steps_per_execution is None else steps_per_execution)

  def with_optimizer(self, tx: optax.GradientTransformation
                     ) -> "TrainingProgram":
    """This program with the train step applying `tx` instead."""
    return dataclasses.replace(self, optimizer=tx)

  # --- what the program is made of -------------------------------------------

  @property
  def weighted(self) -> frozenset:
    """The names of the metrics that take sample weights."""
    return frozenset(n for n, _ in self.weighted_items)

  @property
  def metrics_names(self) -> list[str]:
    """The names in the logs, as Keras' `model.metrics_names`."""
    return ["loss"] + [n for n, _ in self.metric_items + self.weighted_items]

  @property
  def scales_loss(self) -> bool:
    """Whether the optimizer scales the loss (fit logs its scale)."""
    return mixed_precision.scales_loss(self.optimizer)

  # --- the functions -----------------------------------------------------------

  def init(self, init_key, rng_key, sample) -> TrainState:
    """A fresh `TrainState` for inputs like `sample` (traceable)."""
    params, model_state = self.model.init(init_key, sample)
    return TrainState(jnp.int32(0), params, self.optimizer.init(params),
                      model_state, jax.random.key_data(rng_key))

  def check_init(self, init_key, sample) -> None:
    """Traces the model's initialisation for `sample` (nothing runs).

    Raises:
      ValueError: the model cannot be initialised with these inputs, has no
        parameters, or its optimizer would scale the loss twice.
    """
    try:
      params, _ = jax.eval_shape(self.model.init, init_key, sample)
    except Exception as e:
      raise ValueError(
          f"The model cannot be initialised with inputs of shapes "
          f"{objectives.describe(sample)} (one example of the data's x): "
          f"{type(e).__name__}: {e}") from e
    if not jax.tree.leaves(params):
      raise ValueError(
          "The model has no trainable parameters (its parameter tree is "
          "empty), so training would change nothing. "
          "Check that its layers are created (flax linen: in setup or "
          "@nn.compact __call__; nnx: as attributes in __init__).")
    mixed_precision.check_scaled_once(self.given_optimizer or self.optimizer,
                                      self.optimizer, params)

  @functools.cached_property
  def train_step(self) -> Callable:
    """`(state, totals, batch) -> (state, totals)`, per replica."""
    return steps.make_train_step(
        self.model, self.loss, self.optimizer, self.weighted,
        micro_batches=self.micro_batches,
        batches_per_step=self.batches_per_step)

  @functools.cached_property
  def test_step(self) -> Callable:
    """`(state, totals, batch) -> totals`, per replica."""
    return steps.make_eval_step(self.model, self.loss, self.weighted)

  @functools.cached_property
  def predict_step(self) -> Callable:
    """`(state, batch) -> predictions`, per replica."""
    return steps.make_predict_step(self.model)

  def metrics_for(self, y, y_pred) -> dict:
    """`{name: Metric}`, fresh, for targets like `y` and predictions like
    `y_pred` (a metric's form may depend on their shapes)."""
    if self.output_metrics is not None:
      return outputs.build_metrics(self.loss, *self.output_metrics, y, y_pred)
    return {**objectives.build_metrics(self.metric_items, self.loss, y, y_pred),
            **objectives.build_metrics(self.weighted_items, self.loss, y,
                                       y_pred)}

  def export(self, state: TrainState) -> Any:
    """The trained model in its own terms (`ModelAdapter.export`)."""
    return self.model.export(state.params, state.model_state)


def _weighted_names(metric_items, weighted_items) -> tuple:
  """The weighted metrics' items, renamed `weighted_<name>` where a metric
  has the name, as Keras does.

  Raises:
    ValueError: that name is taken too.
  """
  taken = {n for n, _ in metric_items}
  out = []
  for name, spec in weighted_items:
    if name in taken:
      name = f"weighted_{name}"
      if name in taken:
        raise ValueError(f"Metric name {name!r} is taken; name the weighted "
                         "metrics apart (a dict {name: metric}).")
    taken.add(name)
    out.append((name, spec))
  return tuple(out)


def check_count(value, name: str, *, minimum: int) -> None:
  """Raises unless `value` is a whole number of at least `minimum`.

  Raises:
    TypeError: not a whole number.
    ValueError: below `minimum`.
  """
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a whole number, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {value}.")
