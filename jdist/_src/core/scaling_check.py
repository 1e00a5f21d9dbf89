"""The classic loss-scaling mistake, found in a step's program when it is traced.

A step whose loss is a mean over its replica's batch (`per_example.mean()`,
flax's MNIST example) trains with gradients `num_replicas` times too large:
gradients with respect to mirrored parameters are summed over replicas. It
runs, it even learns, and nothing is wrong but the numbers, so it must be
caught where it can be seen: in the program.

Reverse-mode autodiff of `mean(v)` over a tensor `v` of `n` elements scales
the scalar cotangent of the loss (the constant 1.0 that `grad` seeds) by
`1/n` and broadcasts it back to `v`'s shape. In the traced step that is a
`broadcast_in_dim` of a constant scalar equal to `1/n` into a tensor that
varies over replicas, whose leading axis is the replica's batch and whose
size is `n`; and the gradient it starts flows into the `psum` that sums
gradients over replicas. `compute_average_loss` divides by the global count
of valid examples (a traced value, not a constant), and
`sum(per_example) / GLOBAL_BATCH_SIZE` broadcasts `1/(N * b)`: neither
matches. Constants are folded through the scalar arithmetic of the chain
(`pvary`, `mul`, `div`, `neg`, conversions), so `mean(v) / num_replicas`, a
correct scaling, does not match either.

`sum(v) / PER_REPLICA_BATCH` is the same mean and is found too. Not found
(false negatives, never false alarms): a local mean scaled by another
constant (`0.5 * mean(v)`, mixed-precision loss scaling) and a local mean
whose divisor is computed (`sum(w * v) / sum(w)`, `jnp.mean(v, where=m)`).
`jdist.testing.assert_equivalent` names loss scaling when a run is off by
a factor near the number of replicas.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.extend.core as jcore
import numpy as np

from jdist._src import jax_compat

# Scalar arithmetic folded along the cotangent's chain.
_UNARY = {
    "pvary": lambda x: x, "pcast": lambda x: x, "copy": lambda x: x,
    "copy_p": lambda x: x, "convert_element_type": lambda x: x,
    "reduce_precision": lambda x: x, "squeeze": lambda x: x,
    "reshape": lambda x: x, "neg": lambda x: -x,
}
_BINARY = {
    "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b,
}
# Where gradients of mirrored parameters are summed over replicas (a
# reduce-scatter: a ShardedOptimizer's update of each replica's gradients).
_SUMS = {"psum", "psum_invariant", "psum2", "reduce_scatter"}


@dataclasses.dataclass(frozen=True)
class LocalMean:
  """A mean over a replica-local tensor that a gradient sum depends on.

  Attributes:
    shape: the shape of the tensor averaged (its leading axis: the batch).
  """

  shape: tuple


class _Walk:

  def __init__(self, axis: str, rows: int):
    self.axis = axis
    self.rows = rows
    self.candidates: list[LocalMean] = []
    self.confirmed: set[int] = set()


def _scalar(x) -> float | None:
  try:
    arr = np.asarray(x)
  except Exception:  # an abstract value
    return None
  if arr.ndim != 0 or arr.dtype.kind not in "biuf":
    return None
  return float(arr)


def _sub_jaxprs(params: dict) -> list:
  """`(jaxpr, consts)` of every jaxpr in an equation's parameters."""
  out = []
  for value in params.values():
    items = value if isinstance(value, (list, tuple)) else (value,)
    for item in items:
      if isinstance(item, jcore.ClosedJaxpr):
        out.append((item.jaxpr, list(item.consts)))
      elif isinstance(item, jcore.Jaxpr):
        out.append((item, []))
  return out


def _walk(walk: _Walk, jaxpr, known: dict, tainted: dict) -> list:
  """Folds constants and follows candidate cotangents through `jaxpr`.

  Args:
    walk: the findings so far.
    jaxpr: a `jax.extend.core.Jaxpr`.
    known: var -> constant scalar value.
    tainted: var -> candidate ids whose cotangent it depends on.

  Returns:
    The candidate ids each output of `jaxpr` depends on.
  """
  def value(v):
    if isinstance(v, jcore.Literal):
      return _scalar(v.val)
    return known.get(v)

  def taint_of(v):
    return frozenset() if isinstance(v, jcore.Literal) else tainted.get(
        v, frozenset())

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    taint = frozenset().union(*(taint_of(v) for v in eqn.invars))
    if name in _SUMS and taint:
      walk.confirmed |= taint
    subs = _sub_jaxprs(eqn.params)
    if subs:
      calls = [(j, c) for j, c in subs if len(j.invars) == len(eqn.invars)
               and len(j.outvars) == len(eqn.outvars)]
      if len(subs) == 1 and calls:  # a call: jit, remat, shard_map, custom_*
        inner, consts = calls[0]
        inner_known = {v: _scalar(c) for v, c in zip(inner.constvars, consts)}
        inner_known.update({iv: value(v) for iv, v in zip(inner.invars,
                                                           eqn.invars)})
        inner_known = {k: v for k, v in inner_known.items() if v is not None}
        inner_taint = {iv: taint_of(v) for iv, v in zip(inner.invars,
                                                        eqn.invars)}
        outs = _walk(walk, inner, inner_known, inner_taint)
        for v, t in zip(eqn.outvars, outs):
          if t:
            tainted[v] = t
        continue
      for inner, consts in subs:  # cond, while, scan: look inside, alone
        before = set(walk.confirmed)
        inner_known = {v: _scalar(c) for v, c in zip(inner.constvars, consts)}
        _walk(walk, inner, {k: v for k, v in inner_known.items()
                            if v is not None}, {})
        if taint and _has_sum(inner):
          walk.confirmed |= taint
        walk.confirmed |= before
      for v in eqn.outvars:
        if taint:
          tainted[v] = taint
      continue
    ins = [value(v) for v in eqn.invars]
    out = eqn.outvars[0] if eqn.outvars else None
    if name in _UNARY and len(ins) == 1 and ins[0] is not None and \
        not out.aval.shape:
      known[out] = _UNARY[name](ins[0])
    elif name in _BINARY and len(ins) == 2 and None not in ins and \
        not out.aval.shape:
      with np.errstate(all="ignore"):
        known[out] = _BINARY[name](ins[0], ins[1])
    elif name == "broadcast_in_dim" and ins and ins[0] is not None:
      shape = tuple(out.aval.shape)
      size = math.prod(shape)
      if (shape and shape[0] == walk.rows and walk.rows > 1 and size > 1 and
          walk.axis in jax_compat.aval_varying_axes(out.aval) and
          math.isclose(ins[0] * size, 1.0, rel_tol=1e-5)):
        walk.candidates.append(LocalMean(shape))
        taint = taint | {len(walk.candidates) - 1}
    if taint:
      for v in eqn.outvars:
        tainted[v] = taint
  return [taint_of(v) for v in jaxpr.outvars]


def _has_sum(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _SUMS:
      return True
    if any(_has_sum(j) for j, _ in _sub_jaxprs(eqn.params)):
      return True
  return False


def local_means(closed_jaxpr: Any, axis: str, rows: int) -> list[LocalMean]:
  """The local means over replica batches that gradient sums depend on.

  Args:
    closed_jaxpr: the traced step (`jax.make_jaxpr` of its `shard_map`).
    axis: the replica axis.
    rows: the per-replica batch size (the batch's leading axis per replica).

  Returns:
    One `LocalMean` per mean found; empty for a correctly scaled step.
  """
  walk = _Walk(axis, rows)
  known = {v: _scalar(c) for v, c in zip(closed_jaxpr.jaxpr.constvars,
                                         closed_jaxpr.consts)}
  _walk(walk, closed_jaxpr.jaxpr,
        {k: v for k, v in known.items() if v is not None}, {})
  return [walk.candidates[i] for i in sorted(walk.confirmed)]


def message(name: str, found: list[LocalMean], rows: int,
            num_replicas: int) -> str:
  """The error for a step whose loss averages over its replica's batch."""
  shape = found[0].shape
  return (
      f"{name} averages its loss over this replica's batch (a mean over a "
      f"tensor of shape {shape}: {rows} examples per replica), but gradients "
      f"with respect to mirrored parameters are summed over the "
      f"{num_replicas} replicas, so they come out {num_replicas} times the "
      "gradient of the global mean: the classic loss-scaling mistake (flax's "
      "MNIST step ported as is). Divide by the global batch instead: return "
      "jdist.compute_average_loss(per_example_loss) (exact on a padded last "
      "batch), or sum(per_example_loss) / GLOBAL_BATCH_SIZE. If you do want "
      "the sum of the replicas' means, build the step with "
      "strategy.function(fn, check_loss_scaling=False).")
