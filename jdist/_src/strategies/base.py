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
from jdist._src.core import mesh_context
from jdist._src.core import placement
from jdist._src.keras import distribution as keras_dist

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

  # What Keras's own fit runs as while this strategy's scope is open
  # (`keras/distribution.py`): "data_parallel", "model_parallel", None (the
  # default strategy: Keras is left alone), or "unsupported" (fit fails,
  # naming jdist.Trainer).
  keras_distribution = keras_dist.UNSUPPORTED

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
  def layout_map(self):
    """The `jdist.LayoutMap` that lays out parameters and layers' outputs:
    none here (`ModelParallelStrategy` may have one)."""
    return None

  @property
  def logical_axis_rules(self) -> tuple:
    """flax's logical axis rules inside this strategy's steps and `init`:
    none here (`ModelParallelStrategy` has its own)."""
    return ()

  @property
  def extended(self):
    """Compatibility with code that reads `strategy.extended`: the strategy."""
    return self

  def scope(self) -> contextlib.AbstractContextManager:
    """Makes this the current strategy: `jdist.get_strategy()` returns it.

    In a program that uses Keras (JAX backend) it also sets the
    `keras.distribution` that Keras's own `fit` reads, on this strategy's
    devices: `DataParallel` for data-parallel strategies, `ModelParallel`
    with the `LayoutMap` for `ModelParallelStrategy`; one that Keras's fit
    cannot run makes fit fail naming `jdist.Trainer`. A Keras model made
    in the scope keeps it after the scope closes, as in TensorFlow.

    Example:
      >>> import jdist
      >>> strategy = jdist.MirroredStrategy()
      >>> with strategy.scope():
      ...   assert jdist.get_strategy() == strategy and jdist.has_strategy()
    """
    return keras_dist.scope(self, context.strategy_scope(self))

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

    `fn` runs under the strategy's mesh (`mesh_scope`). A strategy whose
    replicas span devices (`ModelParallelStrategy`) computes it directly in
    its layout instead, so that no device holds the whole state.

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> strategy = jdist.MirroredStrategy()
      >>> w = strategy.init(jnp.zeros, 3)
      >>> w.sharding.is_fully_replicated
      True
    """
    with self.mesh_scope():
      value = fn(*args, **kwargs)
    return self.replicate(value)

  def outside_user_mesh(self) -> contextlib.AbstractContextManager:
    """For the block: a mesh the user set (`jax.set_mesh`), which must be
    this strategy's (its axes may be Explicit), set aside, so that jdist's
    programs over the strategy's state run as they do without one. The
    `Trainer` runs `fit`, `evaluate` and `predict` in it.

    Raises:
      jdist.StrategyMismatchError: another mesh is in context.

    Example:
      >>> import jax, jdist
      >>> mesh = jax.make_mesh((len(jax.devices()),), ("data",))
      >>> strategy = jdist.MirroredStrategy(mesh=mesh)
      >>> with jax.set_mesh(mesh), strategy.outside_user_mesh():
      ...   assert jax.sharding.get_mesh().empty
    """
    return mesh_context.set_aside(self.mesh, repr(self))

  def mesh_scope(self, *, strict: bool = True
                 ) -> contextlib.AbstractContextManager:
    """The strategy's mesh in JAX's context (`jax.set_mesh`), for code that
    traces the model outside a step: `init` runs its function in it, the
    `Trainer` its shape checks.

    Inside it a model's activation constraints (`with_sharding_constraint`
    with a bare `PartitionSpec`, flax's logical constraints under the
    strategy's `logical_axis_rules`) are read on this mesh. A mesh a user
    set with `jax.set_mesh` must be this one (its axes may be Explicit).

    Args:
      strict: a constraint on another mesh, or naming an axis this mesh does
        not have, is an error; False leaves those out, for a pass that only
        reads shapes before the layouts are checked with their own messages.

    Raises:
      jdist.StrategyMismatchError: another mesh is in context.

    Example:
      >>> import jax, jdist
      >>> strategy = jdist.MirroredStrategy()
      >>> with strategy.mesh_scope():
      ...   assert jax.sharding.get_mesh() == strategy.mesh
    """
    return mesh_context.outside_steps(self, strict=strict)

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
