"""Models with several outputs: Keras's per-output losses, weights and metrics.

The per-output losses make one `OutputLosses`, a `jdist.losses.Loss` (the
weighted sum per example), so the train step sees one loss; metrics are
named as Keras names them (`<output>_loss`, `<output>_<metric>`). Outputs
are matched at trace time from the predictions' structure: a dict by key, a
list by position (named by the model's `output_names`, else `output_<i>`);
targets alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from jdist._src.ops import loss_objects
from jdist._src.ops import metrics as metrics_lib
from jdist._src.training import objectives


@dataclasses.dataclass(frozen=True)
class Output:
  """One output of a model, as the losses and metrics read it.

  Attributes:
    name: its name in the logs (`<name>_loss`, `<name>_<metric>`).
    index: its position among the outputs.
    key: a dict key or a position in the predictions (None: the only one).
    loss: its loss (None: it is not trained on).
    weight: its loss weight (None: 1).
  """

  name: str
  index: int
  key: Any
  loss: loss_objects.Loss | None
  weight: float | None = None

  def pred(self, y_pred):
    """This output's predictions."""
    return y_pred if self.key is None else y_pred[self.key]

  def true(self, y_true):
    """This output's targets, from targets keyed or ordered as the outputs.

    Raises:
      ValueError: the targets have no entry for this output.
    """
    if self.key is None or not isinstance(y_true, (Mapping, list, tuple)):
      return y_true
    if isinstance(y_true, Mapping):
      if self.name not in y_true:
        raise ValueError(
            f"The targets y have no entry for the model's output "
            f"{self.name!r} (their keys: {sorted(map(str, y_true))}): give "
            "y as a dict keyed by the outputs' names, or a list in their "
            "order.")
      return y_true[self.name]
    if self.index >= len(y_true):
      raise ValueError(
          f"The targets y are a list of {len(y_true)}, but the model has an "
          f"output {self.name!r} at position {self.index}: give one target "
          "per output.")
    return y_true[self.index]


def output_keys(y_pred, names: Sequence[str] | None) -> list[tuple[str, Any]]:
  """`[(name, key)]` of the outputs in predictions like `y_pred`.

  Raises:
    ValueError: an output is itself a structure (nested outputs).
  """
  if isinstance(y_pred, Mapping):
    pairs = [(str(k), k) for k in y_pred]
  elif isinstance(y_pred, (list, tuple)):
    if names is None or len(names) != len(y_pred):
      names = [f"output_{i}" for i in range(len(y_pred))]
    pairs = list(zip(map(str, names), range(len(y_pred))))
  else:
    return [(names[0] if names and len(names) == 1 else "output", None)]
  for name, key in pairs:
    if not hasattr(y_pred[key], "shape"):
      raise ValueError(
          f"The model's output {name!r} is itself a {type(y_pred[key]).__name__}"
          ": jdist matches losses and metrics to a flat dict or list of "
          "outputs. Return the outputs flat.")
  return pairs


def _per_output(spec, pairs, what: str) -> list:
  """`spec` (a dict, a list, or one value for all) as one value per output."""
  names = [n for n, _ in pairs]
  if isinstance(spec, Mapping):
    unknown = sorted(set(map(str, spec)) - set(names))
    if unknown:
      raise ValueError(
          f"{what} names {unknown}, which are not outputs of the model: its "
          f"outputs are {names}.")
    return [spec.get(n) for n in names]
  if isinstance(spec, (list, tuple)):
    if len(spec) != len(names):
      raise ValueError(
          f"{what} is a list of {len(spec)}, but the model has "
          f"{len(names)} outputs {names}: give one entry per output (None "
          "for none), or a dict keyed by the outputs' names.")
    return list(spec)
  return [spec] * len(names)


class OutputLosses(loss_objects.Loss):
  """Keras's compiled loss of several outputs: per example, the sum of each
  output's loss times its weight.

  Args:
    losses: one loss for all, a dict `{output name: loss}` or a list in the
      outputs' order (None: no loss there), each as the Trainer takes one.
    loss_weights: None, one number, or a dict or list like `losses`.
    output_names: the model's names of its outputs (Keras' `output_names`).

  Example:
    >>> import jax.numpy as jnp
    >>> from jdist._src.training.outputs import OutputLosses
    >>> loss = OutputLosses({"a": "mse", "b": "mae"}, {"a": 1.0, "b": 0.5})
    >>> y = {"a": jnp.array([[1.0], [2.0]]), "b": jnp.array([[0.0], [4.0]])}
    >>> pred = {"a": jnp.array([[2.0], [2.0]]), "b": jnp.array([[1.0], [2.0]])}
    >>> loss.call(y, pred)
    Array([1.5, 1. ], dtype=float32)
  """

  def __init__(self, losses, loss_weights=None, output_names=None):
    super().__init__("none", "loss")
    resolve = lambda spec: None if spec is None else objectives.resolve_loss(
        spec)
    if isinstance(losses, Mapping):
      self._losses = {k: resolve(v) for k, v in losses.items()}
    elif isinstance(losses, (list, tuple)):
      self._losses = [resolve(v) for v in losses]
    else:
      self._losses = resolve(losses)
    _check_weights(loss_weights)
    self.loss_weights = loss_weights
    self.output_names = None if output_names is None else list(output_names)

  def outputs(self, y_pred) -> list[Output]:
    """The outputs of predictions like `y_pred`, with their losses.

    Raises:
      ValueError: the losses or weights do not match the outputs.
    """
    pairs = output_keys(y_pred, self.output_names)
    if isinstance(self._losses, (Mapping, list, tuple)) and pairs[0][1] is None:
      # One output: a dict or list of one names or holds its loss.
      pairs = [(pairs[0][0], None)]
      losses = self._losses
      if isinstance(losses, Mapping):
        losses = [next(iter(losses.values()))] if len(losses) == 1 else losses
      losses = _per_output(losses, pairs, "loss")
    else:
      losses = _per_output(self._losses, pairs, "loss")
    weights = ([None] * len(pairs) if self.loss_weights is None else
               _per_output(self.loss_weights, pairs, "loss_weights"))
    return [Output(name, i, key, loss, w) for i, ((name, key), loss, w) in
            enumerate(zip(pairs, losses, weights))]

  def call(self, y_true, y_pred) -> jax.Array:
    rows = jax.tree.leaves(y_pred)[0].shape[0]
    total = None
    for out in self.outputs(y_pred):
      if out.loss is None:
        continue
      value = objectives.per_example(
          out.loss.call(out.true(y_true), out.pred(y_pred)), rows,
          f"loss of the output {out.name!r}")
      if out.weight is not None:
        value = value * out.weight
      total = value if total is None else total + value
    if total is None:
      raise ValueError("The loss gives no output a loss (every entry is "
                       "None): nothing would be trained.")
    return total

  def get_config(self) -> dict:
    return {"losses": self._losses, "loss_weights": self.loss_weights}


def _check_weights(weights) -> None:
  values = (weights.values() if isinstance(weights, Mapping) else
            weights if isinstance(weights, (list, tuple)) else
            [] if weights is None else [weights])
  for w in values:
    if w is not None and (isinstance(w, bool) or
                          not isinstance(w, (int, float))):
      raise TypeError(
          f"loss_weights must be numbers (a number, or a dict or list of "
          f"them like the loss), got {weights!r}.")


class _Held:
  """A value in a metric's static configuration, compared by identity."""

  def __init__(self, value):
    self.value = value


class OutputMetric(metrics_lib.Metric):
  """A metric of one output (Keras's `<output>_<metric>`).

  Attributes:
    held: the wrapped metric, fresh (its configuration).
    output: the `Output` it reads.
    takes_sample_weight: it is a weighted metric.
  """

  name: str = "output_metric"
  held: Any = None
  output: Any = None
  takes_sample_weight: bool = False

  @classmethod
  def of(cls, metric, name: str, output: Output,
         weighted: bool) -> "OutputMetric":
    """`metric` (a `jdist.metrics.Metric`) on `output`, named `name`."""
    fresh = metric.reset()
    return cls(name=name, held=_Held(fresh), output=output,
               takes_sample_weight=weighted, totals=fresh.totals)

  def update(self, y_true, y_pred, sample_weight=None, *, mask=None
             ) -> "OutputMetric":
    """Adds a batch's examples of this output; returns the new metric."""
    inner = dataclasses.replace(self.held.value, totals=self.totals)
    new = inner.update(self.output.true(y_true), self.output.pred(y_pred),
                       sample_weight, mask=mask)
    return dataclasses.replace(self, totals=new.totals)

  def value_of(self, sums: dict):
    return self.held.value.value_of(sums)

  def with_sums(self, sums: dict) -> "OutputMetric":
    return dataclasses.replace(
        self, totals=self.held.value.with_sums(sums).totals)


class OutputLoss(metrics_lib.Mean):
  """One output's own loss in the logs (Keras's `<output>_loss`), without
  its loss weight.

  Attributes:
    output: the `Output` whose loss it logs.
  """

  name: str = "output_loss"
  output: Any = None
  takes_sample_weight: bool = True

  def update(self, y_true, y_pred, sample_weight=None, *, mask=None
             ) -> "OutputLoss":
    """Adds a batch's examples; returns the updated metric."""
    out = self.output
    y_pred = out.pred(y_pred)
    rows = jax.tree.leaves(y_pred)[0].shape[0]
    values = objectives.per_example(out.loss.call(out.true(y_true), y_pred),
                                    rows, f"loss of the output {out.name!r}")
    if sample_weight is not None:
      values = values * jnp.reshape(jnp.asarray(sample_weight, values.dtype),
                                    values.shape)
    return super().update(values, mask=mask)


def _metric_specs(metrics, outs: list[Output], what: str) -> list[list]:
  """Keras's per-output `metrics` (a dict or a list) as one list each."""
  if metrics is None:
    return [[] for _ in outs]
  pairs = [(o.name, o.key) for o in outs]
  if len(outs) == 1:
    per = [metrics if isinstance(metrics, (list, tuple)) else [metrics]]
  elif isinstance(metrics, Mapping) or (
      isinstance(metrics, (list, tuple)) and len(metrics) == len(outs)):
    per = _per_output(metrics, pairs, what)
  else:
    raise ValueError(
        f"{what} for a model with {len(outs)} outputs "
        f"{[o.name for o in outs]}: give a dict {{output name: metrics}} or a "
        "list with one entry (a metric or a list of them) per output.")
  return [[] if m is None else list(m) if isinstance(m, (list, tuple))
          else [m] for m in per]


def build_metrics(loss: OutputLosses, metrics, weighted_metrics, y,
                  y_pred) -> dict:
  """`{name: Metric}`, fresh, of a model with several outputs, for targets
  like `y` and predictions like `y_pred`, named as Keras names them.

  Raises:
    ValueError: the metrics do not match the outputs, or name one twice.
  """
  outs = loss.outputs(y_pred)
  built: dict = {}
  with_loss = [o for o in outs if o.loss is not None]
  if len(with_loss) > 1:
    for o in with_loss:
      built[f"{o.name}_loss"] = OutputLoss(f"{o.name}_loss", output=o)
  for specs, weighted, what in ((metrics, False, "metrics"),
                                (weighted_metrics, True, "weighted_metrics")):
    for out, items in zip(outs, _metric_specs(specs, outs, what)):
      _add_output_metrics(built, out, items, weighted, len(outs) > 1, y,
                          y_pred, what)
  return built


def _add_output_metrics(built: dict, out: Output, specs: list,
                        weighted: bool, prefixed: bool, y, y_pred,
                        what: str) -> None:
  """Adds `out`'s metrics to `built` under Keras's names."""
  items = objectives.metric_items(specs, what)
  inner = objectives.build_metrics(
      items, out.loss or loss_objects.Loss("none"),
      out.true(y), out.pred(y_pred))
  for name, metric in inner.items():
    full = f"{out.name}_{name}" if prefixed else name
    if full in built and weighted:
      full = (f"{out.name}_weighted_{name}" if prefixed else
              f"weighted_{name}")
    if full in built or full == "loss":
      raise ValueError(
          f"Two metrics are named {full!r}: name them apart ({what} as a "
          "dict of names, or metric objects with name=...).")
    built[full] = OutputMetric.of(metric, full, out, weighted)


def parts(loss: loss_objects.Loss, y_pred) -> list[tuple[Any, Callable,
                                                         Callable]]:
  """`[(loss, targets -> its part, predictions -> its part)]` per output
  with a loss, for the first-batch checks."""
  if not isinstance(loss, OutputLosses):
    return [(loss, lambda y: y, lambda p: p)]
  return [(o.loss, o.true, o.pred) for o in loss.outputs(y_pred)
          if o.loss is not None]
