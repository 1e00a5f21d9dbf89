"""`StrategyBase`: what every jdist strategy is, whatever engine runs its steps.

A strategy says where state is held between steps (a `StatePlacement`), makes
itself current (`scope`), compiles per-replica steps (`function`) and runs
them (`run`, which keeps one compiled step per function and warns, as
TensorFlow's retracing warning does, when it keeps getting new ones). Two
families build on it: `spmd.py: Strategy`, one SPMD program over a device
mesh (Mirrored, MultiWorkerMirrored, TPU, OneDevice, CentralStorage), and
`ps/strategy.py: ParameterServerStrategy`, an asynchronous coordinator.

The training layer (the Trainer, its callbacks, checkpoints) talks to a
strategy only through this interface and its `state_placement`, so a new
strategy adds a module (and its name in the facade), with no branch elsewhere.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterable

from jdist._src.core import context
from jdist._src.core import placement

# Compilations of one step (or one piece of code given to run) after which
# jdist warns that something makes it compile again and again.
RECOMPILE_WARNING_AFTER = 5


class StrategyBase(abc.ABC):
  """What every strategy offers; see `jdist.Strategy` for the SPMD family.

  Args:
    state_placement: where state is held between steps, and how the training
      layer reads and writes it (default: on the mesh's devices).

  Example:
    >>> import jdist
    >>> from jdist._src.strategies.base import StrategyBase
    >>> isinstance(jdist.MirroredStrategy(), StrategyBase)
    True
  """

  def __init__(self, *,
               state_placement: placement.StatePlacement | None = None):
    self._state_placement = state_placement or placement.MESH_PLACEMENT
    self._run_cache = weakref.WeakKeyDictionary()
    self._run_codes = {}  # code object -> functions compiled by run() for it

  # --- what every strategy is -------------------------------------------------

  @property
  def state_placement(self) -> placement.StatePlacement:
    """Where state is held between steps, and how it is read and written
    (see `StatePlacement`)."""
    return self._state_placement

  @property
  def pipeline(self):
    """How `jdist.pipeline` runs stacked layers in this strategy's steps (a
    `PipelineSchedule`), or None: one after another on each replica. Only
    `jdist.ModelParallelStrategy(pipeline_axis=...)` has one."""
    return None

  @property
  def synchronous(self) -> bool:
    """Whether every step is one SPMD program over the mesh, run in
    lock-step by all replicas (True here; False for
    `ParameterServerStrategy`, whose steps are scheduled on workers).

    What the training layer asks instead of the strategy's type: a
    synchronous strategy's step may run several batches per call
    (`jdist.multi_step`, `steps_per_execution`), may donate the state it is
    given, and returns state that is an immutable value (reading it after a
    step waits for that step only). An asynchronous one runs one step per
    call and holds its state remotely, updated in place.

    Example:
      >>> import jdist
      >>> jdist.MirroredStrategy().synchronous
      True
    """
    return True

  @property
  def replica_batch_axis(self) -> str | None:
    """The mesh axis that splits each replica's batch over its devices
    (FSDP: `ModelParallelStrategy(fsdp_axis=...)`), or None."""
    return None

  @property
  def extended(self):
    """Compatibility with code that reads `strategy.extended`: the strategy."""
    return self

  def scope(self) -> contextlib.AbstractContextManager:
    """Makes this the current strategy: `jdist.get_strategy()` returns it.

    Example:
      >>> import jdist
      >>> strategy = jdist.MirroredStrategy()
      >>> with strategy.scope():
      ...   assert jdist.get_strategy() == strategy and jdist.has_strategy()
    """
    return context.strategy_scope(self)

  def run(self, fn: Callable, args=(), kwargs=None) -> Any:
    """Runs `fn(*args, **kwargs)` on every replica, as `tf.distribute` does.

    The compiled step is cached per `fn`, so calling `run` in a loop with the
    same function compiles once.
    """
    try:
      step = self._run_cache.get(fn)
    except TypeError:  # not weak-referenceable
      step = None
    if step is None:
      step = self.function(fn)
      try:
        self._run_cache[fn] = step
      except TypeError:
        pass
      self._count_new_function(fn)
    return step(*args, **(kwargs or {}))

  def _count_new_function(self, fn: Callable) -> None:
    """Warns, as TF's retracing warning does, when `run` keeps getting new
    function objects for the same code: each one compiles again."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
      return
    seen = self._run_codes.get(code, 0) + 1
    self._run_codes[code] = seen
    if seen == RECOMPILE_WARNING_AFTER:
      warnings.warn(
          f"strategy.run got a new function object for {code.co_name} "
          f"({code.co_filename}:{code.co_firstlineno}) {seen} times and "
          "compiled each one: a lambda, a nested function or a bound method "
          "made anew at every call is a new function to jdist, as it is to "
          "tf.function's retracing warning. Define the step once, outside "
          "the loop (or build it with strategy.function), and pass what "
          "changes as arguments.", UserWarning, stacklevel=3)

  # --- what each family supplies ----------------------------------------------

  @property
  @abc.abstractmethod
  def num_replicas_in_sync(self) -> int:
    """How many replicas run each step."""

  @property
  @abc.abstractmethod
  def mesh(self):
    """The `jax.sharding.Mesh` values read back from the state are placed on."""

  @abc.abstractmethod
  def function(self, fn: Callable | None = None, **options):
    """Compiles `fn` as a per-replica step; the result is called like `fn`."""

  @abc.abstractmethod
  def replicate(self, tree: Any) -> Any:
    """Places `tree` where this strategy holds state (mirrored placement)."""

  def init(self, fn: Callable, *args, **kwargs) -> Any:
    """New state: `fn(*args, **kwargs)` placed as `replicate` places it.

    A strategy whose replicas span devices (`ModelParallelStrategy`)
    computes it directly in its layout instead, so that no device holds the
    whole state.

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> strategy = jdist.MirroredStrategy()
      >>> w = strategy.init(jnp.zeros, 3)
      >>> w.sharding.is_fully_replicated
      True
    """
    return self.replicate(fn(*args, **kwargs))

  @abc.abstractmethod
  def reduce(self, reduce_op, value: Any, axis: int | None = None) -> Any:
    """Combines a step's per-replica outputs into one value."""

  @abc.abstractmethod
  def gather(self, value: Any, axis: int = 0) -> Any:
    """Concatenates replicas' values along `axis` (padding rows dropped)."""

  @abc.abstractmethod
  def experimental_local_results(self, value: Any) -> tuple:
    """The values of this process's replicas, in replica order."""

  @abc.abstractmethod
  def experimental_distribute_dataset(self, dataset: Iterable, options=None, *,
                                      global_batch_size: int | None = None):
    """Global batches of `dataset`, ready for this strategy's steps."""

  @abc.abstractmethod
  def distribute_datasets_from_function(self, dataset_fn: Callable,
                                        options=None):
    """Each input pipeline's batches from `dataset_fn(jdist.InputContext)`."""
