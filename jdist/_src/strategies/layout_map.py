"""`LayoutMap`: which mesh axes split each parameter, by rules over its path."""

from __future__ import annotations

import collections.abc
import re
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src.strategies.device_mesh import (DeviceMesh, as_device_mesh,
                                               repeated_axis)
from jdist._src.strategies.partition_metadata import named_leaves, path_name


class LayoutMap(collections.abc.MutableMapping):
  """Rules from parameter paths to per-dimension mesh axes.

  As Keras 3's `keras.distribution.LayoutMap`: a key is a regular expression
  matched whole against a parameter's path (`Dense_0/kernel`) or its tail
  after a "/"; the value names one mesh axis (or None) per dimension. A
  path no key matches is replicated (the rules: docs/model_parallelism.md).

  Args:
    device_mesh: the `jdist.DeviceMesh` the axes belong to, or a
      `jax.sharding.Mesh`.

  Example:
    >>> import jax, jax.numpy as jnp, jdist
    >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("data", "model"))
    >>> layout_map = jdist.LayoutMap(mesh)
    >>> layout_map["dense.*/kernel"] = (None, "model")
    >>> layout_map["dense_1/kernel"]
    P(None, 'model')
    >>> layout_map["dense_1/bias"] is None
    True
  """

  def __init__(self, device_mesh: DeviceMesh | Mesh):
    self._mesh = as_device_mesh(device_mesh, "LayoutMap's device_mesh")
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
    """The layout of the parameter at `path` (None: replicated).

    Raises:
      ValueError: no key equals `path` and more than one matches it.
    """
    key = self._key([path], path)
    return None if key is None else self._rules[key]

  def _key(self, candidates: list[str], path: str) -> str | None:
    """The key equal to the first of `candidates` that has one, else the one
    key that matches any, else None."""
    for candidate in candidates:
      if candidate in self._rules:
        return candidate
    matches = [k for k in self._rules
               if any(re.fullmatch(k, c) for c in candidates)]
    if len(matches) > 1:
      tails = (" (a key matches a path or its tail after a '/')"
               if len(candidates) > 1 else "")
      raise ValueError(
          f"Path {path!r} matches more than one LayoutMap key: {matches}"
          f"{tails}. Make the keys exclusive so that each path matches at "
          "most one, or add the path itself as a key: a key equal to the "
          "path wins over regular expressions, as in Keras.")
    return matches[0] if matches else None

  def __delitem__(self, key: str) -> None:
    del self._rules[key]

  def __iter__(self):
    return iter(self._rules)

  def __len__(self) -> int:
    return len(self._rules)

  def layout_of(self, path: str) -> P | None:
    """The layout of the array at `path` in a tree: as `self[path]`, for
    `path` or its tails after a "/" (the longest equal key wins).

    Raises:
      ValueError: no key equals any of them and more than one matches.
    """
    key = self.key_of(path)
    return None if key is None else self._rules[key]

  def key_of(self, path: str) -> str | None:
    """The key that lays out the array at `path` (see `layout_of`), or None.

    Raises:
      ValueError: no key equals `path` or a tail and more than one matches.
    """
    return self._key(_tails(path), path)

  @property
  def output_keys(self) -> tuple:
    """The keys that lay out layers' outputs (Keras's `"<layer>/output"`)."""
    return tuple(k for k in self._rules if k.endswith(_OUTPUT))

  def output_layout(self, path: str) -> P | None:
    """The layout of the output of the layer at `path` (`block/mlp`): its
    key `"<layer path>/output"`, as in Keras.

    Raises:
      ValueError: see `layout_of`.

    Example:
      >>> import jax, jdist
      >>> mesh = jdist.DeviceMesh((1, len(jax.devices())), ("batch", "model"))
      >>> layout_map = jdist.LayoutMap(mesh)
      >>> layout_map["d2/output"] = ("batch", "model")
      >>> layout_map.output_layout("sequential/d2")
      P('batch', 'model')
    """
    return self.layout_of(f"{path}{_OUTPUT}")

  def warn_unmatched_outputs(self, layer_paths: list[str]) -> None:
    """Warns for each output-layout key that none of `layer_paths` match."""
    outputs = [f"{p}{_OUTPUT}" for p in layer_paths]
    for key in self.output_keys:
      if not _matches_any(key, outputs):
        shown = ", ".join(map(repr, layer_paths[:20])) or "none"
        more = " ..." if len(layer_paths) > 20 else ""
        warnings.warn(
            f"LayoutMap key {key!r} is an output-layout key (as in Keras, it "
            "lays out the output of the layer at its path), but it matches "
            f"the output of no layer the step ran; the layers are {shown}"
            f"{more}. Inside its steps jdist applies it to flax modules "
            "(linen, nnx), named by their path in the model (a key matches "
            "a path or its tail after a '/'); Keras's own fit under the "
            "strategy's scope applies it to Keras layers.", stacklevel=3)

  def spec_for(self, path: str, shape: tuple) -> P:
    """The checked `PartitionSpec` of an array of `shape` at `path`.

    Raises:
      ValueError: the layout's rank is not the array's, or an axis's size
        does not divide the dimension it splits.
    """
    problem = self.problem(path, shape)
    if problem is not None:
      raise ValueError(problem)
    return self.layout_of(path) or P()

  def problem(self, path: str, shape: tuple) -> str | None:
    """Why the layout of `path` cannot lay out an array of `shape`, or None."""
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
    """A `PartitionSpec` for every leaf of the parameter tree `tree`; warns
    for each key that matched no leaf (a misspelt path)."""
    entries = named_leaves(tree)
    specs = [self.spec_for(n, np.shape(x)) for n, x, _ in entries]
    self.warn_unmatched([n for n, x, _ in entries if np.ndim(x)])
    return jax.tree_util.tree_unflatten(jax.tree.structure(tree), specs)

  def unmatched(self, names: list[str]) -> list[str]:
    """The parameter keys (not output keys) that match none of `names`."""
    return [key for key in self._rules
            if not key.endswith(_OUTPUT) and not _matches_any(key, names)]

  def warn_unmatched(self, names: list[str]) -> None:
    """Warns for each parameter key that matches none of `names`, the paths
    of a tree's arrays of one dimension or more."""
    if not names:
      return
    for key in self.unmatched(names):
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


_OUTPUT = "/output"  # the end of Keras's output-layout keys


def _tails(path: str) -> list[str]:
  """`path` and its tails after each "/", the longest first."""
  parts = path.split("/")
  return ["/".join(parts[i:]) for i in range(len(parts))]


def _matches_any(key: str, paths: list[str]) -> bool:
  """Whether `key` is, or fully matches, one of `paths` or their tails."""
  tails = {t for p in paths for t in _tails(p)}
  return key in tails or any(re.fullmatch(key, t) for t in tails)
