"""`Strategy`: one SPMD program over a device mesh, and the methods on it.

A strategy is a value: strategies with the same `identity` are equal and
accept each other's distributed values. Subclasses only choose devices and
where state is held between steps (a `StatePlacement`); every behaviour lives
here and in `base.py`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src.core import cross_replica
from jdist._src.core import kinds
from jdist._src.core import placement
from jdist._src.core import state_output as state_output_lib
from jdist._src.core.function import DistributedFunction
from jdist._src.input import dataset as input_lib
from jdist._src.input.options import InputOptions
from jdist._src.runtime import runtime as runtime_lib
from jdist._src.runtime.options import CommunicationOptions
from jdist._src.runtime.program_check import StepGuard
from jdist._src.strategies import output_layouts
from jdist._src.strategies.base import StrategyBase


class Strategy(StrategyBase):
  """Runs a per-replica step on every device of a mesh, one replica each.

  Use a concrete strategy: `jdist.MirroredStrategy`, `jdist.OneDeviceStrategy`,
  or the default strategy from `jdist.get_strategy()`.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> strategy = jdist.MirroredStrategy()
    >>> def step(w, x):
    ...   return jdist.compute_average_loss((x @ w) ** 2)
    >>> xs = strategy.experimental_distribute_dataset([jnp.ones((8, 3))])
    >>> w = strategy.replicate(jnp.ones(3))
    >>> loss = strategy.run(step, args=(w, next(iter(xs))))
    >>> float(strategy.reduce("sum", loss))
    9.0
  """

  keras_distribution = "data_parallel"  # Keras's fit in its scope: see StrategyBase

  def __init__(self, devices: Sequence[Any], *, axis_name: str = "replica",
               communication_options=None,
               state_placement: placement.StatePlacement | None = None,
               mesh: Mesh | None = None):
    super().__init__(state_placement=state_placement)
    devices = tuple(devices)
    if not devices:
      raise ValueError("A strategy needs at least one device.")
    self._devices = devices
    self._axis_name = axis_name
    # A replica may span devices (ModelParallelStrategy): then `mesh` has
    # more axes than the replicas' one, which XLA partitions from layouts.
    self._mesh = mesh or Mesh(np.array(devices, dtype=object), (axis_name,),
                              axis_types=(AxisType.Auto,))
    self._communication_options = CommunicationOptions.of(
        communication_options)
    self._warned_outputs: set = set()  # output-layout keys warned about
    # Only a mesh that spans processes needs the runtime's cross-process checks.
    self._runtime = self._step_guard = None
    if placement.spans_processes(self._mesh):
      self._runtime = runtime_lib.current()
      self._step_guard = StepGuard(self._runtime, self._communication_options)

  # --- identity --------------------------------------------------------------

  @property
  def identity(self) -> tuple:
    """What makes two strategies equal: class, devices and axis name (and a
    subclass's own settings)."""
    return (type(self).__name__,
            tuple((d.platform, d.id) for d in self._devices), self._axis_name)

  def __eq__(self, other) -> bool:
    return isinstance(other, Strategy) and self.identity == other.identity

  def __hash__(self) -> int:
    return hash(self.identity)

  def __repr__(self) -> str:
    devs = ", ".join(f"{d.platform}:{d.id}" for d in self._devices)
    return f"{type(self).__name__}(devices=[{devs}])"

  # --- properties ------------------------------------------------------------

  @property
  def devices(self) -> tuple:
    """The devices of the replicas in order (a replica's first device)."""
    return self._devices

  @property
  def mesh(self) -> Mesh:
    """The `jax.sharding.Mesh` the replicas run on."""
    return self._mesh

  @property
  def axis_name(self) -> str:
    """Name of the mesh axis (pass it to `lax` collectives or flax BatchNorm)."""
    return self._axis_name

  @property
  def num_replicas_in_sync(self) -> int:
    """How many replicas run each step."""
    return len(self._devices)

  def step_scope(self, args: tuple) -> contextlib.AbstractContextManager:
    """Entered while a step is traced: applies the output-layout keys."""
    return output_layouts.applied(self.layout_map,
                                  output_layouts.nnx_modules(args),
                                  self._warned_outputs)

  def replica_layouts(self, tree: Any) -> list:
    """The `PartitionSpec` within a replica of each leaf of `tree`, in
    flattening order (`P()`: a replica is one device here)."""
    return [P() for _ in jax.tree.leaves(tree)]

  def shardings(self, tree: Any) -> Any:
    """The `NamedSharding` of each leaf of `tree` (arrays or shapes) as state.

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> strategy = jdist.MirroredStrategy()
      >>> strategy.shardings({"w": jnp.zeros((2, 3))})["w"].spec
      P()
    """
    specs = []
    for node in jax.tree.leaves(tree, is_leaf=kinds.has_layouts):
      own = kinds.kind_of(node).layouts(node)
      specs.extend([P()] if own is None else own)
    return jax.tree_util.tree_unflatten(jax.tree.structure(tree), [
        NamedSharding(self._mesh, spec) for spec in specs])

  def keep_layouts(self, outputs: Any) -> Any:
    """Inside a traced step: its outputs, held in this strategy's layouts
    (as they are: XLA leaves a mirrored array whole)."""
    return outputs

  @property
  def communication_options(self):
    """The `jdist.CommunicationOptions` of this strategy's collectives."""
    return self._communication_options

  @property
  def runtime(self):
    """The multi-process `Runtime` the mesh spans, or a single-process one."""
    return self._runtime or runtime_lib.current()

  @property
  def step_guard(self):
    """The multi-process checks of this strategy's steps (None in one process)."""
    return self._step_guard

  # --- running steps ---------------------------------------------------------

  def function(self, fn: Callable | None = None, *, donate_argnums=(),
               static_argnums=(), static_argnames=(), check_state: bool = True,
               check_loss_scaling: bool = True,
               state_output=state_output_lib.DEFAULT):
    """Compiles `fn` as a per-replica step; the result is called like `fn`.

    `fn` runs once per replica on its slice of `PerReplica` arguments.
    Outputs equal on every replica come back mirrored, others `PerReplica`.

    Args:
      fn: the per-replica step; omit it to decorate with arguments.
      donate_argnums, static_argnums, static_argnames: passed to `jax.jit`.
      check_state: raise `jdist.VaryingStateError` when the state varies.
      check_loss_scaling: raise `jdist.LossScalingError` when the loss is a
        mean over the replica's batch (gradients too large).
      state_output: as `jdist.ParameterServerStrategy.function` takes it.

    Returns:
      A `DistributedFunction`.

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> strategy = jdist.MirroredStrategy()
      >>> @strategy.function
      ... def double(x):
      ...   return 2 * x
      >>> double(jnp.ones(2))
      Array([2., 2.], dtype=float32)
    """
    options = dict(donate_argnums=donate_argnums, static_argnums=static_argnums,
                   static_argnames=static_argnames, check_state=check_state,
                   check_loss_scaling=check_loss_scaling)
    state_output_lib.check(state_output)
    if fn is None:
      return lambda f: self.function(f, **options)
    return DistributedFunction(self, fn, **options)

  # --- reading distributed values -------------------------------------------

  def reduce(self, reduce_op, value: Any, axis: int | None = None) -> Any:
    """Combines a step's per-replica outputs into one value.

    Args:
      reduce_op: `jdist.ReduceOp` SUM, MEAN, MAX or MIN (or its name).
      value: a pytree holding `PerReplica` values (and mirrored arrays).
      axis: also reduce along this axis of each value (padding excluded).

    Returns:
      The reduced pytree, replicated on every device (and every process).

    Raises:
      jdist.DoubleReductionError: SUM of a mirrored value.
    """
    return cross_replica.reduce(self, reduce_op, value, axis)

  def gather(self, value: Any, axis: int = 0) -> Any:
    """Concatenates replicas' values along `axis` (padding rows dropped)."""
    return cross_replica.gather(self, value, axis)

  def experimental_local_results(self, value: Any) -> tuple:
    """The values of this process's replicas, as a tuple in replica order."""
    return cross_replica.local_results(self, value)

  # --- placing values --------------------------------------------------------

  def replicate(self, tree: Any) -> Any:
    """Places every leaf of `tree` on every replica (mirrored); `SyncOnRead`
    gets one copy per replica, `PerReplica` and `Sharded` stay as they are.
    """
    return jax.tree.map(lambda node: kinds.kind_of(node).replicate(node, self),
                        tree, is_leaf=kinds.is_node)

  def experimental_distribute_dataset(self, dataset: Iterable, options=None, *,
                                      global_batch_size: int | None = None):
    """Splits each global batch of `dataset` over the replicas.

    A short last batch is padded and masked.

    Args:
      dataset: an iterable of batches (a list, generator, tf.data, grain).
      options: a `jdist.InputOptions` (or `tf.distribute.InputOptions`).
      global_batch_size: the batch size, when the first batch may be short
        (default: the first batch's).

    Returns:
      A `DistributedDataset` of `PerReplica` batches.
    """
    return input_lib.global_batches(self, dataset,
                                    options=InputOptions.of(options),
                                    global_batch_size=global_batch_size)

  def distribute_datasets_from_function(self, dataset_fn: Callable,
                                        options=None):
    """Builds each process's input from `dataset_fn(jdist.InputContext)`.

    `dataset_fn` returns an iterable of per-replica batches; each step takes
    one per local replica. A short or missing last batch is padded and
    masked. `options`: a `jdist.InputOptions`.
    """
    return input_lib.per_replica_batches(self, dataset_fn,
                                         options=InputOptions.of(options))

  def experimental_distribute_values_from_function(self, value_fn: Callable):
    """Makes a `PerReplica` from `value_fn(ctx)` called for each local replica."""
    return input_lib.from_values(self, value_fn)
