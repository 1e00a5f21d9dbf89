"""ModelParallelStrategy: replicas that span devices, laid out by a LayoutMap
or by flax's partition metadata."""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src.core import kinds, placement
from jdist._src.strategies.device_mesh import DeviceMesh, as_device_mesh
from jdist._src.strategies.layout_map import LayoutMap
from jdist._src.strategies.partition_metadata import (
    PartitionMetadata, is_box, named_leaves, named_nodes, warn_unruled)
from jdist._src.strategies.pipeline_schedule import PipelineSchedule
from jdist._src.strategies.spmd import Strategy


def _uses(spec: P, axis: str) -> bool:
  return any(axis == a or (isinstance(a, tuple) and axis in a) for a in spec)


def fsdp_spec(spec: P, shape: tuple, axis: str, size: int) -> P:
  """`spec` with its largest free dimension that `size` divides split over
  `axis`; unchanged when it uses `axis` already or no dimension fits."""
  if _uses(spec, axis):
    return spec
  dims = list(spec) + [None] * (len(shape) - len(spec))
  free = [d for d in range(len(shape))
          if dims[d] is None and shape[d] % size == 0]
  if not free:
    return spec
  dims[max(free, key=lambda d: (shape[d], -d))] = axis
  return P(*dims)


class ModelParallelStrategy(Strategy):
  """Data parallelism over one mesh axis, the parameters split over the others.

  As Keras 3's `keras.distribution.ModelParallel`. An array's layout is its
  `layout_map` key's, else its flax partition metadata's, else replicated
  (docs/model_parallelism.md; pipelines: docs/pipelines.md).

  Args:
    layout_map: a `jdist.LayoutMap` (None: flax's metadata alone).
    device_mesh: a `jdist.DeviceMesh` or `jax.sharding.Mesh`, if no
      `layout_map` (else the same as its mesh).
    batch_dim_name: the mesh axis of the replicas (default: the first).
    fsdp_axis: a mesh axis that splits every parameter (ZeRO-3), or None.
    logical_axis_rules: `(logical name, mesh axes)` pairs, as in flax
      (default: flax's rules in context when the strategy is made).
    pipeline_axis: the mesh axis of `jdist.pipeline`'s stages, or None.
    num_microbatches: microbatches per replica batch (default: the stages).
    num_repeats: virtual stages per stage: 1 is GPipe, more is circular.
    pipeline_remat: rematerialize each stage's layers in the backward pass.

  Raises:
    ValueError: no mesh or two, an unknown axis, or bad pipeline settings.

  Example:
    >>> import jax, jax.numpy as jnp, jdist
    >>> n = len(jax.devices())
    >>> mesh = jdist.DeviceMesh((n, 1), ("data", "model"))
    >>> layout_map = jdist.LayoutMap(mesh)
    >>> layout_map["w"] = (None, "model")
    >>> strategy = jdist.ModelParallelStrategy(layout_map=layout_map,
    ...                                        batch_dim_name="data")
    >>> params = strategy.init(lambda: {"w": jnp.ones((2, 4))})
    >>> params["w"].sharding.spec
    P(None, 'model')
  """

  keras_distribution = "model_parallel"  # ModelParallel, with its LayoutMap

  def __init__(self, *, layout_map: LayoutMap | None = None,
               device_mesh: DeviceMesh | Mesh | None = None,
               batch_dim_name: str | None = None,
               fsdp_axis: str | None = None,
               logical_axis_rules=None,
               pipeline_axis: str | None = None,
               num_microbatches: int | None = None,
               num_repeats: int = 1,
               pipeline_remat: bool = False):
    if layout_map is not None and not isinstance(layout_map, LayoutMap):
      raise TypeError(
          "ModelParallelStrategy's layout_map must be a jdist.LayoutMap(mesh)"
          f", got {type(layout_map).__name__}.")
    if device_mesh is not None:
      device_mesh = as_device_mesh(device_mesh,
                                   "ModelParallelStrategy's device_mesh")
    if layout_map is None and device_mesh is None:
      raise ValueError(
          "ModelParallelStrategy needs a mesh: device_mesh=jdist.DeviceMesh("
          "...) to lay the parameters out from flax's partition metadata "
          "(nn.with_partitioning, nn.with_logical_partitioning, nnx "
          "out_sharding), or layout_map=jdist.LayoutMap(mesh) for rules over "
          "parameter paths.")
    if layout_map is not None:
      if device_mesh is not None and device_mesh != layout_map.device_mesh:
        raise ValueError(
            f"device_mesh {device_mesh!r} is not the layout map's mesh "
            f"{layout_map.device_mesh!r}: give one mesh (the layout map's "
            "alone is enough).")
      device_mesh = layout_map.device_mesh
    batch_dim_name = batch_dim_name or device_mesh.axis_names[0]
    device_mesh.check_axis(batch_dim_name, "batch_dim_name")
    if fsdp_axis is not None:
      device_mesh.check_axis(fsdp_axis, "fsdp_axis")
      if fsdp_axis == batch_dim_name:
        raise ValueError(
            f"fsdp_axis and batch_dim_name are both {fsdp_axis!r}: FSDP splits "
            "each replica over another mesh axis. Give the mesh a second "
            "axis, for example DeviceMesh((2, 2), ('data', 'fsdp')).")
    if logical_axis_rules is None:  # flax's open context (none if no flax)
      logical_axis_rules = (sys.modules["flax.linen"].get_logical_axis_rules()
                            if "flax.linen" in sys.modules else ())
    self._pipeline = _schedule(device_mesh, pipeline_axis,
                               (batch_dim_name, fsdp_axis), num_microbatches,
                               num_repeats, pipeline_remat)
    self._fsdp_axis = fsdp_axis
    self._device_mesh = device_mesh
    self._layout_map = layout_map
    self._metadata = PartitionMetadata(device_mesh, logical_axis_rules)
    self._warned_unsplit = False
    mesh = device_mesh.jax_mesh
    first_devices = placement.replica_groups(mesh, batch_dim_name)[:, 0]
    super().__init__(tuple(first_devices), axis_name=batch_dim_name,
                     mesh=mesh)

  @property
  def layout_map(self) -> LayoutMap | None:
    """The rules that lay the parameters out by path, or None."""
    return self._layout_map

  @property
  def device_mesh(self) -> DeviceMesh:
    """The `jdist.DeviceMesh` (Keras's name for the mesh)."""
    return self._device_mesh

  @property
  def logical_axis_rules(self) -> tuple:
    """The rules that map logical axis names in flax metadata to mesh axes."""
    return self._metadata.logical_axis_rules

  @property
  def fsdp_axis(self) -> str | None:
    """The mesh axis that splits the parameters and each replica's batch."""
    return self._fsdp_axis

  @property
  def replica_batch_axis(self) -> str | None:
    return self._fsdp_axis

  @property
  def pipeline(self) -> PipelineSchedule | None:
    """The pipeline's schedule, or None without a `pipeline_axis`."""
    return self._pipeline

  @property
  def identity(self) -> tuple:
    return super().identity + (self.device_mesh, self._fsdp_axis,
                               self._pipeline)

  def __repr__(self) -> str:
    fsdp = f", fsdp_axis={self._fsdp_axis!r}" if self._fsdp_axis else ""
    pipe = self._pipeline
    if pipe is not None:
      fsdp += (f", pipeline_axis={pipe.axis!r}, num_microbatches="
               f"{pipe.num_microbatches}, num_repeats={pipe.num_repeats}")
    return (f"ModelParallelStrategy({self.device_mesh!r}, "
            f"batch_dim_name={self.axis_name!r}{fsdp})")

  def _spec(self, path: str, shape: tuple, box: Any, *,
            unruled: list | None = None) -> P:
    """The layout of one array, with `fsdp_axis`."""
    layout_map = self._layout_map
    if layout_map is not None and layout_map.layout_of(path) is not None:
      spec = layout_map.spec_for(path, shape)
    elif box is not None:
      spec = self._metadata.spec(path, shape, box, unruled=unruled) or P()
    else:
      spec = P()
    return self._with_fsdp(spec, shape)

  def partition_specs(self, tree: Any) -> Any:
    """The `PartitionSpec` of every leaf of `tree`, with `fsdp_axis`.

    Raises:
      ValueError: a layout does not fit the mesh or its array.
    """
    names, nodes, _ = named_nodes(tree, stop=kinds.has_layouts)
    unruled, specs, paths = [], [], []
    for name, node in zip(names, nodes):
      kind = kinds.kind_of(node)
      own = kind.layouts(node)
      if own is not None:
        specs.extend(own)
        paths.extend(f"{name}/{inner}" if name else inner
                     for inner, _, _ in named_leaves(kind.payload(node)))
        continue
      box = node if is_box(node) else None
      leaves = jax.tree.leaves(node) if box is not None else [node]
      for leaf in leaves:
        specs.append(self._spec(name, np.shape(leaf), box, unruled=unruled))
      if any(np.ndim(leaf) for leaf in leaves):
        paths.append(name)
    warn_unruled(unruled)
    if self._layout_map is not None:
      self._layout_map.warn_unmatched(paths)
    return jax.tree_util.tree_unflatten(jax.tree.structure(tree), specs)

  def replica_layouts(self, tree: Any) -> list:
    """The layout of each leaf of `tree` within a replica, in flattening
    order, as `partition_specs` gives it (without its warnings)."""
    return [self._spec(name, np.shape(leaf), box)
            for name, leaf, box in named_leaves(tree)]

  def replicate(self, tree: Any) -> Any:
    """Places `tree` as `init` lays state out, each array in its layout;
    distributed values as `Strategy.replicate` places them.

    Raises:
      ValueError: see `partition_specs`.
    """
    names, nodes, treedef = named_nodes(tree, stop=kinds.is_node)
    unruled, laid_out, placed = [], [], []
    for name, node in zip(names, nodes):
      if kinds.is_node(node):  # a distributed value: placed as it is kept
        placed.append(super().replicate(node))
        continue
      box = node if is_box(node) else None
      leaves, leaf_tree = jax.tree.flatten(node) if box is not None else (
          [node], None)
      specs = [self._spec(name, np.shape(x), box, unruled=unruled)
               for x in leaves]
      laid_out += [(name, x, spec) for x, spec in zip(leaves, specs)]
      laid = [placement.put_laid_out(x, NamedSharding(self.mesh, spec))
              for x, spec in zip(leaves, specs)]
      placed.append(laid[0] if box is None else
                    jax.tree.unflatten(leaf_tree, laid))
    warn_unruled(unruled)
    if self._layout_map is not None:
      self._layout_map.warn_unmatched([n for n, x, _ in laid_out
                                       if np.ndim(x)])
    self._warn_if_nothing_split(laid_out)
    return jax.tree_util.tree_unflatten(treedef, placed)

  def _warn_if_nothing_split(self, laid_out: list) -> None:
    """Warns (once) when state with a matrix has no array split over the
    mesh; `laid_out` holds `(path, array or shape, spec)` of each array."""
    if self._warned_unsplit or not laid_out or any(
        any(axes is not None for axes in spec) for _, _, spec in laid_out):
      return
    if max(np.ndim(x) for _, x, _ in laid_out) < 2:
      return  # no matrix: counters, statistics, small state
    self._warned_unsplit = True
    size = lambda x: int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
    largest = sorted(laid_out, key=lambda e: -size(e[1]))[:3]
    named = ", ".join(f"{n or 'the array'} ({_mib(size(x))})"
                      for n, x, _ in largest)
    total = _mib(sum(size(x) for _, x, _ in laid_out))
    warnings.warn(
        f"{self!r} splits no array of this state over its mesh: every "
        f"device holds all {total} of it, the largest {named}. Give the "
        "parameters layouts: LayoutMap keys over their paths "
        "(layout_map['Dense_0/kernel'] = (None, 'model')), or flax's "
        "partition metadata kept in the state (nn.with_partitioning, nnx's "
        "with_partitioning: parameters unboxed before they reach the "
        "strategy, as Trainer(params=nn.meta.unbox(...)), have lost it). For "
        "data parallelism alone use MirroredStrategy.", UserWarning,
        stacklevel=3)

  def shardings(self, tree: Any) -> Any:
    """The `NamedSharding` of every leaf of `tree` (see `partition_specs`)."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s),
                        self.partition_specs(tree),
                        is_leaf=lambda x: isinstance(x, P))

  def _with_fsdp(self, spec: P, shape: tuple) -> P:
    if self._fsdp_axis is None:
      return spec
    size = self.device_mesh.axis_size(self._fsdp_axis)
    return fsdp_spec(spec, shape, self._fsdp_axis, size)

  def keep_layouts(self, outputs: Any) -> Any:
    """Inside a traced step: its outputs held in the layouts `init` gives,
    so the next call does not compile again; an array its layout cannot lay
    out is left as XLA places it."""
    names, nodes, treedef = named_nodes(outputs, stop=kinds.is_node)

    def constrain(name, box, x):
      if not isinstance(x, jax.Array):
        return x
      try:
        spec = self._spec(name, np.shape(x), box)
      except ValueError:
        return x
      return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    kept = []
    for name, node in zip(names, nodes):
      own = kinds.kind_of(node).layouts(node)
      if own is not None:  # its own layout: replicas and within
        leaves, leaf_tree = jax.tree.flatten(node)
        kept.append(jax.tree.unflatten(leaf_tree, [
            jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
            for x, spec in zip(leaves, own)]))
      elif kinds.is_node(node):
        kept.append(node)
      elif is_box(node):
        kept.append(jax.tree.map(lambda x, n=name, b=node: constrain(n, b, x),
                                 node))
      else:
        kept.append(constrain(name, None, node))
    return jax.tree_util.tree_unflatten(treedef, kept)

  def init(self, fn: Callable, *args, **kwargs) -> Any:
    """Runs `fn(*args, **kwargs)` compiled so that its result (parameters,
    optimizer state) is created laid out, under the mesh and axis rules.

    Raises:
      ValueError: see `partition_specs` (before anything runs).
    """
    # The layouts are read (and checked) before flax's eager sharding, or
    # linen's constraint on a boxed parameter, could fail on a bad axis with
    # a message that names no parameter.
    with self.mesh_scope(strict=False), _no_eager_sharding():
      shapes = jax.eval_shape(fn, *args, **kwargs)
    shardings = jax.tree.leaves(self.shardings(shapes))
    self._warn_if_nothing_split([
        (name, x, s.spec) for (name, x, _), s in zip(named_leaves(shapes),
                                                     shardings)])
    # Flat: nnx records the eager-sharding flag in each variable's metadata,
    # so the result's tree is not the one above.
    treedefs = []

    def flat(*args, **kwargs):
      leaves, treedef = jax.tree.flatten(fn(*args, **kwargs))
      treedefs.append(treedef)
      return leaves

    with self.mesh_scope():  # the mesh and rules of flax's eager sharding
      leaves = jax.jit(flat, out_shardings=shardings)(*args, **kwargs)
    return jax.tree.unflatten(treedefs[-1], leaves)


def _mib(size: int) -> str:
  return f"{size / 2**20:.3g} MiB" if size >= 2**16 else f"{size} bytes"


def _schedule(mesh: DeviceMesh, axis: str | None, taken: tuple,
              num_microbatches: int | None, num_repeats: int,
              remat: bool) -> PipelineSchedule | None:
  """The strategy's `PipelineSchedule`, or None without a pipeline axis."""
  if axis is None:
    if num_microbatches is not None or num_repeats != 1 or remat:
      raise ValueError(
          "num_microbatches, num_repeats and pipeline_remat configure a "
          "pipeline; give the mesh axis of its stages too, for example "
          "pipeline_axis='stage' on DeviceMesh((2, 2), ('data', 'stage')).")
    return None
  mesh.check_axis(axis, "pipeline_axis")
  if axis in taken:
    raise ValueError(
        f"pipeline_axis {axis!r} is also the batch or FSDP axis; the stages "
        "need a mesh axis of their own, for example DeviceMesh((2, 2, 2), "
        "('data', 'stage', 'model')).")
  stages = mesh.axis_size(axis)
  return PipelineSchedule(axis, stages, num_microbatches or stages,
                          num_repeats, bool(remat))


def _no_eager_sharding():
  """flax nnx's eager sharding turned off (if flax.nnx is imported)."""
  if "flax.nnx" not in sys.modules:
    return contextlib.nullcontext()
  return sys.modules["flax.nnx"].use_eager_sharding(False)
