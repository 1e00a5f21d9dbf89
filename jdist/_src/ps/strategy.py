"""`ParameterServerStrategy`: asynchronous training with parameter servers."""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jdist._src.core import cross_replica
from jdist._src.core import state_output as state_output_lib
from jdist._src.input.options import InputOptions
from jdist._src.ps import cluster as cluster_lib
from jdist._src.ps import worker as worker_lib
from jdist._src.ps.coordinator import ClusterCoordinator
from jdist._src.ps.datasets import PerWorkerBatches
from jdist._src.ps.datasets import WorkerBatches
from jdist._src.ps.function import ParameterServerFunction
from jdist._src.ps import ray_backend
from jdist._src.ps.local import ThreadCluster
from jdist._src.ps.variables import Layout, ServerPlacement, ServerVariables
from jdist._src.strategies.base import StrategyBase

BACKENDS = ("threads", "ray")


class ParameterServerStrategy(StrategyBase):
  """Asynchronous data parallelism: workers update variables on servers.

  Variables (`strategy.replicate(state)`) live on the parameter servers; a
  `jdist.ClusterCoordinator` schedules steps on the workers, which send the
  servers their changes with no lock-step (docs/parameter_servers.md).

  Args:
    cluster_resolver: a `TFConfigClusterResolver`, `LocalClusterResolver`,
      a mapping of roles to tasks, or None (TF_CONFIG, else local).
    variable_partitioner: a `jdist.FixedShardsPartitioner`,
      `MinSizePartitioner` or `MaxSizePartitioner` (None: whole variables).
    max_staleness: the most updates a server may apply between a worker's
      read and its update (default twice the workers; `math.inf`: TF's).
    timeout_seconds: how long a server call or a scheduled function may take
      before its server or worker counts as failed.
    backend: "threads" (workers are threads of this process) or "ray" (Ray
      actors; `pip install jdist[ray]` and `ray.init()`).
    ray_options: with backend="ray": `{"worker": {...}, "ps": {...}}` actor
      options, "devices_per_worker" (default 1), "max_workers" and
      "min_workers" (docs/parameter_servers.md).

  Example:
    >>> import jdist, jax, jax.numpy as jnp, numpy as np
    >>> strategy = jdist.ParameterServerStrategy(
    ...     jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1))
    >>> def step(w, batch):
    ...   loss, g = jax.value_and_grad(lambda w: jdist.compute_average_loss(
    ...       (batch @ w - 1.0) ** 2))(w)
    ...   return w - 0.1 * g, loss
    >>> w = strategy.replicate(jnp.zeros(2))
    >>> batches = [np.ones((4, 2), np.float32)] * 20
    >>> for batch in strategy.experimental_distribute_dataset(batches):
    ...   w, loss = strategy.run(step, args=(w, batch))   # scheduled
    >>> np.round(w.read(), 2).tolist()                    # waits, then reads
    [0.5, 0.5]
    >>> jdist.ClusterCoordinator(strategy).shutdown()
  """

  def __init__(self, cluster_resolver=None, variable_partitioner=None, *,
               max_staleness: int | None = None, timeout_seconds: float = 60.0,
               backend: str = "threads", ray_options: dict | None = None):
    super().__init__(state_placement=ServerPlacement())
    self._spec = cluster_lib.spec_from(cluster_resolver)
    if variable_partitioner is not None and not callable(variable_partitioner):
      raise TypeError(
          f"variable_partitioner must be a partitioner (jdist."
          f"FixedShardsPartitioner, MinSizePartitioner, MaxSizePartitioner) or "
          f"None, got {type(variable_partitioner).__name__}.")
    if backend == "ray":  # the most workers at once, once some join
      most = ray_backend.scaling_bounds(dict(ray_options or {}),
                                        self._spec.num_workers)[1]
    else:
      if ray_options and ({"min_workers", "max_workers"} & set(ray_options)):
        raise ValueError(
            "ray_options min_workers and max_workers need backend='ray': "
            "the threads backend's workers neither join nor leave.")
      most = self._spec.num_workers
    if max_staleness is None:
      max_staleness = 2 * most
    if not (max_staleness == math.inf or (
        isinstance(max_staleness, int) and not isinstance(max_staleness, bool)
        and max_staleness >= 0)):
      raise ValueError(f"max_staleness must be a non-negative integer or "
                       f"math.inf, got {max_staleness!r}.")
    if backend not in BACKENDS:
      raise ValueError(f"Unknown backend {backend!r}; choose 'threads' (this "
                       "process) or 'ray' (Ray actors).")
    if (isinstance(timeout_seconds, bool) or
        not isinstance(timeout_seconds, (int, float)) or
        not math.isfinite(timeout_seconds) or timeout_seconds <= 0):
      raise ValueError(f"timeout_seconds must be a positive finite number of "
                       f"seconds, got {timeout_seconds!r}.")
    self._cluster_resolver = cluster_resolver
    self._partitioner = variable_partitioner
    self._max_staleness = max_staleness
    self._timeout = float(timeout_seconds)
    self._backend = backend
    self._ray_options = dict(ray_options or {})
    self._layout = Layout(self._spec.num_ps, variable_partitioner)
    self._coordinator = None
    self._cluster = None
    self._lock = threading.Lock()
    self._mesh = None

  def __getstate__(self):
    # What a Ray worker needs of the strategy: its settings, not the cluster.
    state = dict(self.__dict__)
    for key in ("_coordinator", "_cluster", "_run_cache", "_run_codes",
                "_lock", "_cluster_resolver", "_layout", "_mesh"):
      state[key] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._run_cache = weakref.WeakKeyDictionary()
    self._run_codes = {}
    self._lock = threading.Lock()

  def __repr__(self) -> str:
    return (f"ParameterServerStrategy(workers={self._spec.num_workers}, "
            f"ps={self._spec.num_ps}, backend={self._backend!r})")

  # --- the cluster and its coordinator ----------------------------------------

  @property
  def coordinator(self) -> ClusterCoordinator:
    """The strategy's `ClusterCoordinator` (made on first use)."""
    return self._coordinator or ClusterCoordinator(self)

  @property
  def attached_coordinator(self) -> ClusterCoordinator | None:
    """The coordinator `attach_coordinator` recorded, or None."""
    return self._coordinator

  def attach_coordinator(self, coordinator: ClusterCoordinator):
    """Records `coordinator` as this strategy's one coordinator (ValueError if
    another is), and returns the cluster it starts."""
    with self._lock:
      if self._coordinator not in (None, coordinator):
        raise ValueError(
            f"{self!r} has a ClusterCoordinator already; "
            "ClusterCoordinator(strategy) returns it.")
      if self._cluster is None:
        if self._backend == "ray":
          self._cluster = ray_backend.RayCluster(self._spec, self,
                                                 self._ray_options,
                                                 self._timeout)
        else:
          self._cluster = ThreadCluster(self._spec, self, self._timeout)
      self._coordinator = coordinator  # once its cluster runs
      return self._cluster

  @property
  def cluster_resolver(self):
    """The resolver given at construction."""
    return self._cluster_resolver

  @property
  def cluster_spec(self) -> cluster_lib.ClusterSpec:
    """The cluster's workers and parameter servers."""
    return self._spec

  @property
  def num_workers(self) -> int:
    return self._spec.num_workers

  @property
  def num_ps(self) -> int:
    return self._spec.num_ps

  @property
  def max_staleness(self):
    """See the class docstring."""
    return self._max_staleness

  @property
  def variable_partitioner(self):
    return self._partitioner

  @property
  def synchronous(self) -> bool:
    """False: steps are scheduled one call at a time against state the servers
    update in place."""
    return False

  @property
  def num_replicas_in_sync(self) -> int:
    """Replicas of one worker's step (its devices), as in TensorFlow."""
    ctx = worker_lib.current()
    if ctx is not None:
      return ctx.strategy.num_replicas_in_sync
    return int(self._ray_options.get("devices_per_worker", 1))

  @property
  def mesh(self):
    """A one-device mesh on the coordinator, where values read from the servers
    are placed."""
    if self._mesh is None:
      self._mesh = Mesh(np.array(jax.local_devices()[:1], dtype=object),
                        ("replica",), axis_types=(AxisType.Auto,))
    return self._mesh

  # --- variables and steps ---------------------------------------------------------

  def replicate(self, tree: Any) -> ServerVariables:
    """Places `tree`'s leaves on the parameter servers; returns their handle."""
    coordinator = self.coordinator
    return ServerVariables(self._cluster.store, self._layout, tree,
                           coordinator=coordinator)

  def function(self, fn: Callable | None = None, *, donate_argnums=(),
               static_argnums=(), static_argnames=(), check_state: bool = True,
               state_output=state_output_lib.DEFAULT):
    """A step run on the workers; see `ParameterServerFunction`.

    Called on the coordinator it is scheduled and returns at once.

    Args:
      fn: the per-replica step, as for the synchronous strategies.
      donate_argnums, static_argnums, static_argnames, check_state: as for
        the synchronous strategies' `function`.
      state_output: where the step returns the new variables: output 0 by
        default; `None` (reads only); an int, str or function of the output;
        a tuple of those, one per set of variables.

    Example:
      >>> import jdist, jax.numpy as jnp
      >>> strategy = jdist.ParameterServerStrategy(
      ...     jdist.cluster_resolver.LocalClusterResolver(1, 1))
      >>> w = strategy.replicate(jnp.ones(2))
      >>> def train(w, x):            # returns (loss, new state)
      ...   return jnp.sum(w * x), w - 0.5 * x
      >>> def normalized(w):          # reads only
      ...   return w / jnp.linalg.norm(w)
      >>> loss, w = strategy.function(train, state_output=1)(w, jnp.ones(2))
      >>> unit = strategy.function(normalized, state_output=None)(w)
      >>> w.read().tolist(), [round(float(u), 3) for u in unit.fetch()]
      ([0.5, 0.5], [0.707, 0.707])
      >>> jdist.ClusterCoordinator(strategy).shutdown()
    """
    options = dict(donate_argnums=donate_argnums, static_argnums=static_argnums,
                   static_argnames=static_argnames, check_state=check_state,
                   state_output=state_output)
    if fn is None:
      return lambda f: self.function(f, **options)
    return ParameterServerFunction(self, fn, **options)

  # --- input -------------------------------------------------------------------------

  def experimental_distribute_dataset(self, dataset, options=None, *,
                                      global_batch_size: int | None = None):
    """Global batches iterated here, each shipped with the step that takes it.

    The worker that runs the step splits the batch over its devices with
    `options` (`jdist.InputOptions`); to read data on the workers, use
    `coordinator.create_per_worker_dataset`.
    """
    if options is not None and not isinstance(options, InputOptions):
      raise TypeError(f"options must be a jdist.InputOptions or None, got "
                      f"{type(options).__name__}.")
    return WorkerBatches(dataset, global_batch_size, options)

  def distribute_datasets_from_function(self, dataset_fn, options=None):
    """Each worker's own input, seen from the coordinator.

    Iterating the result gives, without end, the next batch of the worker
    that runs the step (bound the loop by a number of steps).

    Args:
      dataset_fn: returns an iterable of a worker's batches; it may take a
        `jdist.InputContext`.
      options: only None.
    """
    if options is not None:
      raise ValueError(
          "distribute_datasets_from_function(options=...) is not supported "
          "under ParameterServerStrategy: each worker places its batches as "
          "ClusterCoordinator.create_per_worker_dataset does.")
    if not callable(dataset_fn):
      raise TypeError(
          f"distribute_datasets_from_function needs a function that returns "
          f"a dataset, got {type(dataset_fn).__name__}.")
    return PerWorkerBatches(dataset_fn)

  # --- reading results -----------------------------------------------------------------

  def reduce(self, reduce_op, value: Any, axis: int | None = None) -> Any:
    """Combines per-replica values: on a worker over its replicas; on the
    coordinator, of fetched results."""
    ctx = worker_lib.current()
    if ctx is not None:
      return ctx.strategy.reduce(reduce_op, value, axis)
    return cross_replica.reduce_fetched(reduce_op,
                                        self.coordinator.fetch(value), axis)

  def gather(self, value: Any, axis: int = 0) -> Any:
    """Concatenates per-replica values (padding rows dropped), like `reduce`."""
    ctx = worker_lib.current()
    if ctx is not None:
      return ctx.strategy.gather(value, axis)
    return cross_replica.gather_fetched(self.coordinator.fetch(value), axis)

  def experimental_local_results(self, value: Any) -> tuple:
    """The values of each replica (on the coordinator, of a fetched result)."""
    ctx = worker_lib.current()
    if ctx is not None:
      return ctx.strategy.experimental_local_results(value)
    return cross_replica.local_results_fetched(self.coordinator.fetch(value))
