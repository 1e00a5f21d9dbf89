"""Which blocks of a state each process writes, and in what order.

A part holds a process's distinct blocks of every leaf, leaves on devices
first; the replica, the blocks of the previous process's part this one lacks.
Every process works every process's blocks out alike from the shardings, once
per state layout (`plan`).
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import NamedSharding

from jdist._src.checkpoint import packing


def _bounds(index, shape) -> list:
  return [list(s.indices(d)[:2]) for s, d in zip(index, shape)]


def _blocks(leaf, process: int) -> list:
  """`[(bounds, device)]` of process `process`'s distinct blocks of `leaf`, in
  the order of the sharding's devices (`device` None for a replicated leaf)."""
  shape = np.shape(leaf)
  if not isinstance(leaf, jax.Array) or leaf.sharding.is_fully_replicated:
    return [([[0, d] for d in shape], None)]  # the common case, and a fast one
  blocks, seen = [], []
  for device, index in leaf.sharding.devices_indices_map(shape).items():
    if device.process_index == process:
      b = _bounds(index, shape)
      if b not in seen:
        seen.append(b)
        blocks.append((b, device))
  return blocks


def _picker(leaf, blocks: list, target) -> tuple:
  """`(pick, devices)`: a function that takes this process's `blocks` out of a
  leaf like `leaf`, and the device of each (preferring `target`)."""
  if not blocks:
    return (lambda x: []), []
  if not isinstance(leaf, jax.Array):
    return (lambda x: [np.asarray(x)]), [None]
  shards = leaf.addressable_shards
  if leaf.sharding.is_fully_replicated:
    at = next((i for i, s in enumerate(shards) if s.device == target), 0)
    if at == 0:
      return (lambda x: [x.addressable_data(0)]), [shards[0].device]
    return (lambda x: [x.addressable_shards[at].data]), [shards[at].device]
  at = {shard.device: i for i, shard in enumerate(shards)}
  order = [at[device] for _, device in blocks]
  return (lambda x: [x.addressable_data(i) for i in order]), [
      device for _, device in blocks]


class Layout:
  """A state's blocks on process `process` in the order of its file (with
  `but`: those process `but` lacks); `entries` describe them for the header,
  and on this process `picks`, `keys`, `devices` and `host` say how to take
  them."""

  def __init__(self, names: list, leaves: list, process: int,
               but: int | None = None, target=None):
    self.picks, self.sizes, self.names, entries = [], [], [], []
    self.header = b""  # (`plan` sets it)
    self.keys, self.devices, self.host = [], [], []
    mine = process == jax.process_index()
    order = sorted(range(len(leaves)),
                   key=lambda i: not isinstance(leaves[i], jax.Array))
    self.on_device = sum(isinstance(x, jax.Array) for x in leaves)
    for i in order:
      name, leaf = names[i], leaves[i]
      blocks = _blocks(leaf, process)
      if but is not None:
        held = [b for b, _ in _blocks(leaf, but)]
        blocks = [(b, d) for b, d in blocks if b not in held]
      dtype = np.dtype(leaf.dtype)
      inexact = bool(np.issubdtype(dtype, np.inexact))
      if mine and blocks:
        pick, devices = _picker(leaf, blocks, target)
        if isinstance(leaf, jax.Array):
          self.picks.append((i, pick))
          self.keys += [(i, str(b)) for b, _ in blocks]
          self.devices += devices
        else:
          self.host.append(i)
      nbytes = [dtype.itemsize * int(np.prod([hi - lo for lo, hi in b]))
                for b, _ in blocks]
      self.sizes.append((dtype, inexact, nbytes))
      self.names.append(name)
      entries.append({"name": name, "shape": list(np.shape(leaf)),
                      "dtype": str(dtype), "shards": [
                          {"bounds": b, "nbytes": n}
                          for (b, _), n in zip(blocks, nbytes)]})
    self.entries = json.dumps(entries)
    self.nbytes = sum(n for _, _, ns in self.sizes for n in ns)
    self._runs = _runs(self.sizes[:self.on_device])  # (to check for NaN)

  def nonfinite(self, data) -> int | None:
    """The file-order index of the first leaf on devices with NaN or infinite
    values in `data`, or None (one sum per run of blocks of one type; leaf by
    leaf only when one is not finite)."""
    if all(finite(data, *run) for run in self._runs):
      return None
    offset = 0
    for i, (dtype, inexact, nbytes) in enumerate(self.sizes[:self.on_device]):
      for n in nbytes:
        if inexact and not finite(data, dtype, offset, n):
          return i
        offset += n
    return None


def one_program_mesh(leaves: list, mine: "Layout", copies: list):
  """The mesh over which `packing.packer_across` can pack and send every
  process's blocks (one device per process, one block of each leaf each, the
  same positions and bytes sent), or None."""
  arrays = [leaves[i] for i, _ in mine.picks]
  if (not arrays or len(mine.keys) != len(arrays)
      or len(arrays) != sum(isinstance(x, jax.Array) for x in leaves)
      or not all(isinstance(x.sharding, NamedSharding) for x in arrays)):
    return None
  mesh = arrays[0].sharding.mesh
  processes = [d.process_index for d in mesh.devices.flat]
  if (any(x.sharding.mesh != mesh for x in arrays)
      or sorted(processes) != list(range(jax.process_count()))):
    return None
  positions = {tuple(j for j, (_, _, n) in enumerate(c.sizes) if n)
               for c in copies}
  if len(positions) != 1 or len({c.nbytes for c in copies}) != 1:
    return None
  return mesh


def _runs(sizes: list) -> list:
  """`[(dtype, offset, nbytes)]`: runs of inexact blocks of one type."""
  runs, offset = [], 0
  for dtype, inexact, nbytes in sizes:
    for n in nbytes:
      if inexact and n:
        if runs and runs[-1][0] == dtype and sum(runs[-1][1:]) == offset:
          runs[-1][2] += n
        else:
          runs.append([dtype, offset, n])
      offset += n
  return runs


def finite(data, dtype: np.dtype, offset: int, nbytes: int) -> bool:
  values = np.frombuffer(data, dtype, count=nbytes // dtype.itemsize,
                         offset=offset)
  wide = np.complex128 if np.issubdtype(dtype, np.complexfloating) else \
      np.float64
  return bool(np.isfinite(values.sum(dtype=wide)))


def plan(names: list, leaves: list, rank: int, world: int, peer) -> tuple:
  """`(mine, before, plan)` for process `rank`: the layouts of its part and of
  its replica (None without `peer`), and `(program, target, moves, length,
  across)` to pack them; `mine.header` is the file's header."""
  mine, before, program = _plan(names, leaves, rank, world, peer)
  replica = "" if before is None else (
      f', "replica": {{"rank": {(rank - 1) % world}, '
      f'"leaves": {before.entries}}}')
  mine.header = (f'"world": {world}, "leaves": {mine.entries}'
                 f'{replica}}}').encode()
  return mine, before, program


def _plan(names: list, leaves: list, rank: int, world: int, peer) -> tuple:
  target = None if peer is None else peer.device
  mine = Layout(names, leaves, rank, target=target)
  target = target or next(iter(mine.devices), None)
  moves = [j for j, d in enumerate(mine.devices) if d != target]
  before, sent, length = None, None, 0
  if peer is not None:
    copies = [Layout(names, leaves, p, but=(p + 1) % world)
              for p in range(world)]
    before = copies[rank - 1]
    length = max(c.nbytes for c in copies)
    if length:
      at = {k: j for j, k in enumerate(mine.keys)}
      mine_sent = Layout(names, leaves, rank, but=(rank + 1) % world,
                         target=target)
      sent = [at[k] for k in mine_sent.keys]
      mesh = one_program_mesh(leaves, mine, copies)
      if mesh is not None:
        specs = [leaves[i].sharding.spec for i, _ in mine.picks]
        return mine, before, (packing.packer_across(mesh, specs, sent, length),
                              target, [], length, True)
  return mine, before, (packing.packer(sent, length), target, moves, length,
                        False)
