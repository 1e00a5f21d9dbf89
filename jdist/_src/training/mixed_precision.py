"""The Trainer's side of mixed precision: a model that computes in low
precision on float32 parameters, and the optimizer that goes with it.

The model's parameters are cast to the policy's compute dtype on the way in
(and its floating-point inputs with them), so flax layers, which compute in
the dtype of what they are given unless told otherwise, run in bfloat16 or
float16; the predictions come back in float32 for the loss and metrics.
Gradients flow back through the cast to the float32 parameters.

Inside a training step the parameters are typed as varying over replicas
before the cast: the all-reduce of their gradients (the transpose of that
typing) then runs on the float32 gradients, not on their float16 image.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jdist._src.core import context
from jdist._src.core import in_step
from jdist._src.ops import loss_scale
from jdist._src.ops.precision import DTypePolicy


class MixedPrecisionModel:
  """A model adapter (`model.py`) that applies a mixed `DTypePolicy`."""

  def __init__(self, model, policy: DTypePolicy):
    self.model = model
    self.policy = policy

  def check(self) -> None:
    self.model.check()

  def init(self, key, x) -> tuple[Any, Any]:
    return self.model.init(key, x)

  def export(self, params, model_state):
    return self.model.export(params, model_state)

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    ctx = context.current_replica_context()
    if train and ctx is not None:
      params = jax.tree.map(lambda p: in_step.to_varying(p, ctx.axis_name),
                            params)
    y, model_state = self.model.apply(
        self.policy.cast_to_compute(params), model_state,
        self.policy.cast_to_compute(x), train=train, rng=rng)
    return self.policy.cast_to_variable(y), model_state


def adapt(model, policy: DTypePolicy):
  """`model` (an adapter) computing under `policy`; itself for float32."""
  return MixedPrecisionModel(model, policy) if policy.is_mixed else model


def optimizer(tx: optax.GradientTransformation, policy: DTypePolicy
              ) -> optax.GradientTransformation:
  """`tx` with dynamic loss scaling where the policy needs it (float16),
  unless it scales the loss already (`jdist.loss_scale_optimizer`).

  Decided from `tx` alone, when the trainer is made: every step function
  built later, before or after the parameters exist, uses the same one.
  """
  if not policy.needs_loss_scaling or isinstance(
      tx, loss_scale.LossScaleTransformation):
    return tx
  return loss_scale.loss_scale_optimizer(tx)


def check_scaled_once(given: optax.GradientTransformation,
                      used: optax.GradientTransformation, params) -> None:
  """Fails if `optimizer` wrapped a transformation whose state shows that it
  scales the loss already (built by hand rather than by
  `jdist.loss_scale_optimizer`): its gradients would be unscaled twice.

  Raises:
    ValueError: the loss would be scaled twice.
  """
  if used is not given and is_loss_scaled(jax.eval_shape(given.init, params)):
    raise ValueError(
        "The optimizer scales the loss already (its state is a "
        "jdist.LossScaleState), but it is not the transformation "
        "jdist.loss_scale_optimizer returned, so dtype_policy="
        "\"mixed_float16\" wrapped it in loss scaling a second time. Pass "
        "jdist.loss_scale_optimizer(...)'s result itself as the optimizer.")


def scales_loss(tx: optax.GradientTransformation) -> bool:
  """Whether `tx` is `jdist.loss_scale_optimizer`'s (fit logs its scale)."""
  return isinstance(tx, loss_scale.LossScaleTransformation)


def is_loss_scaled(opt_state) -> bool:
  """Whether an optimizer state (or its abstract structure) is that of
  `jdist.loss_scale_optimizer`."""
  return isinstance(opt_state, loss_scale.LossScaleState)


def train_logs(opt_state) -> dict:
  """What fit adds to its logs for a loss-scaled optimizer (on the devices):
  the current scale and the steps skipped so far."""
  if not is_loss_scaled(opt_state):
    return {}
  return {"loss_scale": opt_state.loss_scale.scale,
          "skipped_steps": opt_state.skipped_steps}
