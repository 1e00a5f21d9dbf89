"""Dynamic loss scaling for float16 (Keras' LossScaleOptimizer). The
gradients reach it summed over replicas, so every replica skips the same
steps."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

# apply_if_finite gives up skipping after this many overflows in a row; loss
# scaling backs off instead, as long as it takes.
_NEVER_GIVE_UP = np.iinfo(np.int32).max
# The smallest scale (TensorFlow's rule: max(scale / factor, 1)).
MIN_SCALE = 1.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale (a pytree, at least 1) that grows after finite steps and
  halves on overflow.

  Attributes:
    scale: the current scale (a float32 scalar).
    good_steps: finite steps since the scale last changed (an int32 scalar).
    growth_steps: finite steps after which the scale doubles.
    factor: growth and back-off factor.

  Example:
    >>> import jdist, jax, jax.numpy as jnp
    >>> ls = jdist.DynamicLossScale.create(initial_scale=8.0, growth_steps=2)
    >>> float(ls.scale_loss(jnp.float32(0.5)))
    4.0
    >>> ls = jax.jit(lambda s: s.adjust(jnp.bool_(False)))(ls)  # overflow
    >>> float(ls.scale)
    4.0
  """

  scale: Any
  good_steps: Any
  growth_steps: int = dataclasses.field(default=2000,
                                        metadata={"static": True})
  factor: float = dataclasses.field(default=2.0, metadata={"static": True})

  @classmethod
  def create(cls, initial_scale: float = 2.0 ** 15, growth_steps: int = 2000,
             factor: float = 2.0) -> "DynamicLossScale":
    """A fresh scale (Keras' defaults: 2**15, doubling every 2000 steps)."""
    if not initial_scale >= MIN_SCALE or not np.isfinite(initial_scale):
      raise ValueError(
          f"initial_scale must be a finite number of at least {MIN_SCALE:g} "
          f"(the scale never goes below it, as in TensorFlow), got "
          f"{initial_scale!r}.")
    if isinstance(growth_steps, bool) or not isinstance(
        growth_steps, (int, np.integer)) or growth_steps < 1:
      raise ValueError(f"growth_steps must be a whole number of at least 1, "
                       f"got {growth_steps!r}.")
    if not factor > 1:
      raise ValueError(f"factor must be greater than 1, got {factor!r}.")
    return cls(jnp.float32(initial_scale), jnp.int32(0), int(growth_steps),
               float(factor))

  def scale_loss(self, loss):
    """`loss` times the scale (differentiate this)."""
    return loss * self.scale.astype(jnp.result_type(loss))

  def unscale(self, grads):
    """The gradients divided by the scale, in float32 or wider."""
    inv = 1.0 / self.scale
    return jax.tree.map(
        lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)) * inv,
        grads)

  @property
  def at_floor(self) -> jax.Array:
    """Whether the scale is at its floor of 1 (a bool scalar)."""
    return self.scale <= MIN_SCALE

  def adjust(self, finite) -> "DynamicLossScale":
    """The scale after a step whose gradients were (not) all finite."""
    finite = jnp.asarray(finite)
    grown = self.good_steps + 1 >= self.growth_steps
    up = self.scale * self.factor
    up = jnp.where(jnp.isfinite(up), up, self.scale)
    down = jnp.maximum(self.scale / self.factor, MIN_SCALE)
    scale = jnp.where(finite, jnp.where(grown, up, self.scale), down)
    good = jnp.where(finite & ~grown, self.good_steps + 1, 0)
    return dataclasses.replace(self, scale=scale.astype(jnp.float32),
                               good_steps=good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
  """Whether every element of every leaf of `tree` is finite (a bool scalar)."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


class LossScaleState(NamedTuple):
  """The state of `loss_scale_optimizer`.

  Attributes:
    loss_scale: the `DynamicLossScale`; scale the loss with
      `state.loss_scale.scale_loss(loss)`.
    inner: `optax.apply_if_finite`'s state around the wrapped optimizer's;
      `inner.total_notfinite` counts the skipped steps.
  """

  loss_scale: DynamicLossScale
  inner: optax.ApplyIfFiniteState

  @property
  def skipped_steps(self) -> jax.Array:
    """Steps skipped so far because their gradients overflowed."""
    return self.inner.total_notfinite

  @property
  def consecutive_skipped_steps(self) -> jax.Array:
    """Steps skipped in a row up to the last one (0 if it was applied)."""
    return self.inner.notfinite_count

  @property
  def last_step_skipped(self) -> jax.Array:
    """Whether the last step's gradients overflowed (a bool scalar)."""
    return ~self.inner.last_finite

  @property
  def at_floor(self) -> jax.Array:
    """Whether the scale sits at its floor of 1 (a bool scalar): with
    `last_step_skipped`, the data or the loss overflow, not the scale."""
    return self.loss_scale.at_floor


class LossScaleTransformation(optax.GradientTransformation):
  """What `loss_scale_optimizer` returns (a `Trainer` sees the loss scaled)."""

  __slots__ = ()


def loss_scale_optimizer(inner: optax.GradientTransformation, *,
                         initial_scale: float = 2.0 ** 15,
                         dynamic_growth_steps: int = 2000
                         ) -> LossScaleTransformation:
  """Wraps an optax optimizer with dynamic loss scaling (Keras' names).

  `update` takes scaled gradients and applies `inner` to them unscaled if
  all are finite; else the update is zero and the scale halves.

  Args:
    inner: the optimizer to wrap.
    initial_scale: the first scale, at least 1.
    dynamic_growth_steps: finite steps after which the scale doubles.

  Returns:
    A `LossScaleTransformation` whose state is a `LossScaleState`.

  Example:
    >>> import jdist, jax, jax.numpy as jnp, optax
    >>> tx = jdist.loss_scale_optimizer(optax.sgd(0.1), initial_scale=1024.0)
    >>> params = jnp.ones(2)
    >>> state = tx.init(params)
    >>> def step(params, state, x):
    ...   loss_fn = lambda p: jnp.sum((p * x).astype(jnp.float16) ** 2)
    ...   grads = jax.grad(lambda p: state.loss_scale.scale_loss(
    ...       loss_fn(p).astype(jnp.float32)))(params)
    ...   updates, state = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> params, state = step(params, state, jnp.full(2, 1e3))  # overflows
    >>> params.tolist(), float(state.loss_scale.scale), int(state.skipped_steps)
    ([1.0, 1.0], 512.0, 1)
  """
  loss_scale = DynamicLossScale.create(initial_scale, dynamic_growth_steps)
  guarded = optax.apply_if_finite(inner, _NEVER_GIVE_UP)

  def init(params):
    return LossScaleState(loss_scale, guarded.init(params))

  def update(updates, state, params=None):
    grads = state.loss_scale.unscale(updates)
    finite = all_finite(grads)
    new_updates, inner_state = guarded.update(grads, state.inner, params)
    return new_updates, LossScaleState(state.loss_scale.adjust(finite),
                                       inner_state)

  return LossScaleTransformation(init, update)
