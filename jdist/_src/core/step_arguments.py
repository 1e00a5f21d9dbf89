"""A step's arguments: placing those that need it, naming one jit refused.

A value made outside a step (a fresh metric's `SyncOnRead`) is placed
before the step compiles for it, so its calls compile once; an argument
committed to other devices than the strategy's is named in a clear error.
"""

from __future__ import annotations

from typing import Any

import jax

from jdist._src.core import kinds
from jdist._src.errors import StrategyMismatchError


def needs_placing(tree: Any) -> bool:
  """Whether a value in `tree` must be placed before a step takes it."""
  return any(kinds.kind_of(x).needs_placing(x) for x in
             jax.tree_util.tree_leaves(tree, is_leaf=kinds.is_node))


def placed(args: tuple, kwargs: dict, strategy) -> tuple:
  """`(args, kwargs)` with every value that needs placing placed."""
  def place(x):
    kind = kinds.kind_of(x)
    return kind.place(x, strategy) if kind.needs_placing(x) else x
  return jax.tree.map(place, (args, kwargs), is_leaf=kinds.is_node)


def foreign_argument(args: tuple, kwargs: dict,
                     strategy) -> StrategyMismatchError | None:
  """The error for an argument committed to other devices, or None."""
  mesh_devices = set(strategy.mesh.devices.flat)
  with_path = jax.tree_util.tree_flatten_with_path((args, kwargs),
                                                   is_leaf=kinds.is_node)[0]
  for path, node in with_path:
    for x in jax.tree.leaves(node):
      if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and
          x.committed and x.sharding.device_set != mesh_devices):
        where = ", ".join(f"{d.platform}:{d.id}" for d in sorted(
            x.sharding.device_set, key=lambda d: d.id))
        return StrategyMismatchError(
            f"An argument lives on other devices than {strategy!r}: "
            f"{argument_name(path)} (a {kinds.kind_of(node).name}) is on "
            f"[{where}]. Distributed values belong to the strategy that made "
            "them; place state with this strategy's replicate() and "
            "distribute batches with its experimental_distribute_dataset().")
  return None


def argument_name(path) -> str:
  """`args[0]['w']` for a path into `(args, kwargs)`."""
  top, *rest = path
  return ("args" if top.idx == 0 else "kwargs") + jax.tree_util.keystr(
      tuple(rest))
