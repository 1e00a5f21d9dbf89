"""`DistributedFunction`: a per-replica step compiled once over the mesh.

The step is mapped with `jax.shard_map` (`check_vma=True`) inside `jax.jit`.
Which outputs vary over replicas is read from the traced types: the body is
first traced abstractly with every output per-replica, the varying axes of each
output leaf are recorded, and the real `shard_map` is then built with `P()` for
invariant leaves (returned as mirrored arrays) and the replica axis for the
others (returned as `PerReplica`). This costs one extra trace per compilation
and nothing per step, because jit's own cache serves every later call.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jdist._src import collectives
from jdist._src import context
from jdist._src.replica_context import ReplicaContext
from jdist._src.types import (StrategyMismatchError, VariableAggregation,
                              VaryingStateError)
from jdist._src.values import PerReplica, SyncOnRead, is_distributed


class _Arg:
  """How one flattened argument enters the shard_map."""

  __slots__ = ("kind", "node")

  def __init__(self, kind: str, node: Any):
    self.kind = kind  # "mirrored" | "per_replica" | "sync" | "static"
    self.node = node


def _check_replica_axis(tree: Any, n: int, what: str) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    shape = jnp.shape(leaf)
    if not shape or shape[0] != n:
      got = "a scalar" if not shape else f"a leading axis of {shape[0]}"
      raise StrategyMismatchError(
          f"{what} leaf {jax.tree_util.keystr(path) or '<value>'} has {got}, but "
          f"this strategy has {n} replicas. The value was distributed by a "
          "different strategy; distribute it again with this strategy (for "
          "example strategy.experimental_distribute_dataset).")


def _tile_sync(sync: SyncOnRead, n: int) -> SyncOnRead:
  """Gives an unplaced SyncOnRead a replica axis, so that reading returns it."""
  if sync.per_replica:
    return sync
  def tile(x):
    x = jnp.asarray(x)
    full = jnp.broadcast_to(x, (n,) + x.shape)
    if sync.aggregation is VariableAggregation.SUM:
      first = (jnp.arange(n) == 0).reshape((n,) + (1,) * x.ndim)
      full = jnp.where(first, full, jnp.zeros_like(full))
    return full
  return SyncOnRead(jax.tree.map(tile, sync.value), sync.aggregation, True)


def _find_batch(units) -> PerReplica | None:
  for u in units:
    if u.kind == "per_replica" and u.node.validity is not None:
      return u.node
  return None


class DistributedFunction:
  """A step function mapped over a strategy's replicas; see `Strategy.function`."""

  def __init__(self, strategy, fn: Callable, *, donate_argnums=(),
               static_argnums=(), static_argnames=(), check_state: bool = True):
    self._strategy = strategy
    self._fn = fn
    self._check_state = check_state
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
    self._guard = strategy._step_guard
    self._name = getattr(fn, "__name__", "step")
    self._in_flight = None
    self._compilations = 0
    functools.update_wrapper(self, fn)

  @property
  def strategy(self):
    """The strategy this step runs on."""
    return self._strategy

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
      self._lowerer = jax.jit(functools.partial(self._build, check=False),
                              **self._jit_options)
    return self._lowerer.lower(*args, **kwargs)

  def __call__(self, *args, **kwargs):
    if context.current_replica_context() is not None:
      raise RuntimeError(
          f"{getattr(self._fn, '__name__', 'step')} was called inside another "
          "step. Inside a step, call the plain per-replica function directly.")
    scope = context.current_scope_strategy()
    if scope is not None and scope != self._strategy:
      raise StrategyMismatchError(
          f"This step belongs to {self._strategy!r} but runs inside the scope of "
          f"{scope!r}. Build the step with the strategy whose scope is open.")
    try:
      out = self._jitted(*args, **kwargs)
    except ValueError as e:
      if "incompatible devices" in str(e):
        raise StrategyMismatchError(
            f"An argument lives on other devices than {self._strategy!r}: "
            f"{str(e).splitlines()[0]} Distributed values belong to the strategy "
            "that made them; place state with this strategy's replicate() and "
            "distribute batches with its experimental_distribute_dataset().") from e
      raise
    if self._throttle or self._guard is not None:
      first, last = _end_arrays(out)
      if self._guard is not None:  # the last leaf: outputs fed back get donated
        self._guard.track(self._name, last)
      if self._throttle:
        previous, self._in_flight = self._in_flight, first
        if previous is not None and not previous.is_deleted():
          previous.block_until_ready()
    return out

  # --- tracing -------------------------------------------------------------

  def _global_step(self, *args, **kwargs):
    self._compilations += 1
    return self._build(*args, check=True, **kwargs)

  def _build(self, *args, check: bool, **kwargs):
    strategy = self._strategy
    n = strategy.num_replicas_in_sync
    axis = strategy.axis_name
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs),
                                               is_leaf=is_distributed)
    units = []
    for node in flat:
      if isinstance(node, PerReplica):
        _check_replica_axis(node.values, n, "PerReplica")
        units.append(_Arg("per_replica", node))
      elif isinstance(node, SyncOnRead):
        node = _tile_sync(node, n)
        _check_replica_axis(node.value, n, "SyncOnRead")
        units.append(_Arg("sync", node))
      elif _is_static(node):
        units.append(_Arg("static", node))
      else:
        units.append(_Arg("mirrored", node))
    batch = _find_batch(units)

    leaves, specs, rebuild = [], [], []
    for u in units:
      if u.kind == "static":  # closed over: a constant of the program
        rebuild.append((u.kind, u.node, 0))
      elif u.kind == "mirrored":
        leaves.append(u.node)
        specs.append(P())
        rebuild.append((u.kind, None, 1))
      else:
        # A PerReplica's values (its validity enters once, for the batch).
        node = u.node.values if u.kind == "per_replica" else u.node
        sub, sub_tree = jax.tree_util.tree_flatten(node)
        leaves.extend(sub)
        specs.extend([P(axis)] * len(sub))
        rebuild.append((u.kind, sub_tree, len(sub)))
    validity_pos = None
    if batch is not None:
      validity_pos = len(leaves)
      leaves.append(batch.validity)
      specs.append(P(axis))

    record = {}

    def body(*local, probe: bool):
      local = list(local)
      pos, nodes = 0, []
      for kind, sub_tree, count in rebuild:
        chunk, pos = local[pos:pos + count], pos + count
        if kind == "static":
          nodes.append(sub_tree)
          continue
        if kind == "mirrored":
          nodes.append(chunk[0])
          continue
        node = jax.tree_util.tree_unflatten(sub_tree, chunk)
        if kind == "per_replica":
          nodes.append(jax.tree.map(lambda x: x[0], node))
        else:
          nodes.append(SyncOnRead(jax.tree.map(lambda x: x[0], node.value),
                                  node.aggregation, True))
      mask = num_valid = None
      if validity_pos is not None:  # this replica's row: mask, then the count
        row = local[validity_pos][0]
        mask, num_valid = row[:-1] > 0, row[-1]
      call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, nodes)
      ctx = ReplicaContext(strategy, mask=mask, num_valid=num_valid)
      with context.replica_scope(ctx):
        out = self._fn(*call_args, **call_kwargs)
      out_flat, out_tree = jax.tree_util.tree_flatten(
          out, is_leaf=lambda x: isinstance(x, SyncOnRead))
      if probe:
        if self._check_state:
          _check_state(out, call_args, axis, getattr(self._fn, "__name__", "step"))
        record["tree"] = out_tree
        record["kinds"] = [_output_kind(x, axis) for x in out_flat]
        record["aggregations"] = [getattr(x, "aggregation", None) for x in out_flat]
      results = []
      for x, kind in zip(out_flat, record["kinds"]):
        if kind == "sync":
          results.append(jax.tree.map(lambda v: _varying(v, axis)[None], x.value))
        elif kind == "per_replica" or probe:
          results.append(_varying(x, axis)[None])
        else:
          results.append(jnp.asarray(x))
      return results

    def mapped(probe: bool, out_specs):
      return jax.shard_map(functools.partial(body, probe=probe),
                           mesh=strategy.mesh, in_specs=tuple(specs),
                           out_specs=out_specs, check_vma=True)

    # Pass 1: every output per-replica (P(axis) is a prefix of any output
    # structure), only to learn from the traced types which outputs vary.
    if self._guard is None or not check:
      jax.eval_shape(mapped(True, P(axis)), *leaves)
    else:  # the same trace, kept as a jaxpr to compare with the other processes
      self._guard.check_program(self._name,
                                jax.make_jaxpr(mapped(True, P(axis)))(*leaves))
    kinds = record["kinds"]
    out_specs = [P() if k == "mirrored" else P(axis) for k in kinds]
    results = mapped(False, out_specs)(*leaves)
    wrapped = []
    for kind, x, agg in zip(kinds, results, record["aggregations"]):
      if kind == "sync":
        wrapped.append(SyncOnRead(x, agg, True))
      elif kind == "per_replica":
        wrapped.append(PerReplica(
            x, validity=None if batch is None else batch.validity))
      else:
        wrapped.append(x)
    return jax.tree_util.tree_unflatten(record["tree"], wrapped)


def _is_static(x: Any) -> bool:
  """Under jit every array argument is a tracer; the rest are static values."""
  return not isinstance(x, jax.core.Tracer)


def _output_kind(x: Any, axis: str) -> str:
  if isinstance(x, SyncOnRead):
    return "sync"
  return "per_replica" if collectives.is_varying(x, axis) else "mirrored"


def _varying(x: Any, axis: str) -> jax.Array:
  x = jnp.asarray(x)
  if collectives.is_varying(x, axis):
    return x
  return jax.lax.pcast(x, axis, to="varying")


def _end_arrays(tree: Any):
  """The first and the last array leaves of `tree` (None if it has none)."""
  arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  return (arrays[0], arrays[-1]) if arrays else (None, None)


def _check_state(out, call_args, axis: str, name: str) -> None:
  """Raises if an output shaped like a mirrored input varies over replicas."""
  outputs = out if isinstance(out, tuple) else (out,)
  is_sync = lambda x: isinstance(x, SyncOnRead)
  in_trees = []
  for a in call_args:
    leaves, tree = jax.tree_util.tree_flatten(a, is_leaf=is_sync)
    if tree.num_nodes > 1 and not any(
        collectives.is_varying(x, axis) for x in leaves if not is_sync(x)):
      in_trees.append(tree)
  for i, o in enumerate(outputs):
    leaves, tree = jax.tree_util.tree_flatten_with_path(o, is_leaf=is_sync)
    if tree not in in_trees:
      continue
    bad = [jax.tree_util.keystr(p) for p, x in leaves
           if not is_sync(x) and collectives.is_varying(x, axis)]
    if bad:
      where = f"output {i}" if isinstance(out, tuple) else "the output"
      raise VaryingStateError(
          f"{name} returned state ({where}) whose "
          f"{'leaves' if len(bad) > 1 else 'leaf'} {', '.join(bad[:5])} "
          f"{'differ' if len(bad) > 1 else 'differs'} between replicas, but the "
          "state passed in was mirrored (the same on every replica). Values "
          "computed from a replica's own batch, such as batch-norm statistics, "
          "must be made equal with jdist.get_replica_context().all_reduce("
          "jdist.ReduceOp.MEAN, value), or kept per replica by wrapping them in "
          "jdist.SyncOnRead. If this output is not state, build the step with "
          "strategy.function(fn, check_state=False).")
