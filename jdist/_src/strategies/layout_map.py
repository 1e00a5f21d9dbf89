"""`LayoutMap`: which mesh axes split each parameter, by rules over its path.

As Keras 3's `keras.distribution.LayoutMap`: each key is a regular
expression matched whole (`re.fullmatch`) against a parameter's path, its
keys in the parameter tree joined by "/" (flax: `Dense_0/kernel`); the value
names one mesh axis (or None) per dimension of the parameter. A parameter no
key matches is replicated; one that two keys match is an error.

Laying out a tree (`partition_specs`), a key also matches a path's tail
after any "/": the parameter's rule then lays out its copies deeper in a
state tree (`params/Dense_0/kernel` in a train state, the momentum's
`0/trace/Dense_0/kernel`) with no key naming their prefixes.
"""

from __future__ import annotations

import collections.abc
import re
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src.strategies.device_mesh import DeviceMesh, repeated_axis
from jdist._src.strategies.partition_metadata import named_leaves, path_name


class LayoutMap(collections.abc.MutableMapping):
  """Rules from parameter paths to per-dimension mesh axes.

  Args:
    device_mesh: the `jdist.DeviceMesh` the axes belong to.

  Example:
    >>> import jax, jax.numpy as jnp, jdist
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "model"))
    >>> layout_map = jdist.LayoutMap(mesh)
    >>> layout_map["dense.*/kernel"] = (None, "model")
    >>> layout_map["dense_1/kernel"]
    P(None, 'model')
    >>> layout_map["dense_1/bias"] is None
    True
    >>> params = {"dense_1": {"kernel": jnp.zeros((3, 8)), "bias": jnp.zeros(8)}}
    >>> layout_map.partition_specs(params)["dense_1"]["bias"]
    P()
  """

  def __init__(self, device_mesh: DeviceMesh):
    if not isinstance(device_mesh, DeviceMesh):
      raise TypeError(
          f"LayoutMap needs a jdist.DeviceMesh, got {type(device_mesh).__name__}.")
    self._mesh = device_mesh
    self._rules: dict[str, P] = {}

  @property
  def device_mesh(self) -> DeviceMesh:
    """The mesh whose axes the layouts name."""
    return self._mesh

  def __setitem__(self, key: str, layout) -> None:
    re.compile(key)  # a bad pattern fails here, not at the first lookup
    if key in self._rules:
      raise ValueError(
          f"LayoutMap already has the key {key!r} (layout "
          f"{tuple(self._rules[key])}); delete it first to change it.")
    if isinstance(layout, str) or layout is None:
      raise TypeError(
          f"LayoutMap[{key!r}] must be a tuple with one mesh axis name (or "
          f"None) per dimension, got {layout!r}; for a vector split over "
          "'model' write ('model',).")
    for axes in layout:
      for axis in axes if isinstance(axes, tuple) else (axes,):
        if axis is not None:
          self._mesh.check_axis(axis, f"LayoutMap[{key!r}] = {tuple(layout)}")
    if (repeated := repeated_axis(layout)) is not None:
      raise ValueError(
          f"LayoutMap[{key!r}] = {tuple(layout)} names mesh axis "
          f"{repeated[0]!r} for dimensions {repeated[1]} and {repeated[2]} of "
          "the parameters it matches, but an axis can split one dimension "
          "only. Give the other dimension another axis, or None.")
    self._rules[key] = P(*layout)

  def __getitem__(self, path: str) -> P | None:
    """The layout of the parameter at `path`: its key's, or None (replicated).

    Raises:
      ValueError: more than one key matches `path`.
    """
    if path in self._rules:
      return self._rules[path]
    matches = [k for k in self._rules if re.fullmatch(k, path)]
    if len(matches) > 1:
      raise ValueError(
          f"Parameter path {path!r} matches more than one LayoutMap key: "
          f"{matches}. Make the keys exclusive so that each path matches at "
          "most one.")
    return self._rules[matches[0]] if matches else None

  def __delitem__(self, key: str) -> None:
    del self._rules[key]

  def __iter__(self):
    return iter(self._rules)

  def __len__(self) -> int:
    return len(self._rules)

  def layout_of(self, path: str) -> P | None:
    """The layout of the array at `path` in a tree: the key that matches
    `path` or one of its tails after a "/", or None (replicated).

    Raises:
      ValueError: more than one key matches.
    """
    parts = path.split("/")
    tails = ["/".join(parts[i:]) for i in range(len(parts))]
    matches = [k for k in self._rules
               if any(re.fullmatch(k, tail) for tail in tails)]
    if len(matches) > 1:
      raise ValueError(
          f"Path {path!r} matches more than one LayoutMap key: {matches} (a "
          "key matches a path or its tail after a '/'). Make the keys "
          "exclusive so that each path matches at most one.")
    return self._rules[matches[0]] if matches else None

  def spec_for(self, path: str, shape: tuple) -> P:
    """The checked `PartitionSpec` of an array of `shape` at `path` (see
    `layout_of`).

    Raises:
      ValueError: the layout's rank is not the array's, or an axis's size
        does not divide the dimension it splits.
    """
    problem = self.problem(path, shape)
    if problem is not None:
      raise ValueError(problem)
    return self.layout_of(path) or P()

  def problem(self, path: str, shape: tuple) -> str | None:
    """Why the layout of `path` cannot lay out an array of `shape` (its rank
    differs, or an axis does not divide the dimension it splits), or None.
    """
    spec = self.layout_of(path)
    if spec is None:
      return None
    if len(spec) != len(shape):
      return (
          f"LayoutMap gives parameter {path!r} of shape {tuple(shape)} the "
          f"layout {tuple(spec)} of {len(spec)} dimensions; give one axis (or "
          f"None) for each of its {len(shape)} dimensions.")
    return self._mesh.split_problem(
        path, shape, spec, "or None for that dimension in its LayoutMap key.")

  def partition_specs(self, tree: Any) -> Any:
    """A `PartitionSpec` for every leaf of the parameter tree `tree`.

    A leaf inside a flax metadata box (`nn.Partitioned`, an `nnx.Variable`)
    is named by the box's path (`Dense_0/kernel`, not `Dense_0/kernel/value`).
    Warns for each key that matched no leaf (a misspelt path would otherwise
    leave its parameters replicated, silently).
    """
    entries = named_leaves(tree)
    specs = [self.spec_for(n, np.shape(x)) for n, x, _ in entries]
    self.warn_unmatched([n for n, _, _ in entries])
    return jax.tree_util.tree_unflatten(jax.tree.structure(tree), specs)

  def warn_unmatched(self, names: list[str]) -> None:
    """Warns for each key that matches none of the paths `names`."""
    tails = {"/".join(n.split("/")[i:]) for n in names
             for i in range(n.count("/") + 1)}
    for key in self._rules:
      if not any(re.fullmatch(key, t) for t in tails):
        warnings.warn(
            f"LayoutMap key {key!r} matches no parameter; the paths are "
            f"{names[:20]}{' ...' if len(names) > 20 else ''}. Keys match a "
            "whole path or a tail after a '/' (re.fullmatch).",
            stacklevel=3)

  def shardings(self, tree: Any) -> Any:
    """A `NamedSharding` on the mesh for every leaf of `tree`."""
    mesh = self._mesh.jax_mesh
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        self.partition_specs(tree),
                        is_leaf=lambda x: isinstance(x, P))

  def __repr__(self) -> str:
    return f"LayoutMap({self._mesh!r}, {dict(self._rules)!r})"
