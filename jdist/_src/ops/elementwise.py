"""Whether an optax update is elementwise, as `ShardedOptimizer` needs:
checked by program (no output from a primitive that mixes elements) and by
result (the blocks' updates of a random probe make up the whole leaf's).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import numpy as np
from jax import lax

# Primitives whose result mixes elements of an array: an update using one on a
# parameter's block would differ from the update of the whole parameter.
COUPLING = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
    "reduce_or", "reduce_xor", "argmax", "argmin", "dot_general", "cumsum",
    "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "top_k",
    "conv_general_dilated", "fft", "reduce",
})
# Primitives that only explain a difference the probe found.
RANDOM = frozenset({
    "random_bits", "random_split", "random_fold_in", "random_seed",
    "threefry2x32", "rng_bit_generator", "rng_uniform",
})
MOVEMENT = frozenset({
    "slice", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad",
    "rev", "gather", "scatter", "scatter-add", "scatter_add", "transpose",
})
_NOTABLE = COUPLING | RANDOM | MOVEMENT

# Probe leaves: the split axis gets this many elements per replica, every
# other axis at most _PROBE_OTHER.
_PROBE_BLOCK = 2
_PROBE_OTHER = 3
_PROBE_STEPS = 2


def _notable(eqn) -> bool:
  """A random draw, or a mixing or moving primitive applied to arrays."""
  name = eqn.primitive.name
  return name in RANDOM or (name in _NOTABLE and any(
      getattr(v.aval, "ndim", 0) > 0 for v in eqn.invars))


def _notable_inside(jaxpr) -> frozenset:
  """Notable primitives in `jaxpr` and the jaxprs nested in it."""
  found = set()
  for eqn in jaxpr.eqns:
    if _notable(eqn):
      found.add(eqn.primitive.name)
    for sub in _subjaxprs(eqn):
      found |= _notable_inside(sub)
  return frozenset(found)


def _subjaxprs(eqn):
  for param in eqn.params.values():
    for sub in param if isinstance(param, (tuple, list)) else (param,):
      if isinstance(sub, jcore.ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, jcore.Jaxpr):
        yield sub


def notable_by_output(jaxpr) -> list[frozenset]:
  """For each output of `jaxpr`, the notable primitives it depends on."""
  deps = {}

  def of(v):
    return frozenset() if isinstance(v, jcore.Literal) else deps.get(
        v, frozenset())

  for eqn in jaxpr.eqns:
    found = set().union(*(of(v) for v in eqn.invars))
    if _notable(eqn):
      found.add(eqn.primitive.name)
    for sub in _subjaxprs(eqn):
      found |= _notable_inside(sub)
    for v in eqn.outvars:
      deps[v] = frozenset(found)
  return [of(v) for v in jaxpr.outvars]


def _explain(names: frozenset) -> str:
  """Why primitives make an update differ on a block, or ""."""
  if names & RANDOM:
    return (f"it draws random numbers ({', '.join(sorted(names & RANDOM))}): "
            "every replica would draw the same numbers for its block")
  if names & MOVEMENT:
    return (f"it moves values between elements "
            f"({', '.join(sorted(names & MOVEMENT))})")
  if names & COUPLING:
    return (f"it combines elements of a parameter "
            f"({', '.join(sorted(names & COUPLING))})")
  return ""


class Layout:
  """Where each parameter leaf (its path and spec) is split over
  `num_replicas` replicas (`axes`: None for whole)."""

  def __init__(self, params: Any, axes: Sequence, num_replicas: int):
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.paths = [jax.tree_util.keystr(p) or "<params>" for p, _ in flat]
    self.specs = [jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))
                  for _, x in flat]
    self.axes = list(axes)
    self.num_replicas = num_replicas

  def tree(self, leaves: list) -> Any:
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def block_specs(self, specs: list | None = None) -> list:
    """One replica's block of each leaf spec."""
    n = self.num_replicas
    return [jax.ShapeDtypeStruct(
        tuple(s // n if k == a else s for k, s in enumerate(x.shape)), x.dtype)
            for x, a in zip(specs or self.specs, self.axes)]

  def probe_specs(self) -> list:
    """Small leaves of the same ranks and dtypes, split along the same axes."""
    n = self.num_replicas
    return [jax.ShapeDtypeStruct(tuple(
        n * _PROBE_BLOCK if k == a else min(s, _PROBE_OTHER)
        for k, s in enumerate(x.shape)), x.dtype)
            for x, a in zip(self.specs, self.axes)]


def block(leaves: list, axes: Sequence, num_replicas: int, i: int) -> list:
  """Replica `i`'s block of each leaf (split ones) or the leaf itself."""
  out = []
  for x, a in zip(leaves, axes):
    if a is not None:
      size = x.shape[a] // num_replicas
      x = lax.slice_in_dim(x, i * size, (i + 1) * size, axis=a)
    out.append(x)
  return out


def program_problem(optimizer, layout: Layout) -> str | None:
  """Why the update traced on one replica's blocks mixes the elements of a
  leaf (naming the first such output), or None."""
  blocks = layout.tree(layout.block_specs())
  block_state = jax.eval_shape(optimizer.init, blocks)
  traced, out = jax.make_jaxpr(optimizer.update, return_shape=True)(
      blocks, block_state, blocks)
  for name, found in zip(_output_names(out), notable_by_output(traced.jaxpr)):
    if found & COUPLING:
      return f"on {name}, {_explain(found & COUPLING)}"
  return None


def _output_names(out) -> list[str]:
  """The name of each output leaf of the update, for messages."""
  updates, state = out
  names = [f"parameter {jax.tree_util.keystr(p) or '<params>'}" for p, _ in
           jax.tree_util.tree_flatten_with_path(updates)[0]]
  return names + [f"state leaf {jax.tree_util.keystr(p)}" for p, _ in
                  jax.tree_util.tree_flatten_with_path(state)[0]]


def result_problem(optimizer, layout: Layout,
                   state_axes: Callable[[list, list], list]) -> str | None:
  """Why the blocks' updates of a small random probe do not make up the whole
  leaves' update (naming the first leaf), or None; runs eagerly on the CPU."""
  probe = layout.probe_specs()
  axes_of_state = state_axes(probe, layout.block_specs(probe))
  rng = np.random.default_rng(0)
  n = layout.num_replicas
  update = optimizer.update
  # Evaluated now even when `init` runs inside a trace (`strategy.init` of
  # a whole train state): the probe's values are concrete.
  with jax.ensure_compile_time_eval(), jax.default_device(
      jax.local_devices(backend="cpu")[0]):
    params = [_random(rng, x) for x in probe]
    state = optimizer.init(layout.tree(params))
    for _ in range(_PROBE_STEPS):
      grads = [_random(rng, x) for x in probe]
      whole, new_state = update(layout.tree(grads), state, layout.tree(params))
      state_leaves, state_def = jax.tree.flatten(state)
      parts = [jax.tree.leaves(update(
          layout.tree(block(grads, layout.axes, n, i)),
          jax.tree.unflatten(state_def,
                             block(state_leaves, axes_of_state, n, i)),
          layout.tree(block(params, layout.axes, n, i)))[0]) for i in range(n)]
      whole = jax.tree.leaves(whole)
      for k, (path, axis) in enumerate(zip(layout.paths, layout.axes)):
        diff = _difference(whole[k], [p[k] for p in parts], axis)
        if diff:
          why = _explain(notable_by_output(jax.make_jaxpr(update)(
              layout.tree(grads), state, layout.tree(params)).jaxpr)[k])
          return (f"on parameter {path}, its update on each replica's block "
                  f"differs from its update on the whole leaf (by up to "
                  f"{diff:.3g} on a small random probe): "
                  f"{why or 'it is not elementwise'}")
      params = [p + u for p, u in zip(params, whole)]
      state = new_state
  return None


def _difference(whole, parts: list, axis: int | None) -> float:
  """How far the parts are from the whole beyond float rounding (0.0: not)."""
  want = np.asarray(whole, np.float64)
  got = [np.asarray(p, np.float64) for p in parts]
  if axis is not None:
    got = [np.concatenate(got, axis=axis)]
  worst = 0.0
  for g in got:
    if g.shape != want.shape:
      return float("inf")
    error = np.abs(g - want)
    tolerance = 1e-5 * np.abs(want) + 1e-6 * np.abs(want).max(initial=0.0)
    if (error > tolerance).any():
      worst = max(worst, float(error.max()))
  return worst


def _random(rng, spec) -> jax.Array:
  if jax.numpy.issubdtype(spec.dtype, jax.numpy.inexact):
    return jax.numpy.asarray(rng.normal(size=spec.shape), np.float32)
  return jax.numpy.zeros(spec.shape, spec.dtype)
