"""`DistributedFunction`: a per-replica step compiled once over the mesh.

The step is mapped with `jax.shard_map` (`check_vma=True`) inside `jax.jit`.
Each compilation plans the inputs (`plan.py`: which arguments are mirrored,
per replica or static), probes the outputs (`probe.py`: which vary over
replicas, read from the traced types), then maps the step with the specs
both give and wraps the results (`PerReplica` for what varies, mirrored
arrays for the rest). Every later call with the same input structure is
served by jit's cache: no Python runs per step but the throttle below.
"""

from __future__ import annotations

import collections
import functools
import warnings
from typing import Any, Callable

import jax

from jdist._src.core import context
from jdist._src.core import probe
from jdist._src.core.plan import InputPlan
from jdist._src.core.replica_context import ReplicaContext
from jdist._src.core.values import SyncOnRead, is_distributed
from jdist._src.errors import ReplicaContextError, StrategyMismatchError


class DistributedFunction:
  """A step function mapped over a strategy's replicas; see `Strategy.function`."""

  def __init__(self, strategy, fn: Callable, *, donate_argnums=(),
               static_argnums=(), static_argnames=(), check_state: bool = True,
               check_loss_scaling: bool = True):
    self._strategy = strategy
    self._fn = fn
    self._check_state = check_state
    self._check_loss_scaling = check_loss_scaling
    self._jit_options = dict(donate_argnums=donate_argnums,
                             static_argnums=static_argnums,
                             static_argnames=static_argnames)
    self._jitted = jax.jit(self._global_step, **self._jit_options)
    self._lowerer = None
    # CPU collectives deadlock when many steps are in flight (jax#25861):
    # waiting for step k-1 after dispatching step k avoids it at no cost.
    self._throttle = (strategy.devices[0].platform == "cpu" and
                      strategy.num_replicas_in_sync > 1)
    # Multi-process runs check the traced program and watch each step.
    self._guard = strategy.step_guard
    # State held off the mesh (CentralStorageStrategy) moves around each call;
    # the default placement moves nothing and costs one test per call.
    placement = strategy.state_placement
    self._placement = placement if placement.moves else None
    self._name = getattr(fn, "__name__", "step")
    self._in_flight = None
    self._allow_unplaced = False
    self._calls = 0
    self._recent_compiles = collections.deque(maxlen=5)  # call counts
    self._warned_recompiling = False
    self._recompiling = None  # the warning to give at the end of this call
    self._compilations = 0
    functools.update_wrapper(self, fn)

  @property
  def strategy(self):
    """The strategy this step runs on."""
    return self._strategy

  @property
  def python_function(self) -> Callable:
    """The per-replica function this step runs (as `tf.function` names it)."""
    return self._fn

  @property
  def num_compilations(self) -> int:
    """How many times the step was traced and compiled (once per input shape)."""
    return self._compilations

  def lower(self, *args, **kwargs):
    """Lowers the step for these arguments (see `jax.jit(...).lower`).

    Lowering may run on one process only (to inspect the program), so it
    traces apart from the calls and takes no part in the multi-process check.
    """
    if self._lowerer is None:
      self._lowerer = jax.jit(functools.partial(self._trace, check=False),
                              **self._jit_options)
    if self._placement is not None:
      args, kwargs = self._placement.to_compute(args, kwargs,
                                                self._strategy.mesh)
    return self._lowerer.lower(*args, **kwargs)

  def __call__(self, *args, **kwargs):
    self._calls += 1
    if context.current_replica_context() is not None:
      raise ReplicaContextError(
          f"{self._name} was called inside another step. Inside a step, call "
          "the plain per-replica function directly.")
    scope = context.current_scope_strategy()
    if scope is not None and scope != self._strategy:
      raise StrategyMismatchError(
          f"This step belongs to {self._strategy!r} but runs inside the scope of "
          f"{scope!r}. Build the step with the strategy whose scope is open.")
    if self._placement is not None:
      args, kwargs = self._placement.to_compute(args, kwargs,
                                                self._strategy.mesh)
    try:
      try:
        out = self._jitted(*args, **kwargs)
      except _Unplaced:
        out = self._call_placed(args, kwargs)
    except ValueError as e:
      if "incompatible devices" in str(e):
        raise StrategyMismatchError(
            f"An argument lives on other devices than {self._strategy!r}: "
            f"{str(e).splitlines()[0]} Distributed values belong to the strategy "
            "that made them; place state with this strategy's replicate() and "
            "distribute batches with its experimental_distribute_dataset().") from e
      raise
    if self._recompiling:
      message, self._recompiling = self._recompiling, None
      warnings.warn(message, UserWarning, stacklevel=2)
    if self._throttle or self._guard is not None:
      first, last = _end_arrays(out)
      if isinstance(first, jax.core.Tracer):
        # Called inside the user's own jax.jit: this is a trace, not a step.
        # The outer program is what runs, and jdist never sees its calls, so
        # it cannot throttle them (README, "No CPU deadlock"). A warning here
        # would fire for every jitted step on CPU, long loops or not.
        return out
      if self._guard is not None:  # the last leaf: outputs fed back get donated
        self._guard.track(self._name, last)
      if self._throttle:
        previous, self._in_flight = self._in_flight, first
        if previous is not None and not previous.is_deleted():
          previous.block_until_ready()
    if self._placement is not None:
      out = self._placement.to_storage(out, self._strategy.mesh)
    return out

  def _call_placed(self, args: tuple, kwargs: dict):
    """Calls the step with its unplaced `SyncOnRead` arguments placed first.

    A `SyncOnRead` made outside a step (a fresh metric) comes back from the
    step placed on the replicas, with a replica axis: had the step compiled
    for the unplaced value, the next call would compile it again.
    """
    def place(node):
      if isinstance(node, SyncOnRead) and not node.per_replica:
        return self._strategy.replicate(node)
      return node

    flat = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_distributed)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(flat)):
      # Inside the user's own jax.jit: place them inside the program.
      self._allow_unplaced = True
      try:
        return self._jitted(*args, **kwargs)
      finally:
        self._allow_unplaced = False
    args, kwargs = jax.tree.map(place, (args, kwargs), is_leaf=is_distributed)
    return self._jitted(*args, **kwargs)

  # --- tracing -------------------------------------------------------------

  def _global_step(self, *args, **kwargs):
    if not self._allow_unplaced and any(
        isinstance(x, SyncOnRead) and not x.per_replica
        for x in jax.tree_util.tree_leaves((args, kwargs),
                                           is_leaf=is_distributed)):
      raise _Unplaced()  # __call__ places them and calls again
    self._count_compilation()
    self._compilations += 1
    return self._trace(*args, check=True, **kwargs)

  def _count_compilation(self) -> None:
    """Warns once, as TF's retracing warning does, when most recent calls of
    this step compiled it anew (inputs whose shapes or structure change)."""
    recent = self._recent_compiles
    recent.append(self._calls)
    if (not self._warned_recompiling and len(recent) == recent.maxlen and
        self._calls - recent[0] < 2 * recent.maxlen):
      self._warned_recompiling = True  # __call__ warns, from the user's line
      self._recompiling = (
          f"{self._name} compiled {recent.maxlen} times in its last "
          f"{self._calls - recent[0] + 1} calls: every new input shape, dtype "
          "or structure (and every new value of a static argument) compiles "
          "the step again, which costs far more than running it. Keep the "
          "inputs' shapes fixed: distribute data with "
          "experimental_distribute_dataset (it pads a short last batch "
          "instead of changing the shape), and pass numbers as arrays, not "
          "as static arguments.")

  def _trace(self, *args, check: bool, **kwargs):
    strategy = self._strategy
    axis = strategy.axis_name
    plan = InputPlan.of(strategy, args, kwargs)

    def run_replica(*local):
      call_args, call_kwargs, validity = plan.local_arguments(local)
      state_trees = probe.mirrored_structures(call_args, axis)
      with context.replica_scope(ReplicaContext(strategy, validity)):
        return self._fn(*call_args, **call_kwargs), state_trees

    program_check = None
    if check and self._guard is not None:
      program_check = functools.partial(self._guard.check_program, self._name)
    rows = None
    if self._check_loss_scaling and plan.validity is not None:
      rows = plan.validity.batch_size
    outputs = probe.probe(run_replica, plan.leaves, plan.specs, strategy,
                          check_state=self._check_state, name=self._name,
                          program_check=program_check, batch_rows=rows)
    results = jax.shard_map(
        lambda *local: outputs.local_results(run_replica(*local)[0], axis),
        mesh=strategy.mesh, in_specs=plan.specs,
        out_specs=outputs.out_specs(axis), check_vma=True)(*plan.leaves)
    return outputs.wrap(results, plan.validity)


class _Unplaced(Exception):
  """Raised while tracing a call whose `SyncOnRead` arguments are unplaced."""


def _end_arrays(tree: Any):
  """The first and the last array leaves of `tree` (None if it has none)."""
  arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  return (arrays[0], arrays[-1]) if arrays else (None, None)
