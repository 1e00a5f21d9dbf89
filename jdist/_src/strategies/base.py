"""`StrategyBase`: what every jdist strategy is, whatever engine runs its steps.

Two families build on it: `spmd.py: Strategy` (one SPMD program over a mesh)
and `ps/strategy.py: ParameterServerStrategy` (an asynchronous coordinator).
The training layer talks to a strategy only through this interface, so a new
strategy adds a module and no branch elsewhere.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterable

from jdist._src.core import compiled_call
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
    """Where state is held between steps, and how it is read and written."""
    return self._state_placement

  @property
  def pipeline(self):
    """The `PipelineSchedule` of `jdist.pipeline` in this strategy's steps,
    or None (the layers run one after another)."""
    return None

  @property
  def synchronous(self) -> bool:
    """Whether every step is one SPMD program run in lock-step by all
    replicas (False for `ParameterServerStrategy`).

    Example:
      >>> import jdist
      >>> jdist.MirroredStrategy().synchronous
      True
    """
    return True

  @property
  def replica_batch_axis(self) -> str | None:
    """The mesh axis that splits each replica's batch (FSDP), or None."""
    return None

  @property
  def layout_map(self):
    """The `jdist.LayoutMap` of parameters and layers' outputs, or None."""
    return None

  @property
  def logical_axis_rules(self) -> tuple:
    """flax's logical axis rules inside this strategy's steps and `init`."""
    return ()

  @property
  def extended(self):
    """Compatibility with code that reads `strategy.extended`: the strategy."""
    return self

  def scope(self) -> contextlib.AbstractContextManager:
    """Makes this the current strategy (and with Keras, the matching
    `keras.distribution`: docs/keras.md).

    Example:
      >>> import jdist
      >>> strategy = jdist.MirroredStrategy()
      >>> with strategy.scope():
      ...   assert jdist.get_strategy() == strategy and jdist.has_strategy()
    """
    return keras_dist.scope(self, context.strategy_scope(self))

  def run(self, fn: Callable, args=(), kwargs=None) -> Any:
    """Runs `fn(*args, **kwargs)` on every replica, as `tf.distribute` does;
    the compiled step is cached per `fn`."""
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
    """Warns when `run` keeps getting new function objects for one code."""
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
    """New state: `fn(*args, **kwargs)` in `mesh_scope`, compiled as one
    program (traced arrays; other arguments as given; eagerly if it cannot be
    traced), placed by `replicate`.

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> strategy = jdist.MirroredStrategy()
      >>> w = strategy.init(jnp.zeros, 3)
      >>> w.sharding.is_fully_replicated
      True
    """
    with self.mesh_scope():
      value = compiled_call.call_compiled(fn, args, kwargs)
    return self.replicate(value)

  def outside_user_mesh(self) -> contextlib.AbstractContextManager:
    """For the block: the user's `jax.set_mesh` mesh (this one's) set aside.

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
    """The strategy's mesh (and `logical_axis_rules`) in JAX's context, for
    code that traces the model outside a step, as `init` does.

    Args:
      strict: whether a constraint on another mesh or axis is an error
        (False: the constraint is left out).

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
