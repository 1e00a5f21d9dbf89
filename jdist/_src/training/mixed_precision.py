"""The Trainer's side of mixed precision: a model computing in low precision
on float32 parameters, and the optimizer that goes with it.

Parameters are typed as varying over replicas before the cast, so their
gradients' all-reduce runs in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jdist._src.core import context
from jdist._src.core import in_step
from jdist._src.core import placement
from jdist._src.ops import loss_scale
from jdist._src.ops.precision import DTypePolicy
from jdist._src.training.model import ModelAdapter


class MixedPrecisionModel(ModelAdapter):
  """A model adapter (`model.py`) that applies a mixed `DTypePolicy`."""

  def __init__(self, model: ModelAdapter, policy: DTypePolicy):
    self.model = model
    self.policy = policy
    self.writes_back = model.writes_back

  def check(self) -> None:
    self.model.check()

  def init(self, key, x) -> tuple[Any, Any]:
    return self.model.init(key, x)

  def export(self, params, model_state):
    return self.model.export(params, model_state)

  def _cast(self, tree):
    """`tree` in the compute dtype, unless the model `casts_itself`."""
    return tree if self.casts_itself else self.policy.cast_to_compute(tree)

  @property
  def casts_itself(self) -> bool:
    """A Keras model: its layers cast variables and inputs to their own
    policy's compute dtype (and would cast jdist's back)."""
    return self.model.dtype_policy is not None

  @property
  def own_losses(self) -> bool:
    """The model's (see `ModelAdapter.own_losses`)."""
    return self.model.own_losses

  def apply(self, params, model_state, x, *, train: bool, rng=None):
    ctx = context.current_replica_context()
    if train and ctx is not None:
      params = jax.tree.map(lambda p: in_step.to_varying(p, ctx.axis_name),
                            params)
    y, *rest = self.model.apply(
        self._cast(params), model_state, self._cast(x), train=train, rng=rng)
    return (self.policy.cast_to_variable(y), *rest)


def adapt(model, policy: DTypePolicy):
  """`model` computing under `policy` (itself for float32); ValueError if
  the model has another dtype policy of its own (Keras layers)."""
  own = model.dtype_policy
  if own is not None and own != policy.name:
    raise ValueError(
        f"The Keras model computes under the dtype policy {own!r} (its "
        f"layers' policy, fixed when they were made), not {policy.name!r}. "
        "Keras layers cast to their own policy, so jdist cannot change it: "
        f"build the model under keras.config.set_dtype_policy("
        f"{policy.name!r}) (Keras's way), or leave the Trainer's "
        "dtype_policy out (it takes the model's).")
  return MixedPrecisionModel(model, policy) if policy.is_mixed else model


def optimizer(tx: optax.GradientTransformation, policy: DTypePolicy
              ) -> optax.GradientTransformation:
  """`tx` with dynamic loss scaling where the policy needs it (float16),
  unless it scales already."""
  if not policy.needs_loss_scaling or isinstance(
      tx, loss_scale.LossScaleTransformation):
    return tx
  return loss_scale.loss_scale_optimizer(tx)


def check_scaled_once(given: optax.GradientTransformation,
                      used: optax.GradientTransformation, params) -> None:
  """ValueError if `optimizer` wraps a loss scaling built by hand: the
  gradients would be unscaled twice."""
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
  """Whether an optimizer state (or its structure) is loss-scaled."""
  return isinstance(opt_state, loss_scale.LossScaleState)


def train_logs(opt_state) -> dict:
  """fit's extra logs for a loss-scaled optimizer: scale, skipped steps."""
  if not is_loss_scaled(opt_state):
    return {}
  return {"loss_scale": opt_state.loss_scale.scale,
          "skipped_steps": opt_state.skipped_steps}


class SkippedBatches:
  """Which batches of an epoch a loss-scaled `fit` skipped, and when to say so.

  One read at the epoch's end tells whether any step was skipped; only then
  the calls are searched. `end_epoch` names batches skipped at the floor.
  """

  # Ranges of at most this many calls are read in one transfer.
  _BLOCK = 32

  def __init__(self, read, batches_per_step: int = 1):
    self._read = read
    self._per_step = batches_per_step
    self._calls: list = []  # (first batch, steps, skip count, loss scale)
    self._before = None

  def start_epoch(self, state) -> None:
    """Starts an epoch's record from the state it starts with."""
    self._calls = []
    self._before = placement.copy_arrays(
        self._read(state).opt_state.skipped_steps)

  def record(self, state, first_batch: int, steps: int) -> None:
    """Notes the state after a call of `steps` batches from `first_batch`."""
    opt_state = self._read(state).opt_state
    # Copies: the next step donates the state's arrays.
    self._calls.append((first_batch, steps) + placement.copy_arrays(
        (opt_state.skipped_steps, opt_state.loss_scale)))

  def end_epoch(self, epoch: int) -> str | None:
    """A warning naming the epoch's skipped batches if a step was skipped at
    the floor; None otherwise (also when nothing was recorded)."""
    if not self._calls or self._before is None:
      return None
    skipped = self._skipped_calls()
    if not skipped:
      return None
    scales = jax.device_get(jax.tree.map(
        placement.host_local, [self._calls[i][3] for i, _ in skipped]))
    if not any(bool(scale.at_floor) for scale in scales):
      return None
    spans = [(self._calls[i][0], self._calls[i][1], n * self._per_step)
             for i, n in skipped]
    total = sum(n for _, _, n in spans) // self._per_step
    return (f"Epoch {epoch + 1}: {total} training step(s) were skipped with "
            "the loss scale at its floor of 1: their gradients were not "
            "finite even unscaled, so these batches (or the loss on them) "
            "hold NaN or inf, and no loss scale helps. Skipped batches "
            f"(indices within epoch {epoch + 1}, as on_train_batch_end gets "
            f"them): {_describe(spans)}. Check the data there; "
            "jdist.TerminateOnNaN() stops at the first NaN loss.")

  def _skipped_calls(self) -> list:
    """`[(call index, steps skipped in it)]`, in order, read by halving."""
    counts: dict = {}  # call index (-1: before the epoch) -> skip count

    def fetch(indices):
      refs = [self._before if i < 0 else self._calls[i][2] for i in indices]
      for i, v in zip(indices, jax.device_get(
          [placement.host_local(r) for r in refs])):
        counts[i] = int(v)

    fetch([-1, len(self._calls) - 1])
    found, ranges = [], [(-1, len(self._calls) - 1)]
    while ranges:
      lo, hi = ranges.pop()
      if counts[lo] == counts[hi]:
        continue
      if hi - lo <= self._BLOCK:
        fetch([i for i in range(lo + 1, hi) if i not in counts])
        found += [(i, counts[i] - counts[i - 1]) for i in range(lo + 1, hi + 1)
                  if counts[i] > counts[i - 1]]
        continue
      mid = (lo + hi) // 2
      fetch([mid])
      ranges += [(mid, hi), (lo, mid)]
    return sorted(found)


def _describe(spans: list, limit: int = 20) -> str:
  """Batch indices as ranges ("0-59, 70"); a call of several steps of which
  only some were skipped as "8-15 (3 of 8 skipped)"."""
  parts, run = [], None  # run: [first, last] of whole skipped batches
  for first, steps, n in spans:
    last = first + steps - 1
    if n < steps:
      parts.append(f"{first}-{last} ({n} of {steps} skipped)")
      continue
    if parts and run is not None and parts[-1] is run and run[1] + 1 == first:
      run[1] = last
    else:
      run = [first, last]
      parts.append(run)
  text = [p if isinstance(p, str) else
          (str(p[0]) if p[0] == p[1] else f"{p[0]}-{p[1]}") for p in parts]
  more = len(text) - limit
  return ", ".join(text[:limit]) + (f" and {more} more" if more > 0 else "")
