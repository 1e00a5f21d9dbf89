"""`jdist.pipeline`: a model's stacked layers, run as pipeline stages when
the step's strategy has a pipeline axis, and one after another otherwise.

A second `jax.shard_map`, manual over the pipeline axis alone, inside the
step's, so the other axes stay the compiler's. Each stage runs a loop of
`PipelineSchedule.iterations`, passing activations on with `ppermute`;
autodiff runs the same schedule backwards (docs/pipelines.md).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jdist._src import jax_compat
from jdist._src.core import context
from jdist._src.core import conv_layout
from jdist._src.errors import DistributionError
from jdist._src.strategies.pipeline_schedule import PipelineSchedule


def pipeline(layer_fn: Callable[[Any, Any], Any], stacked_params: Any,
             x: Any) -> Any:
  """Runs `L` stacked layers over `x`, as pipeline stages under a strategy
  with a pipeline axis, one after another otherwise.

  Rows must not interact inside a layer (no batch statistics); see
  docs/pipelines.md.

  Args:
    layer_fn: one layer, `(params, x) -> x`, keeping shapes and dtypes.
    stacked_params: a pytree whose leading dimension is the layer (`L`).
    x: the activations (a pytree), with the batch as leading dimension.

  Returns:
    The activations after the `L` layers, shaped as `x`.

  Raises:
    jdist.DistributionError: shapes, `L` or the batch do not fit the stages.

  Example:
    >>> import jax, jax.numpy as jnp, jdist
    >>> def layer(w, h):
    ...   return jnp.tanh(h @ w)
    >>> ws = jnp.stack([jnp.eye(3)] * 4)  # 4 layers
    >>> jdist.pipeline(layer, ws, jnp.ones((2, 3))).shape
    (2, 3)
  """
  num_layers = _num_layers(stacked_params)
  replica = context.current_replica_context()
  schedule = None if replica is None else replica.strategy.pipeline
  if schedule is None:
    _check_layer(layer_fn, _at(stacked_params, 0), x)
    return _sequential(layer_fn, stacked_params, x)
  return _pipelined(layer_fn, stacked_params, x, schedule, num_layers,
                    replica.strategy)


def _num_layers(stacked_params: Any) -> int:
  sizes = {jnp.shape(p)[0] if jnp.ndim(p) else None
           for p in jax.tree.leaves(stacked_params)}
  if len(sizes) != 1 or None in sizes:
    raise DistributionError(
        "jdist.pipeline's stacked_params must be arrays whose leading "
        "dimension is the layer, the same for every leaf; their leading "
        f"sizes are {sorted(sizes, key=str)}.")
  return sizes.pop()


def _check_layer(layer_fn: Callable, params: Any, x: Any) -> None:
  """Raises unless `layer_fn` maps `x` to activations shaped as `x`."""
  out = jax.eval_shape(layer_fn, params, x)
  shapes = jax.tree.map(lambda a: (jnp.shape(a), jnp.result_type(a)), x)
  out_shapes = jax.tree.map(lambda a: (a.shape, a.dtype), out)
  if out_shapes != shapes:
    raise DistributionError(
        "jdist.pipeline's layer_fn must return activations shaped as it "
        f"takes them (one stage passes them to the next): it took {shapes} "
        f"and returned {out_shapes}.")


def _sequential(layer_fn: Callable, stacked_params: Any, x: Any) -> Any:
  """The layers one after another: a `lax.scan` over the layer dimension."""
  return lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]


def _pipelined(layer_fn: Callable, stacked_params: Any, x: Any,
               schedule: PipelineSchedule, num_layers: int, strategy) -> Any:
  """The layers as `schedule`'s stages (see the module's docstring)."""
  s, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_repeats
  per_stage = schedule.layers_per_stage(num_layers)
  rows = {jnp.shape(a)[0] for a in jax.tree.leaves(x)}
  if len(rows) != 1:
    raise DistributionError(
        "jdist.pipeline's activations must share their leading (batch) "
        f"dimension; their sizes are {sorted(rows)}.")
  rows = rows.pop()
  size = schedule.microbatch_size(rows, strategy.num_replicas_in_sync)
  # Strided microbatches: a batch split over devices in blocks (FSDP) stays
  # split along the microbatch's rows.
  micro = jax.tree.map(
      lambda a: a.reshape(size, m, *a.shape[1:]).swapaxes(0, 1), x)
  layers = jax.tree.map(
      lambda p: p.reshape(v, s, per_stage, *p.shape[1:]), stacked_params)
  typed = not context.varying_types_untracked()
  jax_compat.fix_nested_shard_map_residuals()
  wide = conv_layout.runs_on_cpu(strategy)
  dtypes = jax.tree.map(lambda a: a.dtype, (layers, micro))
  loop = jax.shard_map(
      lambda w, xs: _stage_loop(layer_fn, schedule, w, xs, dtypes),
      in_specs=(P(None, schedule.axis), P()), out_specs=P(),
      axis_names={schedule.axis}, check_vma=typed)
  out = loop(*_widened((layers, micro), wide))
  return jax.tree.map(
      lambda a, t: a.astype(t.dtype).swapaxes(0, 1).reshape(
          rows, *a.shape[2:]), out, x)


def _widened(tree: Any, wide: bool) -> Any:
  """`tree` with floats narrower than 32 bits in float32, when `wide` (XLA:CPU
  aborts on a bfloat16 all-reduce in a partly manual program; exact here).
  """
  def one(a):
    if wide and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
      return a.astype(jnp.float32)
    return a
  return jax.tree.map(one, tree)


# What a stage's backward pass recomputes rather than keeps from its forward
# pass: views and casts, which cost no arithmetic. Kept, the views of the
# parameters (each layer's, sliced from the stage's) would be copied at every
# iteration of the loop: the stage's parameters once per microbatch.
_RECOMPUTED = frozenset({"dynamic_slice", "slice", "squeeze", "reshape",
                         "gather", "broadcast_in_dim", "transpose",
                         "convert_element_type"})


def _saveable(primitive, *_, **__) -> bool:
  return primitive.name not in _RECOMPUTED


def _stage_fn(layer_fn: Callable, remat: bool, per_stage: int) -> Callable:
  """One stage's work at one iteration: when `busy`, the layers of `repeat`
  over one microbatch; else the microbatch as it is (the bubble)."""
  def layers(w, repeat, h):
    def one(h, j):
      return layer_fn(jax.tree.map(lambda a: a[repeat, j], w), h), None
    return lax.scan(one, h, jnp.arange(per_stage))[0]

  def run(w, repeat, busy, h):
    return lax.cond(busy, layers, lambda _, __, h: h, w, repeat, h)

  return jax.checkpoint(run, policy=(
      jax.checkpoint_policies.nothing_saveable if remat else _saveable))


def _stage_loop(layer_fn: Callable, schedule: PipelineSchedule, w: Any,
                micro: Any, dtypes: tuple) -> Any:
  """One stage's loop over its layers `w` (leaves `(V, 1, k, ...)`) and the
  microbatches `micro` (`(M, b, ...)`); every microbatch's output, on every
  stage. Both are typed as varying before the loop, so autodiff sums their
  gradients once after it."""
  axis, s = schedule.axis, schedule.num_stages
  m, v = schedule.num_microbatches, schedule.num_repeats
  stage = lax.axis_index(axis)
  vary = _varying_like(axis, w, micro)
  edge = jax.tree.map(lambda a: a.dtype, micro)
  w, micro = jax.tree.map(lambda a, t: a.astype(t), vary((w, micro)), dtypes)
  w = jax.tree.map(lambda p: p[:, 0], w)
  _check_layer(layer_fn, _at(_at(w, 0), 0), _at(micro, 0))
  buffer = vary(jax.tree.map(lambda a: jnp.zeros_like(a[0]), micro))
  outputs = vary(jax.tree.map(jnp.zeros_like, micro))
  # Circular: what the last stage sent back, until the first stage's turn.
  returned = vary(jax.tree.map(jnp.zeros_like, micro)) if v > 1 else None
  run = _stage_fn(layer_fn, schedule.remat, jax.tree.leaves(w)[0].shape[1])
  forward = [(i, i + 1) for i in range(s - 1)] + ([(s - 1, 0)] if v > 1 else [])

  def body(t, carry):
    buffer, outputs, returned = carry
    k = t - stage
    busy = (k >= 0) & (k < v * m)
    k = jnp.clip(k, 0, v * m - 1)
    mb, repeat = k % m, k // m
    fresh = _at(micro, mb)
    if v > 1:  # file what came back from the last stage, then read it
      came = (t - s) % m
      returned = jax.tree.map(
          lambda r, b: r.at[came].set(jnp.where(t >= s, b, r[came])),
          returned, buffer)
      fresh = _where(repeat == 0, fresh, _at(returned, mb))
    inputs = _where(stage == 0, fresh, buffer)
    y = run(w, repeat, busy, inputs)
    done = busy & (stage == s - 1) & (repeat == v - 1)
    outputs = jax.tree.map(
        lambda o, a: o.at[mb].set(jnp.where(done, a, o[mb])), outputs, y)
    buffer = jax.tree.map(lambda a: lax.ppermute(a, axis, forward), y)
    return buffer, outputs, returned

  outputs = lax.fori_loop(0, schedule.iterations, body,
                          (buffer, outputs, returned))[1]
  return jax.tree.map(lambda o, t: lax.psum(o.astype(t), axis), outputs, edge)


def _at(tree: Any, i) -> Any:
  return jax.tree.map(lambda a: a[i], tree)


def _where(pred, a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _varying_like(axis: str, *trees) -> Callable:
  """A function typing a tree's arrays as varying over `axis` and every axis
  the leaves of `trees` vary over."""
  want = {axis}.union(*(jax_compat.varying_axes(x)
                        for x in jax.tree.leaves(trees)))

  def vary(tree):
    def one(x):
      missing = tuple(sorted(want - jax_compat.varying_axes(x)))
      return lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(one, tree)
  return vary
