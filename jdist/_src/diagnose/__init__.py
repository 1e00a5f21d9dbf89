"""`jdist.diagnose`: where a training step's time goes, on 1 and on N devices
(measured, not modelled; `advice` turns the times into a bottleneck).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import jax

from jdist._src.core import placement
from jdist._src.diagnose.measure import StepTimes
from jdist._src.diagnose.measure import measure
from jdist._src.diagnose.report import Diagnosis
from jdist._src.equivalence import devices_hint
from jdist._src.strategies.mirrored import MirroredStrategy, OneDeviceStrategy

__all__ = ["Diagnosis", "StepTimes", "diagnose"]


def diagnose(step: Callable, state: Any, batches: Iterable, *,
             strategy=None, num_replicas: int | None = None,
             steps: int = 10) -> Diagnosis:
  """Runs a training step on 1 and on N devices and says where the time goes.

  See docs/diagnose.md for how each part of `StepTimes` is measured.

  Args:
    step: the per-replica step, `step(state, batch) -> (state, outputs)`,
      or a `strategy.function` step (whose strategy is the N-device one).
    state: the initial state (a pytree).
    batches: a re-iterable of global batches (read several times).
    strategy: the N-replica strategy (default: a `MirroredStrategy`).
    num_replicas: replicas, when `strategy` is not given (default: all).
    steps: steps per timed loop (more: steadier numbers, slower).

  Returns:
    A frozen `Diagnosis`; `print(diagnosis)` shows the table.

  Raises:
    TypeError: a bad `step`, or `batches` is a one-shot iterator.
    ValueError: no batches, `steps` < 1, or a strategy it cannot compare.

  Example:
    >>> import jdist, jax, jax.numpy as jnp, numpy as np
    >>> def train_step(w, batch):
    ...   loss_fn = lambda w: jdist.compute_average_loss((batch @ w) ** 2)
    ...   loss, g = jax.value_and_grad(loss_fn)(w)
    ...   return w - 0.1 * g, loss
    >>> data = [np.ones((8, 3), np.float32)] * 4
    >>> d = jdist.diagnose(train_step, jnp.ones(3), data, num_replicas=2,
    ...                    steps=2)
    >>> d.multi.num_replicas, d.bottleneck in ("input", "compute",
    ...     "collectives", "dispatch", "recompilation")
    (2, True)
  """
  fn = getattr(step, "python_function", step)
  if not callable(fn):
    raise TypeError(f"diagnose needs a step function, got {type(step).__name__}: "
                    "pass step(state, batch) -> (state, outputs).")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"steps must be a positive int, got {steps!r}.")
  if iter(batches) is batches:
    raise TypeError(
        "diagnose reads the batches several times (fed and pre-placed, on 1 "
        "and on N devices), but got a one-shot iterator. Pass a list, or an "
        "object whose __iter__ starts over (a tf.data or grain dataset).")
  strategy = _multi_strategy(step, strategy, num_replicas)
  one = measure(OneDeviceStrategy(strategy.devices[0]), fn, state, batches,
                steps)
  many = measure(strategy, fn, state, batches, steps)
  return Diagnosis(single=one.times, multi=many.times,
                   global_batch=many.global_batch, steps=many.steps,
                   platform=strategy.devices[0].platform,
                   host_cores=os.cpu_count() or 1,
                   measurement_notes=many.notes)


def _multi_strategy(step, strategy, num_replicas):
  if strategy is not None and num_replicas is not None:
    raise ValueError("Pass strategy or num_replicas, not both.")
  if strategy is None and hasattr(step, "python_function"):
    strategy = step.strategy  # a jdist step: its own strategy
  if strategy is None:
    n = num_replicas or len(jax.local_devices())
    if n > len(jax.local_devices()):
      raise ValueError(devices_hint(n))
    strategy = MirroredStrategy(jax.local_devices()[:n])
  if strategy.mesh.devices.size < 2:
    raise ValueError(
        f"diagnose compares one device with several, but {strategy!r} runs on "
        "one. " + devices_hint(2))
  if placement.spans_processes(strategy.mesh):
    raise ValueError(
        "diagnose measures this process's devices; its strategy spans "
        "processes. Diagnose on one host with MirroredStrategy() (the step "
        "and batches are the same).")
  return strategy
