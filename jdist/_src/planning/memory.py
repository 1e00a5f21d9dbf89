"""What each device holds of a step's arguments, from shapes, dtypes and
layouts alone, by kind: parameters (under `params`; without one, every
float leaf that is not optimizer state), optimizer state (under
`opt_state`, or an optax state), other state, and the batch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jdist._src.strategies.partition_metadata import is_box, named_nodes
from jdist._src.strategies.partition_metadata import path_name

PARAMETERS = "parameters"
OPTIMIZER = "optimizer state"
OTHER = "other state"
BATCH = "batch"
KINDS = (PARAMETERS, OPTIMIZER, OTHER, BATCH)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array argument of a step as one device holds it (`spec`: the mesh
  axes splitting each dimension)."""

  path: str
  kind: str
  shape: tuple
  dtype: str
  spec: tuple
  device_shape: tuple
  device_bytes: int

  @property
  def split(self) -> bool:
    """Whether its layout splits it (each device holds a part)."""
    return any(axes is not None for axes in self.spec)


def device_shape(x: Any) -> tuple:
  """The shape of one device's block of `x` (whole without a sharding)."""
  shape = tuple(np.shape(x))
  sharding = getattr(x, "sharding", None)
  return shape if sharding is None else tuple(sharding.shard_shape(shape))


def device_bytes(x: Any) -> int:
  """Bytes of one device's block of `x` (see `device_shape`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jdist._src.planning.memory import device_bytes
    >>> device_bytes(jax.ShapeDtypeStruct((8, 4), jnp.bfloat16))
    64
  """
  return math.prod(device_shape(x)) * np.dtype(x.dtype).itemsize


def _leaf(path: str, kind: str, x: Any) -> Leaf:
  return Leaf(path, kind, tuple(np.shape(x)), str(x.dtype), _spec(x),
              device_shape(x), device_bytes(x))


def _spec(x: Any) -> tuple:
  spec = getattr(getattr(x, "sharding", None), "spec", None)
  entries = list(spec or ()) + [None] * (np.ndim(x) - len(spec or ()))
  return tuple(entries[:np.ndim(x)])


def _is_optax_state(x: Any) -> bool:
  """An optax state: one of optax's `NamedTuple` classes."""
  return isinstance(x, tuple) and hasattr(x, "_fields") and (
      type(x).__module__.split(".")[0] == "optax")


def _named(tree: Any):
  """`(path, leaf, inside an optimizer's state)` for every array leaf."""
  names, nodes, _ = named_nodes(tree, stop=_is_optax_state)
  for name, node in zip(names, nodes):
    if is_box(node):
      for leaf in jax.tree.leaves(node):
        yield name, leaf, False
    elif _is_optax_state(node):
      for path, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
        inner = path_name(path)
        yield f"{name}/{inner}" if name and inner else name or inner, leaf, True
    else:
      yield name, node, False


def state_leaves(state: Any) -> list[Leaf]:
  """Each array leaf of `state`, sorted by kind."""
  named = [(p, x, opt) for p, x, opt in _named(state) if hasattr(x, "dtype")]
  has_params = any("params" in p.split("/") for p, _, _ in named)

  def kind(path: str, x: Any, in_optimizer: bool) -> str:
    parts = path.split("/")
    if in_optimizer or "opt_state" in parts:
      return OPTIMIZER
    if "params" in parts:
      return PARAMETERS
    floating = jax.dtypes.issubdtype(x.dtype, np.inexact)
    return OTHER if has_params or not floating else PARAMETERS

  return [_leaf(p, kind(p, x, opt), x) for p, x, opt in named]


def batch_leaves(batch: Any) -> list[Leaf]:
  """Each array of a distributed batch as the step takes it."""
  return [_leaf(f"batch/{path_name(path)}".rstrip("/"), BATCH, x)
          for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
          if hasattr(x, "dtype")]


def by_kind(leaves: list[Leaf]) -> tuple:
  """`((kind, bytes per device), ...)` in the order of `KINDS`."""
  return tuple((kind, sum(l.device_bytes for l in leaves if l.kind == kind))
               for kind in KINDS)


def format_bytes(n: float) -> str:
  """Bytes in decimal units, as a person reads them.

  Example:
    >>> from jdist._src.planning.memory import format_bytes
    >>> format_bytes(3_100_000_000), format_bytes(2048), format_bytes(12)
    ('3.1 GB', '2.0 KB', '12 B')
  """
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f} {unit}"
  return f"{int(n)} B"
