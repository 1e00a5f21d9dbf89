"""Keras variables as nested dicts along their paths, so a `LayoutMap` key
matches them as a flax parameter's and checkpoints get plain names.
"""

from __future__ import annotations

from typing import Any, Sequence


def check_paths(paths: Sequence[str], what: str) -> None:
  """ValueError unless every path is unique and none is another's parent
  (two layers of one name; both could not be dict entries)."""
  seen = set()
  for path in paths:
    if path in seen:
      raise ValueError(
          f"Two of the {what} have the path {path!r}: two layers of the model "
          "have the same name. jdist keys a Keras model's variables by path "
          "(as Keras's LayoutMap and checkpoints name them); give the layers "
          "distinct names (name=...).")
    seen.add(path)
  for path in paths:
    parts = path.split("/")
    for i in range(1, len(parts)):
      if "/".join(parts[:i]) in seen:
        raise ValueError(
            f"The {what} {'/'.join(parts[:i])!r} and {path!r}: one path is "
            "the other's parent, so they cannot be held as one tree. Rename "
            "the variable or the layer.")


def tree_of(paths: Sequence[str], values: Sequence[Any]) -> dict:
  """Nested dicts holding `values[i]` at `paths[i]` (split on "/").

  Example:
    >>> from jdist._src.keras.variables import tree_of
    >>> tree_of(["seq/dense/kernel", "seq/dense/bias"], [1, 2])
    {'seq': {'dense': {'kernel': 1, 'bias': 2}}}
  """
  tree: dict = {}
  for path, value in zip(paths, values, strict=True):
    *parents, leaf = path.split("/")
    node = tree
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return tree


def at_paths(tree: dict, paths: Sequence[str], what: str) -> list:
  """The values of `tree` at `paths`, in order (`tree_of`'s inverse);
  ValueError if one is missing (state made for another model).

  Example:
    >>> from jdist._src.keras.variables import at_paths
    >>> at_paths({'seq': {'dense': {'kernel': 1, 'bias': 2}}},
    ...          ["seq/dense/bias"], "weights")
    [2]
  """
  out = []
  for path in paths:
    node = tree
    for part in path.split("/"):
      if not isinstance(node, dict) or part not in node:
        raise ValueError(
            f"The {what} have no value at {path!r}: they were made for "
            f"another model (paths here: {sorted(_paths(tree))[:6]}...).")
      node = node[part]
    out.append(node)
  return out


def _paths(tree: Any, prefix: str = "") -> list[str]:
  if not isinstance(tree, dict):
    return [prefix]
  out = []
  for k, v in tree.items():
    out.extend(_paths(v, f"{prefix}/{k}" if prefix else str(k)))
  return out
