"""The probe of a step's outputs: which vary over replicas, read from JAX's types.

One abstract trace per compilation, every output returned per replica, gives
each output's kind and so the `OutputPlan` the real map is built from; the
same trace runs the step's checks (mirrored state, loss scaling, draws).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from jdist._src.core import in_step
from jdist._src.core import kinds
from jdist._src.core import random_check
from jdist._src.core import scaling_check
from jdist._src.core.validity import Validity
from jdist._src.errors import LossScalingError, VaryingStateError


def _flatten(out):
  return jax.tree_util.tree_flatten(out, is_leaf=kinds.is_kept_in_step)


@dataclasses.dataclass(frozen=True)
class OutputPlan:
  """How each output of a step leaves the `shard_map`, and is wrapped after:
  the outputs' `tree` (values kept whole as leaves), and per leaf its kind and
  `ValueKind.out_aux`."""

  tree: Any
  kinds: tuple
  auxes: tuple

  @classmethod
  def of(cls, out: Any, axis: str) -> "OutputPlan":
    """Reads the plan from outputs traced inside the map."""
    flat, tree = _flatten(out)
    found = tuple(kinds.output_kind(x, axis) for x in flat)
    return cls(tree, found, tuple(k.out_aux(x) for k, x in zip(found, flat)))

  def out_specs(self, axis: str) -> list:
    return [k.out_specs(aux, axis) for k, aux in zip(self.kinds, self.auxes)]

  def local_results(self, out: Any, axis: str) -> list:
    """Inside the map: this replica's outputs, shaped for `out_specs`."""
    return [k.result(x, axis) for k, x in zip(self.kinds, _flatten(out)[0])]

  def wrap(self, results: list, validity: Validity | None) -> Any:
    """Outside the map: the step's outputs as the user gets them."""
    return jax.tree_util.tree_unflatten(self.tree, [
        k.wrap(aux, x, validity)
        for k, aux, x in zip(self.kinds, self.auxes, results)])


def probe(run_replica: Callable, leaves: tuple, specs: tuple, strategy, *,
          check_state: bool, name: str,
          program_check: Callable | None = None,
          batch_rows: int | None = None, check_loss_scaling: bool = True,
          warn_draws: Callable | None = None) -> OutputPlan:
  """Traces the step once abstractly and returns its `OutputPlan`.

  `batch_rows` (the per-replica batch) enables the loss-scaling checks.

  Raises:
    VaryingStateError, LossScalingError: as the checks find.
  """
  axis = strategy.axis_name
  plans = []  # filled by the one abstract trace below

  def body(*local):
    out, state_trees = run_replica(*local)
    if check_state:
      check_mirrored_state(out, state_trees, axis, name)
    plans.append(OutputPlan.of(out, axis))
    return [jax.tree.map(lambda v: in_step.to_varying(v, axis)[None],
                         kinds.kind_of(x).payload(x))
            for x in _flatten(out)[0]]

  mapped = jax.shard_map(body, mesh=strategy.mesh, in_specs=specs,
                         out_specs=P(axis), axis_names={axis},
                         check_vma=True)
  n = strategy.num_replicas_in_sync
  checks = batch_rows is not None and n > 1 and (
      check_loss_scaling or warn_draws is not None)
  if program_check is None and not checks:
    jax.eval_shape(mapped, *leaves)
    return plans[0]
  traced = jax.make_jaxpr(mapped)(*leaves)
  if checks and check_loss_scaling:
    found = scaling_check.local_means(traced, axis, batch_rows)
    if found:
      raise LossScalingError(scaling_check.message(name, found, batch_rows, n))
  if checks and warn_draws is not None:
    draws = random_check.same_draws(traced, axis, batch_rows)
    if draws:
      warn_draws(random_check.message(name, draws[0], n))
  if program_check is not None:
    program_check(traced)
  return plans[0]


def mirrored_structures(call_args, axis: str) -> list:
  """The structures of the arguments that are mirrored state, read before
  the step runs (flax nnx updates its Variables in place)."""
  in_trees = []
  for a in call_args:
    leaves, tree = jax.tree_util.tree_flatten(a, is_leaf=kinds.is_kept_in_step)
    if tree.num_nodes > 1 and not any(
        in_step.is_varying(x, axis) for x in leaves
        if not kinds.is_kept_in_step(x)):
      in_trees.append(tree)
  return in_trees


def check_mirrored_state(out, in_trees: list, axis: str, name: str) -> None:
  """Raises if an output shaped like a mirrored input (`in_trees`) varies
  over replicas."""
  outputs = out if isinstance(out, tuple) else (out,)
  for i, o in enumerate(outputs):
    leaves, tree = jax.tree_util.tree_flatten_with_path(
        o, is_leaf=kinds.is_kept_in_step)
    if tree not in in_trees:
      continue
    bad = [jax.tree_util.keystr(p) for p, x in leaves
           if not kinds.is_kept_in_step(x) and in_step.is_varying(x, axis)]
    if bad:
      where = f"output {i}" if isinstance(out, tuple) else "the output"
      raise VaryingStateError(
          f"{name} returned state ({where}) whose "
          f"{'leaves' if len(bad) > 1 else 'leaf'} {', '.join(bad[:5])} "
          f"{'differ' if len(bad) > 1 else 'differs'} between replicas, but the "
          "state passed in was mirrored (the same on every replica). Values "
          "computed from a replica's own batch, such as batch-norm statistics, "
          "must be made equal: give flax's BatchNorm (linen or nnx) "
          "axis_name=strategy.axis_name, or reduce them with "
          "jdist.get_replica_context().all_reduce(jdist.ReduceOp.MEAN, value), "
          "or keep them per replica by wrapping them in jdist.SyncOnRead. If this output is not state, build the step with "
          "strategy.function(fn, check_state=False).")
