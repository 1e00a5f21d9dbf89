"""The plan of a step's inputs: how each argument enters `jax.shard_map`,
asked of each flattened argument's kind (`kinds.py`); it knows no kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jdist._src.core import kinds
from jdist._src.core.validity import Validity


@dataclasses.dataclass(frozen=True)
class ArgSlot:
  """One flattened argument: its kind, how many `shard_map` inputs it takes,
  and the kind's `Inputs.aux` that rebuilds it inside the map."""

  kind: kinds.ValueKind
  count: int
  aux: Any = None


@dataclasses.dataclass(frozen=True)
class InputPlan:
  """How a call's arguments enter the step's `shard_map`.

  `in_tree` is the structure of `(args, kwargs)` (distributed values as
  leaves), one `ArgSlot` per leaf; `leaves` and `specs` are the `shard_map`'s
  inputs; the batch's `validity` (or None) is fed as the last input.
  """

  in_tree: Any
  slots: tuple
  leaves: tuple
  specs: tuple
  validity: Validity | None

  @classmethod
  def of(cls, strategy, args: tuple, kwargs: dict) -> "InputPlan":
    """Plans the call `fn(*args, **kwargs)` (traced under jit) on `strategy`."""
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs),
                                               is_leaf=kinds.is_node)
    slots, leaves, specs, validity = [], [], [], None
    for node in flat:
      kind = kinds.input_kind(node)
      entered = kind.inputs(node, strategy)
      slots.append(ArgSlot(kind, len(entered.leaves), entered.aux))
      leaves.extend(entered.leaves)
      specs.extend(entered.specs)
      if validity is None:
        validity = kind.validity(node)
    if validity is not None:  # the batch's rows: mask, then the count
      leaves.append(validity.packed)
      specs.append(P(strategy.axis_name))
    return cls(in_tree, tuple(slots), tuple(leaves), tuple(specs), validity)

  def local_arguments(self, local: tuple) -> tuple:
    """Inside the map: `(args, kwargs, validity)` as this replica sees them,
    from its blocks of `leaves`."""
    pos, nodes = 0, []
    for slot in self.slots:
      chunk, pos = local[pos:pos + slot.count], pos + slot.count
      nodes.append(slot.kind.local(slot.aux, chunk))
    validity = None
    if self.validity is not None:
      validity = Validity(local[pos]).replica(0)
    args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, nodes)
    return args, kwargs, validity
