"""The per-replica train, evaluation and prediction steps of a
`TrainingProgram` (each adds to the running sums, `totals.py`), and the
checks that trace them against the data before any step runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdist._src.core import in_step
from jdist._src.core import placement
from jdist._src.core.replica_context import resolve_batch
from jdist._src.ops import accumulation
from jdist._src.ops import loss_scale
from jdist._src.ops import losses
from jdist._src.ops import metrics as metrics_lib
from jdist._src.ops.loss_objects import Loss
from jdist._src.training import objectives
from jdist._src.training.state import TrainState


def _batch_size(x) -> int:
  return jax.tree.leaves(x)[0].shape[0]


def _per_example_loss(loss: Loss, y, y_pred, b: int) -> jax.Array:
  return objectives.per_example(loss.call(y, y_pred), b, "loss")


def _apply(model, params, model_state, x, *, train: bool, rng=None):
  """`(y_pred, model_state, own)`: outputs, new state, and the sum of the
  model's own losses (None without)."""
  out = model.apply(params, model_state, x, train=train, rng=rng)
  return out if model.own_losses else (*out, None)


def _logged_loss(per_ex_loss, sw, own) -> jax.Array:
  """The loss's running mean's addend per example, own losses included."""
  values = per_ex_loss if sw is None else per_ex_loss * sw
  return values if own is None else values + jax.lax.stop_gradient(own)


def _accumulate(totals: dict, loss_values, y_pred, batch: dict,
                weighted: frozenset) -> dict:
  """Adds the batch to every metric, padding masked out; metrics named in
  `weighted` take the sample weights."""
  y, sw = batch["y"], batch.get("sample_weight")
  y_pred = jax.lax.stop_gradient(y_pred)
  new = {"loss": totals["loss"].update(loss_values)}
  for name, metric in totals.items():
    if name != "loss":
      takes = name in weighted or getattr(metric, "takes_sample_weight", False)
      new[name] = metric.update(y, y_pred, sw if takes else None)
  return new


def _mirror_model_state(model_state):
  """Model state that varies over replicas, averaged as TF aggregates
  sync-on-read variables (integers: their maximum)."""
  batch = resolve_batch()
  ctx = batch.replica_context
  if ctx is None:
    return model_state

  def mirror(v):
    if not in_step.is_varying(v, ctx.axis_name):
      return v
    if not jnp.issubdtype(v.dtype, jnp.inexact):
      # Integer state (a Keras random layer's seed, a counter) holds the
      # same value on every replica, typed as varying where a scan carried
      # it: its maximum is that value, where a mean through float32 would
      # round one above 2**24.
      return ctx.all_reduce("max", v)
    return ctx.all_reduce("mean", v)

  return jax.tree.map(mirror, model_state)


def _loss_scaling(opt_state):
  """Multiplies the loss by the optimizer's loss scale, if it has one."""
  if isinstance(opt_state, loss_scale.LossScaleState):
    return opt_state.loss_scale.scale_loss
  return lambda loss: loss


def make_train_step(model, loss: Loss, tx: optax.GradientTransformation,
                    weighted: frozenset = frozenset(), *,
                    micro_batches: int = 1, batches_per_step: int = 1):
  """`(state, totals, batch) -> (state, totals)`, run once per replica.

  Args:
    micro_batches: M: each batch runs as M micro-batches.
    batches_per_step: K: the batch holds K batches joined; one optimizer
      step over all, batch `j` drawing from `fold_in(key, step * K + j)`.

  With M x K above 1 the micro-batches run in a `lax.scan` with one gradient
  reduction (`jdist.accumulate_gradients`'s engine).
  """
  k = batches_per_step

  def train_step(state: TrainState, totals: dict, batch: dict):
    scale = _loss_scaling(state.opt_state)
    # A ShardedOptimizer's gradients are each replica's own: its update
    # reduce-scatters them instead of the all-reduce autodiff would do.
    own_grads = hasattr(tx, "value_and_grad")

    def loss_of(params, model_state, micro, index):
      x, y = micro["x"], micro["y"]
      sw = micro.get("sample_weight")
      y_pred, model_state, own = _apply(
          model, params, model_state, x, train=True,
          rng=state.batch_key(index // micro_batches, k))
      per_ex = _per_example_loss(loss, y, y_pred, _batch_size(x))
      scaled = losses.compute_average_loss(
          per_ex if sw is None else per_ex * sw)
      if own is not None:
        # Once per optimizer step over all replicas and micro-batches, as
        # Keras adds model.losses once per step.
        scaled = scaled + losses.scale_regularization_loss(
            own) / (micro_batches * k)
      return scale(scaled), (model_state, (y_pred, _logged_loss(
          per_ex, sw, own)))

    if micro_batches * k == 1 and own_grads:
      (_, (model_state, (y_pred, per_ex))), grads = tx.value_and_grad(
          lambda p: loss_of(p, state.model_state, batch, 0),
          has_aux=True)(state.params)
    else:
      (_, (model_state, rows)), grads = accumulation.scan_micro_batches(
          loss_of, state.params, state.model_state, batch,
          num_micro_batches=micro_batches, num_batches=k,
          sum_over_replicas=not own_grads)
      y_pred, per_ex = accumulation.merge_micro_batches(rows)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1,
                              params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state,
                              model_state=_mirror_model_state(model_state))
    return new_state, _accumulate(totals, per_ex, y_pred, batch, weighted)

  return train_step


def make_eval_step(model, loss: Loss, weighted: frozenset = frozenset()):
  """`(state, totals, batch) -> totals`, run once per replica."""

  def eval_step(state: TrainState, totals: dict, batch: dict):
    x, y = batch["x"], batch["y"]
    y_pred, _, own = _apply(model, state.params, state.model_state, x,
                            train=False)
    per_ex = _per_example_loss(loss, y, y_pred, _batch_size(x))
    return _accumulate(totals, _logged_loss(
        per_ex, batch.get("sample_weight"), own), y_pred, batch, weighted)

  return eval_step


def make_predict_step(model):
  """`(state, batch) -> predictions`, run once per replica."""

  def predict_step(state: TrainState, batch: dict):
    return _apply(model, state.params, state.model_state, batch["x"],
                  train=False)[0]

  return predict_step


def predictions(model, state: TrainState, x):
  """The model's predictions for host inputs `x`, on the host (eval mode)."""
  state = jax.tree.map(lambda a: np.asarray(placement.to_host(a)),
                       (state.params, state.model_state))
  y_pred = jax.jit(lambda p, s, x: model.apply(p, s, x, train=False)[0])(
      *state, x)
  return jax.tree.map(np.asarray, y_pred)


def input_spec(x) -> Any:
  """The shapes and dtypes of host inputs `x` (a pytree of arrays)."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), x)


def spec_key(tree) -> tuple:
  """A hashable key of a pytree's structure, shapes and dtypes."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(
      (tuple(jnp.shape(a)), a.dtype if hasattr(a, "dtype") else
       np.asarray(a).dtype) for a in leaves)


def output_spec(model, state: TrainState, sample: dict, what: str,
                initialised_for=None):
  """The model's output shapes for `sample`'s inputs, traced (nothing runs).

  Args:
    initialised_for: the `input_spec` the parameters were initialised
      from, if known (named in the error).

  Raises:
    TypeError: the model's signature does not take the trainer's call.
    ValueError: the model fails on the data's inputs.
  """
  x = input_spec(sample["x"])
  model.check()
  try:
    return jax.eval_shape(
        lambda p, s, x: model.apply(p, s, x, train=False)[0],
        state.params, state.model_state, x)
  except Exception as e:  # the model's own error, put in context
    hint = ""
    example = lambda t: jax.tree.map(lambda a: tuple(a.shape[1:]), t)
    if initialised_for is not None and example(initialised_for) != example(x):
      hint = (f"\nCheck that the data has the shape the model was "
              f"initialised for: examples of shapes {example(initialised_for)}"
              f"; this data's examples have {example(x)}.")
    raise ValueError(
        f"The model fails on the {what}'s inputs (x shapes "
        f"{objectives.describe(x)}): {type(e).__name__}: {e}{hint}") from e


def check_objectives(loss: Loss, metrics: dict, sample: dict, y_pred,
                     what: str) -> None:
  """Traces the loss and metrics on the data's targets; nothing runs.

  Raises:
    ValueError: the loss or a metric cannot compare the predictions with
      the targets, or does not return one value per example.
  """
  y = input_spec(sample["y"])
  b = _batch_size(sample["x"])
  try:
    out = jax.eval_shape(loss.call, y, y_pred)
  except Exception as e:
    raise ValueError(
        f"The loss cannot compare the {what}'s targets (shapes "
        f"{objectives.describe(y)}) with the model's predictions (shapes "
        f"{objectives.describe(y_pred)}): {type(e).__name__}: {e}"
        f"{objectives.check_loss_order(loss, y, y_pred) or ''}") from e
  _check_per_example_output(out, b, "loss")
  for name, metric in metrics.items():
    if isinstance(metric, metrics_lib.MeanMetricWrapper):
      try:
        out = jax.eval_shape(metric.fn, y, y_pred)
      except Exception as e:
        raise _metric_error(name, what, y, y_pred, e) from e
      _check_per_example_output(out, b, f"metric {name!r}")
    try:
      jax.eval_shape(lambda m, t, p: m.update(t, p).totals, metric, y, y_pred)
    except Exception as e:
      raise _metric_error(name, what, y, y_pred, e) from e


def _check_per_example_output(out, b: int, name: str) -> None:
  if not isinstance(out, jax.ShapeDtypeStruct):
    raise ValueError(f"The {name} must return an array of per-example "
                     f"values, got {objectives.describe(out)}.")
  objectives.check_per_example(out.shape, b, name)


def _metric_error(name, what, y, y_pred, e) -> ValueError:
  return ValueError(
      f"The metric {name!r} cannot compare the {what}'s targets (shapes "
      f"{objectives.describe(y)}) with the model's predictions (shapes "
      f"{objectives.describe(y_pred)}): {type(e).__name__}: {e}")
