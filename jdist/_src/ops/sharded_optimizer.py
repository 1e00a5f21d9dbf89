"""`ShardedOptimizer`: optimizer state split over the replicas (ZeRO-1/2).

Leaves keep their whole shapes (checkpoints restore onto any device count);
under `ModelParallelStrategy` a leaf is split over the replicas on top of its
parameter's layout.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src import current
from jdist._src import jax_compat
from jdist._src.core import context
from jdist._src.core import in_step
from jdist._src.core import kinds
from jdist._src.core.values import Sharded
from jdist._src.errors import ReplicaContextError, ShardingError
from jdist._src.ops import elementwise

def split_axis(shape: Sequence[int], num_replicas: int,
               within: Sequence[int] | None = None) -> int | None:
  """The first axis of `shape` that `num_replicas` (times `within`, the
  per-axis split within a replica) divides, or None (kept whole)."""
  if num_replicas == 1:
    return None
  for k, size in enumerate(shape):
    split = num_replicas * (within[k] if within else 1)
    if size >= split and size % split == 0:
      return k
  return None


def _mesh_axes(entry) -> tuple:
  """The mesh axes one dimension's `PartitionSpec` entry names."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _split_counts(spec: P, mesh, rank: int) -> tuple:
  """For each of `rank` axes, over how many devices `spec` splits it."""
  entries = list(spec) + [None] * (rank - len(spec))
  return tuple(int(np.prod([mesh.shape[a] for a in _mesh_axes(e)]))
               for e in entries[:rank])


def _block(x, axis: int, num_replicas: int, index) -> jax.Array:
  size = x.shape[axis] // num_replicas
  return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


class ShardedOptimizer:
  """An optax optimizer whose state is split over the replicas (ZeRO).

  A drop-in for the elementwise optax optimizer it wraps (adam, sgd, ...);
  see docs/sharded_optimizer.md.

  Args:
    optimizer: the optax `GradientTransformation` to shard.
    strategy: the steps' strategy (default: the current one at `init`).
    mirror_indivisible: keep whole the state of a leaf that does not split
      over the replicas (True), or raise `jdist.ShardingError`.

  Example:
    >>> import jdist, jax, jax.numpy as jnp, optax
    >>> strategy = jdist.MirroredStrategy()
    >>> tx = jdist.ShardedOptimizer(optax.adam(0.1), strategy)
    >>> params = strategy.replicate({"w": jnp.ones((8, 2))})
    >>> opt_state = tx.init(params)
    >>> @strategy.function
    ... def step(params, opt_state, x):
    ...   loss, grads = tx.value_and_grad(lambda p: jdist.compute_average_loss(
    ...       (x @ p["w"]).sum(axis=1)))(params)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state
    >>> x = strategy.experimental_distribute_dataset([jnp.ones((8, 8))])
    >>> params, opt_state = step(params, opt_state, next(iter(x)))
    >>> [round(float(v), 4) for v in params["w"][0]]  # adam's first step: -lr
    [0.9, 0.9]
  """

  def __init__(self, optimizer: optax.GradientTransformation, strategy=None,
               *, mirror_indivisible: bool = True):
    if not (callable(getattr(optimizer, "init", None)) and
            callable(getattr(optimizer, "update", None))):
      raise TypeError(
          "ShardedOptimizer wraps an optax GradientTransformation (for "
          f"example optax.adam(1e-3)), got {type(optimizer).__name__}.")
    self.optimizer = optimizer
    self._strategy = strategy
    self.mirror_indivisible = bool(mirror_indivisible)

  def __repr__(self) -> str:
    return f"ShardedOptimizer({self.optimizer!r})"

  def _resolve_strategy(self):
    return self._strategy if self._strategy is not None else (
        current.get_strategy())

  # --- layout ------------------------------------------------------------

  def layout(self, params: Any, num_replicas: int | None = None) -> Any:
    """The axis of each parameter leaf split over replicas (None: whole).

    Args:
      params: the parameters (arrays or `jax.ShapeDtypeStruct` values).
      num_replicas: default: the strategy's.

    Example:
      >>> import jdist, jax.numpy as jnp, optax
      >>> tx = jdist.ShardedOptimizer(optax.adam(1e-3))
      >>> tx.layout({"b": jnp.zeros(10), "w": jnp.zeros((10, 64))}, 4)
      {'b': None, 'w': 1}
    """
    strategy = self._strategy if num_replicas else self._resolve_strategy()
    n = num_replicas or strategy.num_replicas_in_sync
    treedef = jax.tree_util.tree_structure(params)
    return jax.tree_util.tree_unflatten(
        treedef, self._split_axes(params, n, strategy)[0])

  @staticmethod
  def _split_axes(params: Any, n: int, strategy) -> tuple[list, list]:
    """Each leaf's split axis, and its `_split_counts`."""
    leaves = jax.tree.leaves(params)
    if strategy is None:
      counts = [(1,) * np.ndim(x) for x in leaves]
    else:
      counts = [_split_counts(spec, strategy.mesh, np.ndim(x)) for x, spec in
                zip(leaves, strategy.replica_layouts(params))]
    return [split_axis(np.shape(x), n, c)
            for x, c in zip(leaves, counts)], counts

  def _checked_layout(self, params, strategy) -> list:
    n = strategy.num_replicas_in_sync
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if not flat:
      raise ShardingError("ShardedOptimizer.init got parameters with no "
                          "array leaves: there is no state to shard.")
    _check_free_replica_axis(params, strategy)
    axes, counts = self._split_axes(params, n, strategy)
    whole = [f"{jax.tree_util.keystr(p) or '<params>'} {tuple(np.shape(x))}"
             for (p, x), a in zip(flat, axes) if a is None]
    if n == 1 or not whole:
      return axes
    shown = ", ".join(whole[:8]) + (
        f" and {len(whole) - 8} more" if len(whole) > 8 else "")
    within = ""
    if any(k > 1 for c, a in zip(counts, axes) if a is None for k in c):
      within = (" (an axis its layout splits over k devices of a replica "
                f"must hold {n} x k)")
    if len(whole) == len(flat):
      raise ShardingError(
          f"None of the parameters can be split over {n} replicas: {shown}. "
          f"A leaf's optimizer state is split along its first axis that {n} "
          f"divides{within}, so all of this state would stay whole on every "
          "replica and sharding would save nothing. Use the optimizer itself "
          "(mirrored state; Trainer(shard_optimizer_state=False)), or layer "
          f"sizes that are multiples of {n}.")
    if not self.mirror_indivisible:
      raise ShardingError(
          f"These parameters cannot be split over {n} replicas: {shown}, and "
          "ShardedOptimizer(mirror_indivisible=False) refuses to keep their "
          f"state whole. A leaf's state is split along its first axis that "
          f"{n} divides{within}. Leave mirror_indivisible out (True keeps "
          "such leaves' state whole on every replica, as mirrored training "
          f"does), or use layer sizes that are multiples of {n}.")
    return axes

  def _state_axes(self, layout: elementwise.Layout, whole: list,
                  blocks: list) -> tuple:
    """The split axis of each state leaf, from whole and block parameters."""
    n = layout.num_replicas
    whole_state = jax.eval_shape(self.optimizer.init, layout.tree(whole))
    block_state = jax.eval_shape(self.optimizer.init, layout.tree(blocks))
    state_axes = []
    for (path, w), b in zip(
        jax.tree_util.tree_flatten_with_path(whole_state)[0],
        jax.tree.leaves(block_state)):
      diff = [k for k, (sw, sb) in enumerate(zip(w.shape, b.shape)) if sw != sb]
      if len(w.shape) != len(b.shape) or len(diff) > 1 or (
          diff and w.shape[diff[0]] != n * b.shape[diff[0]]):
        raise ShardingError(self._not_elementwise(
            f"its state leaf {jax.tree_util.keystr(path)} has shape "
            f"{w.shape} for the whole parameters but {b.shape} for one "
            "replica's blocks"))
      state_axes.append(diff[0] if diff else None)
    return tuple(state_axes)

  def _check_elementwise(self, layout: elementwise.Layout) -> None:
    """Refuses an update that is not elementwise, by program and by result."""
    problem = elementwise.program_problem(self.optimizer, layout)
    if problem is None and any(a is not None for a in layout.axes):
      problem = elementwise.result_problem(
          self.optimizer, layout,
          lambda whole, blocks: self._state_axes(layout, whole, blocks))
    if problem is not None:
      raise ShardingError(self._not_elementwise(problem))

  def _not_elementwise(self, why: str) -> str:
    return (
        f"ShardedOptimizer cannot split this optimizer's state: {why}. Each "
        "replica updates only its block of every parameter, so the "
        "optimizer must be elementwise (adam, adamw, sgd, momentum, rmsprop, "
        "adagrad, lion, ...): each element's update may depend only on its "
        "own gradient and state. clip_by_global_norm, adafactor, lamb, lars "
        "and apply_if_finite combine elements, noisy_sgd draws random "
        "numbers, an update using jnp.roll moves values between elements. "
        "Apply such a transform to the summed gradients in the step before "
        "calling update, or train with mirrored optimizer state.")

  # --- optax's interface -----------------------------------------------

  def init(self, params: Any) -> Sharded:
    """Each replica's block of the optimizer state, placed on its device
    (call it outside a step).

    Raises:
      jdist.ShardingError: the optimizer is not elementwise, no parameter
        can be split, (with `mirror_indivisible=False`) one cannot, or a
        parameter's layout already splits it over the replica axis.
    """
    if context.current_replica_context() is not None:
      raise ReplicaContextError(
          "ShardedOptimizer.init places the state on the replicas' devices: "
          "call it outside the step, once, and pass the state to the step.")
    strategy = self._resolve_strategy()
    n = strategy.num_replicas_in_sync
    layout = elementwise.Layout(params, self._checked_layout(params, strategy),
                                n)
    state_axes = self._state_axes(layout, layout.specs, layout.block_specs())
    self._check_elementwise(layout)
    whole_state = jax.eval_shape(self.optimizer.init, layout.tree(layout.specs))
    sharded = Sharded(None, state_axes, strategy.axis_name,
                      _state_layouts(whole_state, state_axes, strategy))
    out_tree = jax.tree_util.tree_structure(whole_state)
    shardings = jax.tree_util.tree_unflatten(out_tree, [
        NamedSharding(strategy.mesh, spec)
        for spec in sharded.partition_specs()])
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(params)):
      # A placement, not a model's constraint, which `strategy.mesh_scope`
      # (`strategy.init`) would read per replica: kept as written.
      with jax_compat.sharding_constraints_mapped(None):
        value = jax.lax.with_sharding_constraint(self.optimizer.init(params),
                                                 shardings)
    else:
      value = jax.jit(self.optimizer.init, out_shardings=shardings)(
          _on_mesh(params, strategy))
    return sharded.replace(value)

  def update(self, grads: Any, state: Sharded, params: Any = None
             ) -> tuple[Any, Sharded]:
    """This replica's block of the update, gathered whole on every replica
    (call it inside a step).

    Returns:
      `(updates, state)`: updates for the whole parameters, the same on
      every replica, and this replica's new block of the state.
    """
    ctx = context.current_replica_context()
    if ctx is None:
      raise ReplicaContextError(
          "ShardedOptimizer.update runs inside a step (strategy.run or "
          "strategy.function): each replica updates its own block of the "
          "state there.")
    if kinds.kind_of(state) is not kinds.SHARDED:
      raise TypeError(
          "ShardedOptimizer.update needs the state its init returned (a "
          f"jdist.Sharded), got {type(state).__name__}.")
    axis_name = ctx.strategy.axis_name
    n = ctx.num_replicas_in_sync
    index = lax.axis_index(axis_name)
    treedef = jax.tree_util.tree_structure(grads)
    axes = self._split_axes(grads, n, ctx.strategy)[0]

    def block_of_sum(g, a):
      if n == 1:  # one replica's gradient is the sum (a no-op all-reduce
        return g  # would still be one XLA refuses in an untyped map)
      if in_step.is_varying(g, axis_name):  # each replica's own: ZeRO-2
        if a is None:
          return lax.psum(g, axis_name)
        return lax.psum_scatter(g, axis_name, scatter_dimension=a, tiled=True)
      return g if a is None else _block(g, a, n, index)  # summed: ZeRO-1

    g_blocks = jax.tree_util.tree_unflatten(treedef, [
        block_of_sum(g, a) for g, a in zip(jax.tree.leaves(grads), axes)])
    p_blocks = None
    if params is not None:
      p_blocks = jax.tree_util.tree_unflatten(treedef, [
          p if a is None else _block(p, a, n, index)
          for p, a in zip(jax.tree.leaves(params), axes)])
    u_blocks, new_state = self.optimizer.update(g_blocks, state.value,
                                                p_blocks)
    updates = jax.tree_util.tree_unflatten(treedef, [
        u if a is None else in_step.all_gather(u, a, axis_name, n)
        for u, a in zip(jax.tree.leaves(u_blocks), axes)])
    return updates, state.replace(new_state)

  def value_and_grad(self, fun: Callable, argnums: int | Sequence[int] = 0,
                     has_aux: bool = False) -> Callable:
    """`jax.value_and_grad` whose gradients are each replica's own, for
    `update` to reduce-scatter (ZeRO-2)."""
    grad_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
      ctx = context.current_replica_context()
      # One replica's gradients are their sum: nothing to reduce-scatter
      # (and a replica over every device of a mesh maps its step untyped,
      # where XLA refuses even an all-reduce over one replica).
      if ctx is None or ctx.num_replicas_in_sync == 1:
        return grad_fn(*args, **kwargs)
      own = lambda x: in_step.to_varying(x, ctx.strategy.axis_name)
      args = tuple(jax.tree.map(own, a) if i in positions else a
                   for i, a in enumerate(args))
      return grad_fn(*args, **kwargs)

    return wrapped


def _check_free_replica_axis(params: Any, strategy) -> None:
  """Refuses a parameter laid out over the replica axis already."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, _), spec in zip(flat, strategy.replica_layouts(params)):
    if any(strategy.axis_name in _mesh_axes(e) for e in spec):
      raise ShardingError(
          f"Parameter {jax.tree_util.keystr(path) or '<params>'} is laid out "
          f"as {tuple(spec)}, over the replica axis {strategy.axis_name!r}: "
          "ShardedOptimizer splits each leaf's state over the replicas on "
          "top of its layout, so the layout must use the other mesh axes. "
          "Lay it out over those, or keep the optimizer state mirrored "
          "(Trainer(shard_optimizer_state=False)).")


def _state_layouts(whole_state: Any, axes: Sequence, strategy) -> tuple | None:
  """Each state leaf's layout within a replica, or None when all are whole."""
  n = strategy.num_replicas_in_sync
  flat = jax.tree_util.tree_flatten_with_path(whole_state)[0]
  layouts = tuple(strategy.replica_layouts(whole_state))
  for (path, x), spec, a in zip(flat, layouts, axes):
    if a is None:
      continue
    k = _split_counts(spec, strategy.mesh, np.ndim(x))[a]
    if np.shape(x)[a] % (n * k):
      raise ShardingError(
          f"The optimizer state leaf {jax.tree_util.keystr(path)} of shape "
          f"{tuple(np.shape(x))} is split over {n} replicas along axis {a}, "
          f"which its layout {tuple(spec)} also splits over {k} devices: "
          f"{np.shape(x)[a]} is not a multiple of {n * k}. Give the layout "
          "of this state the layout of its parameter (a LayoutMap key that "
          "matches both paths), or keep the optimizer state mirrored.")
  if all(not any(spec) for spec in layouts):
    return None
  return layouts


def _on_mesh(params: Any, strategy) -> Any:
  """`params` placed on the strategy's devices unless they already are."""
  devices = set(strategy.mesh.devices.flat)
  if all(isinstance(x, jax.Array) and x.sharding.device_set == devices
         for x in jax.tree.leaves(params)):
    return params
  return strategy.replicate(params)
