"""Layouts read from flax's own partition metadata: linen `Partitioned` and
`LogicallyPartitioned` boxes, and nnx variables' `out_sharding`. optax keeps
the boxes around a parameter's moments, so every copy of a parameter is laid
out from its box; a leaf in a box is named by the box's path.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src.strategies.device_mesh import DeviceMesh


def is_box(x: Any) -> bool:
  """Whether `x` is a linen `AxisMetadata` or an nnx `Variable` (False
  while flax is not imported: importing it only to ask is slow)."""
  if "flax" not in sys.modules:
    return False
  from flax import nnx
  from flax.core import meta
  return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def path_name(path: tuple) -> str:
  """A pytree key path as the "/"-joined string LayoutMap keys match."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def named_nodes(tree: Any, stop: Callable[[Any], bool] = lambda x: False):
  """`tree` flattened down to its leaves, its boxes and the nodes `stop`
  accepts: `(names, nodes, treedef)`, each node named by its path."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: is_box(x) or stop(x))
  return [path_name(p) for p, _ in flat], [n for _, n in flat], treedef


def named_leaves(tree: Any) -> list[tuple[str, Any, Any]]:
  """`(name, leaf, box or None)` for every leaf of `tree`, in leaf order;
  a leaf inside a box is named by the box's path."""
  out = []
  for name, node in zip(*named_nodes(tree)[:2]):
    if is_box(node):
      out.extend((name, leaf, node) for leaf in jax.tree.leaves(node))
    else:
      out.append((name, node, None))
  return out


def normalize_rules(rules) -> tuple:
  """Logical axis rules as a tuple of `(logical name, mesh axes)` pairs."""
  if rules is None:
    return ()
  try:
    pairs = tuple((name, tuple(axes) if isinstance(axes, list) else axes)
                  for name, axes in rules)
  except (TypeError, ValueError):
    raise TypeError(
        "logical_axis_rules must be pairs (logical name, mesh axis or None), "
        f"as flax's nn.logical_axis_rules takes; got {rules!r}.") from None
  return pairs


def _axes(entry) -> tuple:
  """The mesh axes one dimension's entry names (None, a name, or a tuple)."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


class PartitionMetadata:
  """Reads the layout of each boxed array of a tree on one mesh.

  Args:
    device_mesh: the `jdist.DeviceMesh` whose axes the layouts name.
    logical_axis_rules: pairs `(logical name, mesh axes)`, as in flax.
  """

  def __init__(self, device_mesh: DeviceMesh, logical_axis_rules=()):
    self._mesh = device_mesh
    self._rules = normalize_rules(logical_axis_rules)

  @property
  def logical_axis_rules(self) -> tuple:
    """The logical axis rules the strategy was given (or found)."""
    return self._rules

  def spec(self, path: str, shape: Sequence[int], box: Any, *,
           unruled: list | None = None) -> P | None:
    """The checked `PartitionSpec` that `box` gives the array of `shape` at
    `path`, or None; each `(path, logical name)` no rule maps is appended
    to `unruled`.

    Raises:
      ValueError: the layout does not fit the mesh or the array.
    """
    import flax.linen as nn
    from flax import nnx
    from flax.core import meta
    shape = tuple(shape)
    if isinstance(box, nn.LogicallyPartitioned):
      spec = self._logical(path, box, unruled)
      what = "nn.with_logical_partitioning"
    elif isinstance(box, meta.Partitioned):
      spec, what = P(*box.names), "nn.with_partitioning"
      self._check_axes(path, shape, spec, what, lambda axis: (
          f"Name one of the mesh's axes (or None to replicate that "
          f"dimension); for a logical name use nn.with_logical_partitioning "
          f"and a rule ({axis!r}, <mesh axis>)."))
    elif isinstance(box, nnx.Variable):
      spec, what = self._nnx(path, shape, box), "its out_sharding"
    elif hasattr(box, "get_partition_spec"):
      spec, what = box.get_partition_spec(), type(box).__name__
      self._check_axes(path, shape, spec, what, lambda axis: (
          "Name one of the mesh's axes (or None)."))
    else:
      return None
    if spec is None:
      return None
    if len(spec) > len(shape):
      raise ValueError(
          f"Parameter {path!r} of shape {shape} is partitioned by its flax "
          f"metadata ({what}) as {tuple(spec)}: {len(spec)} entries for "
          f"{len(shape)} dimensions. Give one mesh axis (or None) per "
          "dimension.")
    problem = self._mesh.split_problem(
        path, shape, spec,
        f"or None for that dimension in its flax metadata ({what}).")
    if problem is not None:
      raise ValueError(problem)
    return spec

  def _unknown_axis(self, spec) -> tuple[int, str] | None:
    """`(dimension, axis)` of the first axis of `spec` that the mesh does
    not have, or None."""
    for dim, entry in enumerate(spec):
      for axis in _axes(entry):
        if axis not in self._mesh.axis_names:
          return dim, axis
    return None

  def _check_axes(self, path, shape, spec, what, remedy) -> None:
    unknown = self._unknown_axis(spec)
    if unknown is not None:
      axis = unknown[1]
      raise ValueError(
          f"Parameter {path!r} of shape {shape} is partitioned by its "
          f"flax metadata ({what}) as {tuple(spec)}, but {axis!r} is not "
          f"an axis of the mesh {self._mesh.axis_names}. {remedy(axis)}")

  def _logical(self, path: str, box, unruled: list | None) -> P:
    import flax.linen as nn
    rules = self._rules if box.rules is None else normalize_rules(box.rules)
    names = tuple(box.names)
    ruled = {name for name, _ in rules}
    if unruled is not None:
      unruled.extend((path, n) for n in names
                     if isinstance(n, str) and n not in ruled)
    spec = nn.logical_to_mesh_axes(names, rules)
    unknown = self._unknown_axis(spec)
    if unknown is not None:
      dim, axis = unknown
      name, entry = names[dim], spec[dim]
      raise ValueError(
          f"Parameter {path!r} is partitioned by logical axis names "
          f"{names} (nn.with_logical_partitioning); the logical axis rule "
          f"({name!r}, {entry!r}) maps {name!r} to {axis!r}, which is not "
          f"an axis of the mesh {self._mesh.axis_names}. Map it to one of "
          "those axes (or None).")
    return spec

  def _nnx(self, path: str, shape: tuple, variable) -> P | None:
    from flax.core import spmd as core_spmd
    metadata = variable.get_metadata()
    sharding = metadata.get("out_sharding")
    if not sharding:
      return None
    if isinstance(sharding, NamedSharding):
      sharding = sharding.spec
    local = normalize_rules(metadata.get("sharding_rules"))
    rules = dict(core_spmd.composite_rules(self._rules, local))
    names = tuple(sharding)

    def mapped(entry):
      if isinstance(entry, (tuple, list)):
        return tuple(rules.get(a, a) for a in entry)
      return rules.get(entry, entry) if isinstance(entry, str) else entry

    spec = P(*[mapped(e) for e in names])
    unknown = self._unknown_axis(spec)
    if unknown is not None:
      axis = unknown[1]
      raise ValueError(
          f"Parameter {path!r} of shape {shape} is partitioned by its nnx "
          f"out_sharding {names}, but {axis!r} is neither an axis of the "
          f"mesh {self._mesh.axis_names} nor a logical name that a rule "
          f"maps. Name a mesh axis (or None), or add a rule ({axis!r}, "
          "<mesh axis>) to ModelParallelStrategy(logical_axis_rules=...).")
    return spec


def warn_unruled(unruled: list, stacklevel: int = 3) -> None:
  """One warning for the logical names no rule maps, with their paths."""
  if not unruled:
    return
  paths: dict[str, list[str]] = {}
  for path, name in unruled:
    paths.setdefault(name, []).append(path)
  names = "; ".join(
      f"{name!r} ({', '.join(map(repr, p[:3]))}{', ...' if len(p) > 3 else ''})"
      for name, p in paths.items())
  first = next(iter(paths))
  warnings.warn(
      f"No logical axis rule maps {names} (nn.with_logical_partitioning): "
      "those dimensions are replicated, as flax does. Add a rule such as "
      f"({first!r}, 'model') to ModelParallelStrategy(logical_axis_rules="
      f"...), or ({first!r}, None) to keep it replicated without this "
      "warning.", stacklevel=stacklevel)
