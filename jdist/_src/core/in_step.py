"""Reductions inside a step. `all_reduce(SUM, ...)` refuses invariant values
(a gradient autodiff summed already): `psum` would multiply it by N.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdist._src import jax_compat
from jdist._src.core import context
from jdist._src.core.reduce_op import ReduceOp
from jdist._src.errors import DoubleReductionError


def is_varying(x: Any, axis_name: str) -> bool:
  """Whether `x` (traced inside a step) may differ between replicas (always,
  in `context.untyped_replica`)."""
  if context.varying_types_untracked():
    return True
  return axis_name in jax_compat.varying_axes(x)


def to_varying(x: Any, axis_name: str) -> jax.Array:
  """`x` typed as varying over `axis_name` (a no-op if it already is)."""
  x = jnp.asarray(x)
  if is_varying(x, axis_name):
    return x
  return lax.pcast(x, axis_name, to="varying")


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or "<value>"


def all_reduce(op, value: Any, axis_name: str, num_replicas: int) -> Any:
  """Reduces every leaf of `value` over the replica axis: invariant arrays.

  Raises:
    DoubleReductionError: `op` is SUM and a leaf is already invariant.
  """
  op = ReduceOp.of(op)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
  out = []
  for path, leaf in leaves:
    if not is_varying(leaf, axis_name):
      if op is ReduceOp.SUM:
        raise DoubleReductionError(
            f"all_reduce(SUM) of {_path_str(path)}, which is already the same "
            f"on every replica: summing it would multiply it by {num_replicas}. "
            "Gradients with respect to mirrored parameters arrive already summed "
            "over replicas (autodiff did the all-reduce, as apply_gradients does "
            "in tf.distribute), so do not all-reduce them again. If you do want "
            "num_replicas times the value, multiply by "
            "ctx.num_replicas_in_sync instead.")
      out.append(jnp.asarray(leaf))  # MEAN, MAX and MIN of a constant are it.
      continue
    if op is ReduceOp.SUM:
      out.append(lax.psum(leaf, axis_name))
    elif op is ReduceOp.MEAN:
      out.append(lax.pmean(leaf, axis_name))
    elif op is ReduceOp.MAX:
      out.append(lax.pmax(leaf, axis_name))
    else:
      out.append(lax.pmin(leaf, axis_name))
  return jax.tree_util.tree_unflatten(treedef, out)


def all_gather(value: Any, axis: int, axis_name: str, num_replicas: int) -> Any:
  """Concatenates every replica's leaf along `axis`; the same on every replica."""

  def gather(leaf):
    leaf = jnp.asarray(leaf)
    if leaf.ndim == 0:
      raise ValueError(
          "all_gather needs values with at least one axis to concatenate along; "
          "got a scalar. Use jnp.reshape(x, (1,)) first.")
    ax = axis % leaf.ndim
    leaf = to_varying(leaf, axis_name)
    if jax_compat.all_gather_invariant is not None:
      return jax_compat.all_gather_invariant(leaf, axis_name, axis=ax,
                                             tiled=True)
    # Fallback: place the local block in a zero buffer and sum: invariant.
    idx = lax.axis_index(axis_name)
    shape = list(leaf.shape)
    shape[ax] *= num_replicas
    buf = jnp.zeros(shape, leaf.dtype)
    start = [0] * leaf.ndim
    start[ax] = idx * leaf.shape[ax]
    return lax.psum(lax.dynamic_update_slice(buf, leaf, start), axis_name)

  return jax.tree.map(gather, value)
