"""The classic loss-scaling mistake, found in a step's program when it is traced.

A loss averaged over a replica's batch (`per_example.mean()`) gives gradients
`num_replicas` times too large, since gradients of mirrored parameters are
summed over replicas. Its trace shows a `broadcast_in_dim` of `1/n` into a
varying tensor of the replica's batch, feeding the gradient's `psum`. Misses
are possible (a computed divisor); false alarms are not.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
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
  """A mean over a replica-local tensor of `shape` that a gradient sum
  depends on."""

  shape: tuple


class _Walk:
  """One pass over a traced step: candidate local means, and those confirmed
  to reach a sum over replicas (`known`: var -> folded constant scalar;
  `tainted`: var -> the candidates it depends on)."""

  def __init__(self, axis: str, rows: int):
    self.axis = axis
    self.rows = rows
    self.candidates: list[LocalMean] = []
    self.confirmed: set[int] = set()

  def jaxpr(self, jaxpr, known: dict, tainted: dict) -> list:
    """Walks `jaxpr`; returns the candidate ids each of its outputs depends on."""
    for eqn in jaxpr.eqns:
      taint = frozenset().union(*(_taint(tainted, v) for v in eqn.invars))
      if eqn.primitive.name in _SUMS and taint:
        self.confirmed |= taint
      subs = sub_jaxprs(eqn.params)
      if subs:
        self._nested(eqn, subs, known, tainted, taint)
        continue
      taint = self._arithmetic(eqn, known, taint)
      if taint:
        for v in eqn.outvars:
          tainted[v] = taint
    return [_taint(tainted, v) for v in jaxpr.outvars]

  def _nested(self, eqn, subs: list, known: dict, tainted: dict,
              taint: frozenset) -> None:
    """An equation holding jaxprs: a call is followed through its inputs and
    outputs; cond, while and scan bodies are looked into alone."""
    calls = [(j, c) for j, c in subs if len(j.invars) == len(eqn.invars)
             and len(j.outvars) == len(eqn.outvars)]
    if len(subs) == 1 and calls:  # a call: jit, remat, shard_map, custom_*
      inner, consts = calls[0]
      inner_known = _constants(inner, consts)
      inner_known.update({iv: _value(known, v) for iv, v in zip(inner.invars,
                                                               eqn.invars)})
      inner_known = {k: v for k, v in inner_known.items() if v is not None}
      inner_taint = {iv: _taint(tainted, v) for iv, v in zip(inner.invars,
                                                             eqn.invars)}
      for v, t in zip(eqn.outvars, self.jaxpr(inner, inner_known, inner_taint)):
        if t:
          tainted[v] = t
      return
    for inner, consts in subs:
      before = set(self.confirmed)
      self.jaxpr(inner, _constants(inner, consts), {})
      if taint and _has_sum(inner):
        self.confirmed |= taint
      self.confirmed |= before
    if taint:
      for v in eqn.outvars:
        tainted[v] = taint

  def _arithmetic(self, eqn, known: dict, taint: frozenset) -> frozenset:
    """Folds a scalar equation into `known`, or starts a candidate at a
    broadcast of `1/n`; returns the taint of the equation's outputs."""
    name = eqn.primitive.name
    ins = [_value(known, v) for v in eqn.invars]
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
      if (shape and shape[0] == self.rows and self.rows > 1 and size > 1 and
          self.axis in jax_compat.aval_varying_axes(out.aval) and
          math.isclose(ins[0] * size, 1.0, rel_tol=1e-5)):
        self.candidates.append(LocalMean(shape))
        taint = taint | {len(self.candidates) - 1}
    return taint


def _scalar(x) -> float | None:
  """`x` as a float if it is a concrete real scalar (not abstract), else None."""
  if isinstance(x, jax.core.Tracer) or np.ndim(x) != 0:
    return None
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  if not any(jax.dtypes.issubdtype(dtype, kind)
             for kind in (np.bool_, np.integer, np.floating)):
    return None
  return float(x)


def sub_jaxprs(params: dict) -> list:
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


def _constants(jaxpr, consts) -> dict:
  """The scalar constants among `jaxpr`'s constvars."""
  known = {v: _scalar(c) for v, c in zip(jaxpr.constvars, consts)}
  return {k: v for k, v in known.items() if v is not None}


def _value(known: dict, v):
  """The constant scalar value of `v` (a literal or a folded var), or None."""
  if isinstance(v, jcore.Literal):
    return _scalar(v.val)
  return known.get(v)


def _taint(tainted: dict, v) -> frozenset:
  """The candidate ids `v` depends on."""
  if isinstance(v, jcore.Literal):
    return frozenset()
  return tainted.get(v, frozenset())


def _has_sum(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _SUMS:
      return True
    if any(_has_sum(j) for j, _ in sub_jaxprs(eqn.params)):
      return True
  return False


def local_means(closed_jaxpr: Any, axis: str, rows: int) -> list[LocalMean]:
  """The local means over replica batches (of `rows` rows) that gradient
  sums depend on, in the traced step's `shard_map`; empty when correct."""
  walk = _Walk(axis, rows)
  walk.jaxpr(closed_jaxpr.jaxpr,
             _constants(closed_jaxpr.jaxpr, closed_jaxpr.consts), {})
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
