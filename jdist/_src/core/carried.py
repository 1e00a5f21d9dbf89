"""`Carried`: values a loop feeds back to a step, held between its calls as
the leaves the last call returned (no pytree flattening per step), or whole
where the step cannot take them flat (`hold`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax


class Carried:
  """Values a loop feeds back to a step, flat or whole.

  Attributes:
    program: the jitted step over the leaves (None when held whole).
    treedefs: the structure of each carried value.
    leaves: a list of leaves per carried value (None when held whole).
    whole: the values themselves, when held whole (else None).
  """

  __slots__ = ("program", "treedefs", "leaves", "whole")

  def __init__(self, program, treedefs: tuple, leaves: list | None,
               whole: tuple | None = None):
    self.program = program
    self.treedefs = treedefs
    self.leaves = leaves
    self.whole = whole

  @classmethod
  def held_whole(cls, values: Sequence[Any]) -> "Carried":
    """`values` held whole: each call takes them as a call does."""
    return cls(None, (None,) * len(values), None, tuple(values))

  def values(self) -> tuple:
    """The carried values, as the step last returned them."""
    if self.whole is not None:
      return self.whole
    return tuple(td.unflatten(l) for td, l in zip(self.treedefs, self.leaves))

  def hold(self, name: str, out) -> tuple:
    """Holds `out`'s first outputs whole in the carried values' place;
    returns the other outputs.

    Raises:
      TypeError: `out` does not start with the carried values.
    """
    k = len(self.treedefs)
    if not isinstance(out, (tuple, list)) or len(out) < k:
      raise TypeError(
          f"{name} must return its {k} carried value(s) first (as "
          f"`state, totals = step(state, totals, batch)`), got "
          f"{type(out).__name__}.")
    self.program, self.leaves = None, None
    self.whole = tuple(out[:k])
    return tuple(out[k:])


def flatten(values: Sequence[Any]) -> tuple:
  """`(treedefs, leaves)` of `values`: a list of leaves per value."""
  flat = [jax.tree_util.tree_flatten(v) for v in values]
  return (tuple(treedef for _, treedef in flat),
          [leaves for leaves, _ in flat])


def unflatten(treedefs: tuple, flat_args: tuple) -> tuple:
  """A flat program's arguments as the step takes them."""
  k = len(treedefs)
  return tuple(treedef.unflatten(leaves) for treedef, leaves in
               zip(treedefs, flat_args[:k])) + tuple(flat_args[k:])


def flat_outputs(out, treedefs: tuple) -> tuple:
  """`(leaves per carried output, other outputs)` of the step's `out`, or
  `(None, out)` when their structure differs from the values'."""
  k = len(treedefs)
  if (isinstance(out, (tuple, list)) and len(out) >= k and all(
      jax.tree_util.tree_structure(o) == treedef
      for o, treedef in zip(out, treedefs))):
    return [jax.tree_util.tree_leaves(o) for o in out[:k]], tuple(out[k:])
  return None, out
