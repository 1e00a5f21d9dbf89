"""`DistributedFunction`: a per-replica step compiled once over the mesh.

`jax.jit` around `jax.shard_map(check_vma=True)`; each compilation plans the
inputs (`plan.py`) and probes the outputs (`probe.py`). Later calls with the
same input structure are served by jit's C++ cache, so the Python around a
call (`__call__`) stays a few attribute tests; it rebuilds outputs from flat
leaves (`_Flat`) only when it needs a leaf.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable

import jax

from jdist._src import jax_compat
from jdist._src.core import carried as carried_lib
from jdist._src.core import context
from jdist._src.core import conv_layout
from jdist._src.core import kinds
from jdist._src.core import mesh_context
from jdist._src.core import probe
from jdist._src.core import step_arguments
from jdist._src.core.plan import InputPlan
from jdist._src.core.replica_context import ReplicaContext
from jdist._src.errors import (Error, ReplicaContextError,
                               StrategyMismatchError)


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How a step was built: `Strategy.function`'s keyword arguments."""

  donate_argnums: Any = ()
  static_argnums: Any = ()
  static_argnames: Any = ()
  check_state: bool = True
  check_loss_scaling: bool = True

  def jit_options(self) -> dict:
    """The options `jax.jit` takes."""
    return dict(donate_argnums=self.donate_argnums,
                static_argnums=self.static_argnums,
                static_argnames=self.static_argnames)


class _Unplaced:
  """The program's answer to unplaced arguments: no step ran; place, retry."""

  def __repr__(self) -> str:
    return "<unplaced arguments>"


_UNPLACED = _Unplaced()
_TRACER = jax.core.Tracer
_ARRAY = jax_compat.array_type()  # a concrete array (not a tracer)
jax.tree_util.register_pytree_node(_Unplaced, lambda u: ((), None),
                                   lambda aux, children: _UNPLACED)


class _Flat:
  """A step's outputs as flat leaves, and what rebuilding them needs.

  An output's batch validity that is an argument's is not returned (XLA
  would copy it every step): `forwarded` holds `(leaf position, argnum)`.
  """

  __slots__ = ("treedef", "forwarded", "leaves")

  def __init__(self, aux: tuple, leaves):
    self.treedef, self.forwarded = aux
    self.leaves = leaves

  def outputs(self, args: tuple) -> Any:
    """The step's outputs, for the call with these positional arguments."""
    leaves = self.leaves
    if self.forwarded:
      leaves = list(leaves)
      for position, argnum in self.forwarded:  # in increasing positions
        leaves.insert(position, args[argnum].packed)
    return self.treedef.unflatten(leaves)


jax.tree_util.register_pytree_node(
    _Flat, lambda f: (f.leaves, (f.treedef, f.forwarded)), _Flat)


class DistributedFunction:
  """A step function mapped over a strategy's replicas; see `Strategy.function`."""

  # Slots for what every call reads: `functools.update_wrapper` fills the
  # instance's `__dict__` (the function's `__name__`, `__wrapped__`, ...),
  # and attributes held in a filled `__dict__` cost a call twice as much to
  # read as slots do.
  __slots__ = ("_strategy", "_fn", "_options", "_program", "_lowerer",
               "_lowering", "_throttle", "_guard", "_watch", "_placement",
               "_name", "_in_flight", "_calls", "_recent_compiles",
               "_warned_recompiling", "_recompiling", "_compilations",
               "_carried_programs", "_warned_draws", "__dict__",
               "__weakref__")

  def __init__(self, strategy, fn: Callable, *, donate_argnums=(),
               static_argnums=(), static_argnames=(), check_state: bool = True,
               check_loss_scaling: bool = True):
    self._strategy = strategy
    self._fn = fn
    self._options = StepOptions(donate_argnums, static_argnums,
                                static_argnames, check_state,
                                check_loss_scaling)
    # The jitted global program: plan, probe and shard_map of one call.
    self._program = jax.jit(self._trace_program,
                            **self._options.jit_options())
    self._lowerer = None
    self._lowering = False
    # CPU collectives deadlock when many steps are in flight:
    # waiting for step k-1 after dispatching step k avoids it at no cost.
    self._throttle = (strategy.devices[0].platform == "cpu" and
                      strategy.num_replicas_in_sync > 1)
    # Multi-process runs check the traced program and watch each step.
    self._guard = strategy.step_guard
    self._watch = self._throttle or self._guard is not None
    # State held off the mesh (CentralStorageStrategy) moves around each call;
    # the default placement moves nothing and costs one test per call.
    placement = strategy.state_placement
    self._placement = placement if placement.moves else None
    self._name = getattr(fn, "__name__", "step")
    self._in_flight = None
    self._calls = 0
    self._recent_compiles = collections.deque(maxlen=5)  # call counts
    self._warned_recompiling = False
    self._recompiling = None  # the warning to give at the end of this call
    self._compilations = 0
    self._carried_programs = {}  # carried structures -> jitted flat program
    self._warned_draws = False  # of random draws alike on every replica
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
  def options(self) -> StepOptions:
    """The options the step was built with (`Strategy.function`'s keywords)."""
    return self._options

  @property
  def num_compilations(self) -> int:
    """How many times the step was traced and compiled (once per input shape)."""
    return self._compilations

  def lower(self, *args, **kwargs):
    """Lowers the step for these arguments (see `jax.jit(...).lower`).

    In one process this is the calls' own program (it compiles once).

    Example:
      >>> import jax.numpy as jnp
      >>> strategy = jdist.OneDeviceStrategy()
      >>> step = strategy.function(lambda w, x: (w * 2.0, jnp.sum(x)))
      >>> w, x = strategy.replicate(jnp.ones(3)), jnp.ones(4)
      >>> compiled = step.lower(w, x).compile()
      >>> compiled.memory_analysis() is not None
      True
      >>> w, total = step(w, x)  # the program just compiled: none compiles
      >>> step.num_compilations, float(total)
      (1, 4.0)
    """
    if self._placement is not None:
      args, kwargs = self._placement.to_compute(args, kwargs,
                                                self._strategy.mesh)
    if (self._guard is None and
        not step_arguments.needs_placing((args, kwargs))):
      self._lowering = True  # not a call: no retracing warning
      try:
        return _Lowered(self._program.lower(*args, **kwargs))
      finally:
        self._lowering = False
    if self._lowerer is None:
      self._lowerer = jax.jit(
          lambda *a, **k: self._trace(a, k, check=False),
          **self._options.jit_options())
    return self._lowerer.lower(*args, **kwargs)

  def __call__(self, *args, **kwargs):
    # Every step call runs this: keep it to attribute tests (ARCHITECTURE.md,
    # "One program, traced twice per compilation").
    self._calls += 1
    if context.open_count and not context.may_call_step(self._strategy):
      raise self._misplaced_call()
    if self._placement is not None:
      args, kwargs = self._placement.to_compute(args, kwargs,
                                                self._strategy.mesh)
    try:
      out = self._program(*args, **kwargs)
      if type(out) is _Unplaced:
        args, kwargs = step_arguments.placed(args, kwargs, self._strategy)
        out = self._program(*args, **kwargs)
    except ValueError as e:
      self._explain_refused(e, args, kwargs)
      raise
    if type(out) is _Flat:  # else jit returned the outputs themselves
      leaves = out.leaves
      if self._watch and leaves:
        last = leaves[-1]  # the last array the step computed
        if self._throttle and self._guard is None and type(last) is _ARRAY:
          # `_watch_step`'s throttle, inlined: the usual case on CPU.
          previous, self._in_flight = self._in_flight, last
          if previous is not None and not previous.is_deleted():
            previous.block_until_ready()
        else:
          self._watch_step(last)
      # `out.outputs(args)`, inlined: one Python call less per step.
      if out.forwarded:  # in increasing positions
        leaves = list(leaves)
        for position, argnum in out.forwarded:
          leaves.insert(position, args[argnum].packed)
      out = out.treedef.unflatten(leaves)
    if self._recompiling:
      message, self._recompiling = self._recompiling, None
      warnings.warn(message, UserWarning, stacklevel=2)
    if self._placement is not None:
      out = self._placement.to_storage(out, self._strategy.mesh)
    return out

  def carry(self, *values) -> carried_lib.Carried:
    """The `Carried` `values`, the step's first positional arguments, for a
    loop of `call_carried` that feeds the step's first outputs back in their
    place: each call passes their leaves as the last one returned them.
    """
    if not context.may_call_step(self._strategy):
      raise self._misplaced_call()
    options = self._options
    if (self._placement is not None or options.static_argnums or
        options.static_argnames or step_arguments.needs_placing(values)):
      return carried_lib.Carried.held_whole(values)
    treedefs, leaves = carried_lib.flatten(values)
    program = self._carried_programs.get(treedefs)
    if program is None:
      program = self._carried_programs[treedefs] = jax.jit(
          functools.partial(self._trace_carried, treedefs),
          donate_argnums=options.donate_argnums)
    return carried_lib.Carried(program, treedefs, leaves)

  def call_carried(self, carried: carried_lib.Carried, *args) -> tuple:
    """Calls the step with `carried`'s values, then `args`; the outputs in
    the carried values' place replace them. Returns the other outputs."""
    if carried.leaves is None:  # held whole
      return carried.hold(self._name, self(*carried.whole, *args))
    self._calls += 1
    try:
      out = carried.program(*carried.leaves, *args)
      if type(out) is _Unplaced:
        args = step_arguments.placed(args, {}, self._strategy)[0]
        out = carried.program(*carried.leaves, *args)
    except ValueError as e:
      self._explain_refused(e, carried.values() + tuple(args), {})
      raise
    leaves, rest = out
    if self._recompiling:
      message, self._recompiling = self._recompiling, None
      warnings.warn(message, UserWarning, stacklevel=2)
    if leaves is None:  # another structure: see `carried.flat_outputs`
      return carried.hold(self._name, rest)
    carried.leaves = leaves
    last = leaves[-1]
    if self._watch and last:
      self._watch_step(last[-1])
    return rest

  def _explain_refused(self, error: ValueError, args: tuple,
                       kwargs: dict) -> None:
    """Raises the clear error when jit refused an argument committed to
    other devices; returns otherwise (the caller raises `error`)."""
    mismatch = (None if isinstance(error, Error) else
                step_arguments.foreign_argument(args, kwargs, self._strategy))
    if mismatch is not None:
      raise mismatch from error

  def trace_step(self, args: tuple, kwargs: dict, *, check: bool = True,
                 in_loop: bool = False):
    """Traces one call of the step into the running JAX trace (as
    `jdist.multi_step` does).

    Args:
      args, kwargs: the step's arguments (traced values).
      check: take part in the multi-process program check.
      in_loop: the trace is a loop's body (CPU convolution layouts differ).

    Returns:
      The step's outputs, as a call returns them.
    """
    return self._trace(args, kwargs, check=check, in_loop=in_loop)

  def _watch_step(self, last) -> None:
    """The CPU throttle and the multi-process watch of a dispatched step;
    `last` is the program's last output (least likely donated next)."""
    if isinstance(last, _TRACER):
      # Called inside the user's own jax.jit: this is a trace, not a step.
      # The outer program is what runs, and jdist never sees its calls, so
      # it cannot throttle them (docs/semantics.md, "No CPU deadlock"). A warning here
      # would fire for every jitted step on CPU, long loops or not.
      return
    if self._guard is not None:
      self._guard.track(self._name, last)
    if self._throttle:
      previous, self._in_flight = self._in_flight, last
      if previous is not None and not previous.is_deleted():
        previous.block_until_ready()

  def _warn_draws(self, message: str) -> None:
    """Warns, once per step, of random draws alike on every replica."""
    self._warned_draws = True
    warnings.warn(message, UserWarning, stacklevel=2)

  def _misplaced_call(self) -> Exception:
    """The error for a call inside a step or another strategy's scope."""
    if context.current_replica_context() is not None:
      return ReplicaContextError(
          f"{self._name} was called inside another step. Inside a step, call "
          "the plain per-replica function directly.")
    return StrategyMismatchError(
        f"This step belongs to {self._strategy!r} but runs inside the scope of "
        f"{context.current_scope_strategy()!r}. Build the step with the "
        "strategy whose scope is open.")

  # --- tracing -------------------------------------------------------------

  def _trace_program(self, *args, **kwargs):
    """What `self._program` traces: the step, or `_UNPLACED` when arguments
    need placing first (compiling for them would compile again next call).
    """
    if step_arguments.needs_placing((args, kwargs)):
      return _UNPLACED
    if not self._lowering:
      self._count_compilation()
    self._compilations += 1
    out = self._trace(args, kwargs, check=True)
    return _flat(out, args, self._options.donate_argnums,
                 whole=not self._watch)

  def _trace_carried(self, treedefs: tuple, *flat_args):
    """What a carried program traces: the step over leaves (see `carry`)."""
    args = carried_lib.unflatten(treedefs, flat_args)
    if step_arguments.needs_placing(args):
      return _UNPLACED
    self._count_compilation()
    self._compilations += 1
    return carried_lib.flat_outputs(self._trace(args, {}, check=True),
                                    treedefs)

  def _count_compilation(self) -> None:
    """Warns once, as TF's retracing warning does, when most recent calls
    compiled the step anew."""
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

  def _trace(self, args: tuple, kwargs: dict, *, check: bool,
             in_loop: bool = False):
    """Plans, probes and maps one call (traced); subclasses trace more."""
    strategy = self._strategy
    with mesh_context.entered(strategy.mesh, f"{strategy!r}'s step "
                              f"{self._name}"):
      return self._trace_mapped(args, kwargs, check=check, in_loop=in_loop)

  def _trace_mapped(self, args: tuple, kwargs: dict, *, check: bool,
                    in_loop: bool):
    """`_trace` under the strategy's mesh: plan, probe and map."""
    strategy = self._strategy
    axis = strategy.axis_name
    plan = InputPlan.of(strategy, args, kwargs)

    def run_replica(*local):
      call_args, call_kwargs, validity = plan.local_arguments(local)
      state_trees = probe.mirrored_structures(call_args, axis)
      with context.replica_scope(ReplicaContext(strategy, validity)), \
          mesh_context.replica_scope(strategy), \
          strategy.step_scope((call_args, call_kwargs)):
        return self._fn(*call_args, **call_kwargs), state_trees

    program_check = None
    if check and self._guard is not None:
      program_check = functools.partial(self._guard.check_program, self._name)
    rows = plan.validity.batch_size if plan.validity is not None else None
    outputs = probe.probe(
        run_replica, plan.leaves, plan.specs, strategy,
        check_state=self._options.check_state, name=self._name,
        program_check=program_check, batch_rows=rows,
        check_loss_scaling=self._options.check_loss_scaling,
        warn_draws=None if self._warned_draws else self._warn_draws)
    typed = _types_tracked(strategy)

    def local_results(*local):
      with contextlib.ExitStack() as stack:
        if not typed:
          stack.enter_context(context.untyped_replica())
        return outputs.local_results(run_replica(*local)[0], axis)

    if in_loop and conv_layout.runs_on_cpu(strategy):
      local_results = conv_layout.canonical_convolutions(local_results)
    results = jax.shard_map(
        local_results, mesh=strategy.mesh, in_specs=plan.specs,
        out_specs=outputs.out_specs(axis), axis_names={axis},
        check_vma=typed)(*plan.leaves)
    return strategy.keep_layouts(outputs.wrap(results, plan.validity))


def _types_tracked(strategy) -> bool:
  """Whether the step's map tracks varying-axis types (`check_vma`).

  Not for one replica spanning several devices: jax 0.10.2's partitioner
  rejects an all-reduce over a size-1 manual axis beside automatic ones; the
  probe has already read the types with them tracked.
  """
  return strategy.num_replicas_in_sync > 1 or strategy.mesh.size == 1


class _Lowered:
  """The calls' program lowered: jax's `Lowered`, compiling to `_Compiled`."""

  def __init__(self, lowered):
    self._lowered = lowered

  def compile(self, *args, **kwargs) -> "_Compiled":
    """Compiles the program (see `jax.stages.Lowered.compile`)."""
    return _Compiled(self._lowered.compile(*args, **kwargs))

  def __getattr__(self, name: str):
    return getattr(self._lowered, name)


class _Compiled:
  """The calls' program compiled; calls return what the step's calls do."""

  def __init__(self, compiled):
    self._compiled = compiled

  def __call__(self, *args, **kwargs):
    out = self._compiled(*args, **kwargs)
    return out.outputs(args) if type(out) is _Flat else out

  def __getattr__(self, name: str):
    return getattr(self._compiled, name)


def _flat(out: Any, args: tuple, donated, *, whole: bool) -> Any:
  """`out` as the program returns it: itself when `whole` (no caller needs
  a leaf) and no leaf is forwarded, so jit's C++ builds it; else a `_Flat`.
  """
  donated = {donated} if isinstance(donated, int) else set(donated)
  validities = [kinds.kind_of(a).validity(a) for a in args]
  sources = {id(v.packed): i for i, v in enumerate(validities)
             if v is not None and i not in donated}
  leaves, treedef = jax.tree_util.tree_flatten(out)
  kept, forwarded = [], []
  for position, leaf in enumerate(leaves):
    if id(leaf) in sources:
      forwarded.append((position, sources[id(leaf)]))
    else:
      kept.append(leaf)
  if whole and not forwarded:
    return out
  return _Flat((treedef, tuple(forwarded)), kept)
