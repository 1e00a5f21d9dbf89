"""What a compiled step's HLO text says: its collectives' sizes and mesh axes,
its callbacks.

A collective's groups are partition ids (row-major mesh positions), listed
(`{{0,2},{1,3}}`), as an iota (`[2,2]<=[2,2]T(1,0)`) or over an XLA mesh
(`mesh['axis_0'=2,'axis_1'=2] {'axis_0'}`, optionally with `device_ids=`).
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+?(\d+)[a-z0-9]*)\[([\d,]*)\]")
_CALLBACK = re.compile(r'custom_call_target="[^"]*callback[^"]*"')
_LISTED = re.compile(
    r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_XLA_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _bytes(result_shape: str) -> int:
  """Bytes of an HLO result shape (an array or a tuple of arrays)."""
  total = 0
  for _, bits, dims in _ARRAY.findall(result_shape):
    elements = math.prod(int(d) for d in dims.split(",") if d)
    total += math.ceil(int(bits or 8) * elements / 8)
  return total


def host_callbacks(hlo: str) -> int:
  """How many calls back to Python a compiled program makes."""
  return len(_CALLBACK.findall(hlo))


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a compiled program: `kind`, result `bytes` per device,
  `groups` of partition ids (None: unknown form) and its JAX `op_name`."""

  kind: str
  bytes: int
  groups: tuple[tuple[int, ...], ...] | None = None
  op_name: str = ""


def collectives(hlo: str) -> list[Collective]:
  """Each collective of a compiled program, in program order.

  Example:
    >>> from jdist._src.diagnose.hlo import collectives
    >>> [c] = collectives('%ag = f32[8,4]{1,0} all-gather(%w), '
    ...                   'replica_groups=[2,2]<=[4], dimensions={0}, '
    ...                   'metadata={op_name="jit(f)/jvp(dense)/dot_general"}')
    >>> c.kind, c.bytes, c.groups, c.op_name
    ('all-gather', 128, ((0, 1), (2, 3)), 'jit(f)/jvp(dense)/dot_general')
  """
  found = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      name = _OP_NAME.search(line)
      found.append(Collective(m.group(2), _bytes(m.group(1)), _groups(line),
                              name.group(1) if name else ""))
  return found


def _ints(text: str) -> list[int]:
  return [int(t) for t in text.split(",") if t]


def _groups(line: str) -> tuple[tuple[int, ...], ...] | None:
  """The partition ids of a collective's groups, from its HLO line."""
  m = _IOTA.search(line)
  if m:
    shape, dims = _ints(m.group(1)), _ints(m.group(2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose(_ints(m.group(3)))
    return tuple(map(tuple, ids.reshape(shape).tolist()))
  m = _XLA_MESH.search(line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names = [name for name, _ in axes]
    over = re.findall(r"'([^']+)'", m.group(4))
    if not set(over) <= set(names):
      return None
    ids = np.arange(math.prod(int(n) for _, n in axes))
    if m.group(2):  # the ids as an iota, laid out over the mesh
      ids = ids.reshape(_ints(m.group(2)))
      if m.group(3):
        ids = ids.transpose(_ints(m.group(3)))
    ids = ids.reshape([int(n) for _, n in axes])
    kept = [i for i, name in enumerate(names) if name not in over]
    moved = [names.index(name) for name in over]
    ids = ids.transpose(kept + moved)
    group = math.prod(int(axes[i][1]) for i in moved)
    return tuple(map(tuple, ids.reshape(-1, group).tolist()))
  m = _LISTED.search(line)
  if m:
    return tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}",
                                                     m.group(1)))
  return None


def mesh_axes(groups, axis_names, mesh_shape) -> tuple[str, ...] | None:
  """The mesh axes along which a collective's groups vary (None: unknown).

  Example:
    >>> from jdist._src.diagnose.hlo import mesh_axes
    >>> mesh_axes(((0, 2), (1, 3)), ("data", "model"), (2, 2))
    ('data',)
  """
  if not groups:
    return None
  size = math.prod(mesh_shape)
  varying = set()
  for group in groups:
    if any(i >= size for i in group):
      return None
    coords = np.array(np.unravel_index(list(group), mesh_shape))
    varying |= {a for a in range(len(mesh_shape))
                if len(set(coords[a].tolist())) > 1}
  return tuple(axis_names[a] for a in sorted(varying))


def by_mesh_axes(hlo: str, axis_names, mesh_shape) -> dict:
  """`{axes: (count, bytes)}` of a program's collectives, by the mesh axes
  they run over (`()`: groups of one device; None: groups not known).

  Example:
    >>> from jdist._src.diagnose.hlo import by_mesh_axes
    >>> by_mesh_axes("%a = f32[4]{0} all-reduce(%x), replica_groups={{0,2},{1,3}}"
    ...              , ("data", "model"), (2, 2))
    {('data',): (1, 16)}
  """
  out: dict = {}
  for c in collectives(hlo):
    axes = mesh_axes(c.groups, tuple(axis_names), tuple(mesh_shape))
    count, size = out.get(axes, (0, 0))
    out[axes] = (count + 1, size + c.bytes)
  return out
