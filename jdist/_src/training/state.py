"""`TrainState`: everything a training run must carry from step to step."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """The state `Trainer` updates each step; a pytree, mirrored over replicas.

  Attributes:
    step: optimizer steps applied so far (an int32 scalar).
    params: the model's trainable parameters.
    opt_state: the optax optimizer's state.
    model_state: the model's other variables; `{}` if none.
    rng: raw key data; step `s` uses `fold_in(key, s)` (resumes exactly).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jdist._src.training.state import TrainState
    >>> s = TrainState(jnp.int32(0), {"w": jnp.ones(2)}, (), {},
    ...                jax.random.key_data(jax.random.key(0)))
    >>> int(jax.jit(lambda s: s.replace(step=s.step + 1))(s).step)
    1
  """

  step: Any
  params: Any
  opt_state: Any
  model_state: Any
  rng: Any

  def replace(self, **changes) -> "TrainState":
    """Returns a copy with `changes` applied."""
    return dataclasses.replace(self, **changes)

  def step_key(self) -> jax.Array:
    """The key of the current step: the same on every replica and resume."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)

  def batch_key(self, batch, batches_per_step: int = 1) -> jax.Array:
    """The key of batch `batch` of this step, as if one batch per step."""
    if batches_per_step == 1:
      return self.step_key()
    return jax.random.fold_in(jax.random.wrap_key_data(self.rng),
                              self.step * batches_per_step + batch)
