"""Which blocks of a state each process writes, and in what order.

A process's part of a snapshot holds its distinct blocks of every leaf (its
addressable shards, one copy of each: a leaf whole on every device is one
block), leaves on devices first, then those on the host (whole). Its file
also holds the replica of the part of the process before it: the blocks of
that part this process does not hold itself (with a mirrored state,
nothing). Every process works out every process's blocks alike, from the
shardings, so each knows what the next one lacks and sends it. `plan`
works this out once per state layout: the layouts of the part and of the
replica, the header that describes them, and the `packing.py` program that
packs the part's bytes (and the copy for the next process) in one dispatch.
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
  """`[(bounds, device)]` of process `process`'s distinct blocks of `leaf`,
  in the order of the sharding's devices (every process works out every
  process's blocks alike); `device` None for a leaf whole on every device."""
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
  """`(pick, devices)`: a function that takes the data of `blocks` (this
  process's) out of a leaf like `leaf`, and the device each is on (a block
  whole on every device: the one on `target` if it is one of them)."""
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
  """A state's blocks on process `process` (with `but`, those process `but`
  does not hold: what a replica on it needs), in the order of its file: the
  blocks of the leaves on devices first (one buffer, `packing.py`), then
  those of the leaves on the host (whole). It holds the header's
  description of them (`entries`, JSON), their sizes, and (on this process,
  `target`: the device to pack them on) how to pick them: `picks`, `(leaf
  index, pick)` of each leaf on devices, whose blocks are `keys` (`(leaf
  index, bounds)`) on `devices`, and `host`, the indices of the leaves on
  the host."""

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
    """The file-order index of the first leaf on devices whose inexact
    values in `data` (their bytes, laid out as this layout says) hold NaN
    or inf, or None. One sum per run of blocks of one type (NaN and inf
    survive a sum); leaf by leaf only when one is not finite."""
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
  """The mesh over which one program can pack every process's blocks and
  send each its copy (`packing.packer_across`), or None: every leaf on
  devices is split (or not) over one mesh of one device per process, each
  process holds one block of each, and every process sends the next the
  blocks at the same positions, as many bytes (`copies`: the layouts of
  what each process sends)."""
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
  """`[(dtype, offset, nbytes)]`: the runs of consecutive inexact blocks of
  one type among `sizes` (a layout's)."""
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
  """`(mine, before, plan)`: the layouts of process `rank`'s blocks of
  `leaves` and of those of the process before it that this one does not
  hold (the replica it writes; None without `peer`, the copy to the next
  process, as in a job of one process), and `plan`: `(program, target,
  moves, length, across)`, the `packing.packer` program, the device it
  runs on, the positions of the blocks to move there first, the bytes each
  process sends the next (0: no copy, as for a mirrored state), and whether
  the program is `packing.packer_across`'s (it takes the leaves, and also
  makes the copy); `mine.header`: the header of this process's file after
  its step, checksum, attempt and rank (which the writer fills in)."""
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
