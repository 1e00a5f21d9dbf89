"""In-memory snapshots of a train state: the fast tier of `jdist.CheckpointManager`.

Every `snapshot_every` steps each process writes the blocks of the state it
holds (its addressable shards, one copy of each) to one file in the job's
snapshot directory under /dev/shm (`multiprocess/snapshot_dir.py`): host
memory that outlives the training processes, so a restarted job resumes
without reading the persistent directory. A part is written under a temporary
name and renamed when complete (tmpfs needs no fsync), so a reader never sees
half a part; its header holds a CRC-32 of its data.

Files, one per process and snapshot:
`step-<step>.attempt-<attempt>.part-<rank>-of-<world>.snap`. A snapshot (a
step, written by the processes of one attempt) is complete when the parts of
all its `world` processes are there. Restoring is collective: the processes
exchange which parts each sees (through the runtime's key-value store), take
the newest complete snapshot, read it, and exchange whether each could; if
any could not (a part unreadable, or this host lacks the blocks it needs),
every process falls back to the persistent directory, with a line that says
why. The state may be restored on another number of processes: each process
assembles each leaf from the blocks of the parts it sees and cuts its own
shards out of it. With one CPU device per process and a replicated (mirrored)
state, every part holds the whole state, so any single part is enough.

Writing: `write` takes the snapshot (it starts the copy of the blocks to the
host) and the next `flush` writes the part, at the manager's next `save`
(or `restore`, `close`): the step that computed it has ended by then, so the
loop does not wait for it. Cleanup, when a part is written: a process removes
every file but its last two snapshots' parts and the new one's (all
processes have written the one before its last: the steps since needed
their collectives, which each process dispatches after its `save` wrote
it); the process that completes a snapshot (it sees all of its parts)
removes the others. So at rest the directory holds the newest complete
snapshot (on one machine; across hosts, until the next two snapshots, also
the ones before it), and the launcher removes the directory when the job
ends.

What is replicated: on one machine, every process's part is in the one
/dev/shm, so a process that dies leaves its part to its successor. Across
hosts, each host holds its own processes' parts only: a host that goes away
takes its parts with it, the snapshot is incomplete, and the job resumes
from the persistent directory. A peer copy would go through the same files:
a launcher agent that copies each complete part to the next host's directory
would make the snapshot survive one host's loss; it is not built.

orbax-checkpoint 0.12's emergency (multi-tier) CheckpointManager is not used:
its local tier restores onto the mesh the snapshot was saved from (it maps the
saved devices onto the new ones, `mesh_consistency.py`), so a restart on
another number of processes (4 -> 3) cannot use it; it asks for at least two
replica slices, each spanning whole processes (`replica_axis_index`); and it
is marked experimental, "do not use without specific approval".
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.multiprocess import liveness
from jdist._src.multiprocess import runtime as runtime_lib

MAGIC = b"JDSNAP1\n"
_PART = re.compile(r"step-(\d+)\.attempt-(\d+)\.part-(\d+)-of-(\d+)\.snap")
_TMP = re.compile(r"\.tmp-(\d+)-(\d+)\.snap")  # the writer's rank and pid


def _group(m) -> tuple:
  return int(m[1]), int(m[2]), int(m[4])  # step, attempt, world


def _groups(entries) -> list:
  """`[((step, attempt, world), rank)]` of the parts among `entries`."""
  return [(_group(m), int(m[3])) for m in map(_PART.fullmatch, entries) if m]


def part_name(step: int, attempt: int, rank: int, world: int) -> str:
  return f"step-{step:012d}.attempt-{attempt}.part-{rank}-of-{world}.snap"


def say(message: str) -> None:
  """A line on process 0's error output (every process knows the same)."""
  if jax.process_index() == 0:
    print(f"jdist: {message}", file=sys.stderr, flush=True)


def _bounds(index, shape) -> list:
  return [list(s.indices(d)[:2]) for s, d in zip(index, shape)]


def _picks(leaf) -> tuple:
  """`(bounds, pick)`: the bounds of this process's distinct blocks of
  `leaf`, and a function that takes their data out of a leaf like it."""
  whole = [[0, d] for d in np.shape(leaf)]
  if not isinstance(leaf, jax.Array):
    return [whole], lambda x: [np.asarray(x)]
  if leaf.sharding.is_fully_replicated:  # the common case, and a fast one
    return [whole], lambda x: [x.addressable_data(0)]
  bounds, at = [], []
  for i, shard in enumerate(leaf.addressable_shards):
    b = _bounds(shard.index, leaf.shape)
    if b not in bounds:
      bounds.append(b)
      at.append(i)
  return bounds, lambda x: [x.addressable_shards[i].data for i in at]


class _Layout:
  """A state's blocks on this process: how to pick them, and the header's
  description of them (`entries`, JSON)."""

  def __init__(self, names: list, leaves: list):
    self.picks, entries = [], []
    for name, leaf in zip(names, leaves):
      bounds, pick = _picks(leaf)
      dtype = np.dtype(leaf.dtype)
      self.picks.append((pick, bool(np.issubdtype(dtype, np.inexact))))
      size = dtype.itemsize
      entries.append({"name": name, "shape": list(np.shape(leaf)),
                      "dtype": str(dtype), "shards": [
                          {"bounds": b, "nbytes": size * int(np.prod(
                              [hi - lo for lo, hi in b]))} for b in bounds]})
    self.entries = json.dumps(entries)


def _write_all(path: str, buffers: list) -> None:
  """Writes `buffers` to a new file `path` (few system calls)."""
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  try:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
      n = os.writev(fd, views)
      while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
      if views and n:
        views[0] = views[0][n:]
  finally:
    os.close(fd)


def _dtype(name: str) -> np.dtype:
  return np.dtype(jnp.dtype(name))  # also bfloat16 and the other ml_dtypes


class Snapshots:
  """The in-memory snapshots of one `CheckpointManager` in one job.

  Args:
    directory: this manager's snapshot directory (created if needed).
    attempt: the job's attempt (`JDIST_RESTART_COUNT`).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from jdist._src.checkpoint.snapshots import Snapshots
    >>> s = Snapshots(tempfile.mkdtemp(), attempt=0)
    >>> s.write(10, ["w"], [jnp.ones(3)])
    >>> s.flush()
    True
    >>> s.agree()[0]
    (10, 0, 1)
  """

  def __init__(self, directory: str, *, attempt: int = 0):
    self.directory = directory
    self.attempt = int(attempt)
    self.rank, self.world = jax.process_index(), jax.process_count()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for path in (os.path.dirname(directory), directory):
      if hasattr(os, "getuid") and os.stat(path).st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to another user; the in-memory snapshots of this "
            "job cannot go there. Set JDIST_SNAPSHOT_ROOT to a directory of "
            "yours.")
    # (step, attempt, world) of the last snapshot this process wrote (or
    # restored), and of the one before it.
    self.complete, self._before = None, None
    self._layout_key, self._layout_value = None, None
    self._pending, self._at_once = None, False

  # --- writing ------------------------------------------------------------------

  def write(self, step: int, names: list, leaves: list) -> None:
    """Takes snapshot `step` of `leaves` (every process calls it).

    Its part is written by the next `flush` (the next `save`, `restore` or
    `close` of the manager): by then the step that computed it has ended, so
    writing it does not wait for the step, and the host copy, started now,
    is there. A step that donates its state deletes the arrays first: that
    snapshot is lost (a line says so) and from then on each is written at
    once, waiting for its step.
    """
    self.flush()
    layout = self._layout(names, leaves)
    blocks = [pick(leaf) for leaf, (pick, _) in zip(leaves, layout.picks)]
    for block in (b for bs in blocks for b in bs):
      if isinstance(block, jax.Array):
        block.copy_to_host_async()
    self._pending = (int(step), names, layout, blocks)
    if self._at_once:
      self.flush()

  def flush(self) -> bool | None:
    """Writes the part of the snapshot taken last, if not yet written.

    Returns:
      None if there was none; else whether it was written: not when its
      arrays were donated to a later step, nor when they hold NaN or
      infinite values (the snapshot before it stays the newest).
    """
    if self._pending is None:
      return None
    step, names, layout, blocks = self._pending
    self._pending = None
    if any(isinstance(b, jax.Array) and b.is_deleted()
           for bs in blocks for b in bs):
      self._at_once = True
      say(f"the in-memory snapshot of step {step} was lost: the step after it "
          "donated the state's arrays before they were written; from now on "
          "each snapshot is written when it is taken.")
      return False
    arrays, crc = [], 0
    for name, bs, (_, inexact) in zip(names, blocks, layout.picks):
      for data in bs:
        h = np.asarray(data)
        if inexact and not np.isfinite(h.sum(dtype=np.float64)):
          # (NaN and inf survive the sum.)
          say(f"not writing the in-memory snapshot of step {step}: {name} has "
              "NaN or infinite values; the one before it stays the newest.")
          return False
        raw = np.ascontiguousarray(h).reshape(-1).view(np.uint8)  # bfloat16 too
        crc = zlib.crc32(raw, crc)
        arrays.append(raw)
    header = (f'{{"step": {int(step)}, "attempt": {self.attempt}, "rank": '
              f'{self.rank}, "world": {self.world}, "crc32": {crc}, '
              f'"leaves": {layout.entries}}}').encode()
    group = (int(step), self.attempt, self.world)
    try:
      entries = os.listdir(self.directory)
    except FileNotFoundError:  # removed by a launcher that left the job
      os.makedirs(self.directory, exist_ok=True)
      entries = []
    # The last two parts this process wrote, and `group`'s: every process
    # has written the one before the last (see the module's docstring).
    previous = self.complete
    self._remove(entries, keep={group, previous, self._before})
    tmp = os.path.join(self.directory, f".tmp-{self.rank}-{os.getpid()}.snap")
    _write_all(tmp, [MAGIC + struct.pack("<Q", len(header)) + header, *arrays])
    os.replace(tmp, os.path.join(self.directory,
                                 part_name(*group[:2], self.rank, self.world)))
    if previous != group:
      self._before, self.complete = previous, group
    written = {r for g, r in _groups(entries) if g == group} | {self.rank}
    if written == set(range(self.world)):
      self._remove(entries, keep={group})  # the last part of `group` is in
    return True

  def _layout(self, names: list, leaves: list) -> "_Layout":
    """How to take this process's blocks out of `leaves` (worked out once
    per shapes, dtypes and shardings: a snapshot costs little more than its
    copy and its file)."""
    key = tuple((np.shape(x), str(x.dtype), getattr(x, "sharding", None))
                for x in leaves)
    if self._layout_key != key:
      self._layout_key, self._layout_value = key, _Layout(names, leaves)
    return self._layout_value

  def _remove(self, entries: list, keep: set) -> None:
    """Removes, of `entries`, the parts of the snapshots not in `keep`, and
    the temporary files of writers that died."""
    for entry in entries:
      m, tmp = _PART.fullmatch(entry), _TMP.fullmatch(entry)
      gone = ((m is not None and _group(m) not in keep)
              or (tmp is not None and not liveness.pid_exists(int(tmp[2]))))
      if gone:
        try:
          os.unlink(os.path.join(self.directory, entry))
        except FileNotFoundError:
          pass  # another process of this host removed it first

  # --- finding the newest complete snapshot ---------------------------------------

  def _seen(self) -> dict:
    """`{(step, attempt, world): {ranks}}` of the parts on this host."""
    seen: dict = {}
    for group, rank in _groups(os.listdir(self.directory)):
      seen.setdefault(group, set()).add(rank)
    return seen

  def agree(self, newest_checkpoint: int | None = None) -> tuple:
    """`(group, note, newest_checkpoint)`: the newest snapshot whose parts
    all exist on the job's hosts, as `(step, attempt, world)`, or None;
    `note` says why newer snapshots are not used (or ""); and the newest of
    the persistent checkpoints the processes see (each passes its own), so
    that every process chooses the same of the two. The same on every
    process."""
    mine = [[*g, sorted(r)] for g, r in self._seen().items()]
    runtime = runtime_lib.current()
    key = f"jdist/snapshots/{runtime.next_sequence('snapshots')}/"
    values = runtime.exchange(
        key, json.dumps([mine, newest_checkpoint]), timeout=None,
        what="the agreement on the in-memory snapshot")
    union: dict = {}
    disk = []
    for text in values.values():
      seen, newest = json.loads(text)
      if newest is not None:
        disk.append(newest)
      for step, attempt, world, ranks in seen:
        union.setdefault((step, attempt, world), set()).update(ranks)
    complete = [g for g, r in union.items() if r == set(range(g[2]))]
    best = max(complete, default=None)
    newer = sorted(g for g in union if best is None or g[0] > best[0])
    notes = [f"the snapshot of step {s} (attempt {a}) lacks the parts of "
             f"processes {sorted(set(range(w)) - union[(s, a, w)])} of {w}"
             for s, a, w in newer]
    return best, "; ".join(notes), max(disk, default=None)

  # --- reading ------------------------------------------------------------------

  def _parts(self, group) -> list:
    step, attempt, world = group
    ranks = sorted(range(world), key=lambda r: r != self.rank)  # its own first
    paths = [os.path.join(self.directory, part_name(step, attempt, r, world))
             for r in ranks]
    return [p for p in paths if os.path.exists(p)]

  def read(self, group, described: dict) -> tuple:
    """`(leaves, problem)`: the whole of each leaf named in `described`
    (`{name: [shape, dtype]}`, in order) from snapshot `group`, as numpy
    arrays, assembled from the parts this host holds; or `(None, why)`,
    why the first process that could not read it could not (every process
    calls it, and they learn from each other: all read it, or none does)."""
    leaves, problem = self._read(group, described)
    runtime = runtime_lib.current()
    key = f"jdist/snapshot_read/{runtime.next_sequence('snapshot_read')}/"
    problems = runtime.exchange(key, problem or "", timeout=None,
                                what="reading the in-memory snapshot")
    problems = [p for _, p in sorted(problems.items()) if p]
    return (None, problems[0]) if problems else (leaves, None)

  def _read(self, group, described: dict) -> tuple:
    full = {n: np.empty(s, _dtype(d)) for n, (s, d) in described.items()}
    covered = {n: np.zeros(s, bool) for n, (s, _) in described.items()}
    for path in self._parts(group):
      try:
        with open(path, "rb") as f:
          raw = f.read()
      except OSError as e:
        return None, f"{os.path.basename(path)} cannot be read ({e})"
      problem = _fill(raw, described, full, covered)
      if problem:
        return None, f"{os.path.basename(path)} {problem}"
      if all(c.all() for c in covered.values()):
        return list(full.values()), None
    missing = [n for n, c in covered.items() if not c.all()]
    return None, (f"process {self.rank}'s host lacks the parts that hold "
                  f"{', '.join(missing[:3])}")


def _fill(raw: bytes, described: dict, full: dict, covered: dict) -> str | None:
  """Copies a part's blocks into `full` (marking `covered`); what is wrong
  with it, or None."""
  if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 8:
    return "is not a snapshot part"
  (n,) = struct.unpack("<Q", raw[len(MAGIC):len(MAGIC) + 8])
  start = len(MAGIC) + 8 + n
  try:
    header = json.loads(raw[len(MAGIC) + 8:start])
  except ValueError:
    return "has an unreadable header"
  data = memoryview(raw)[start:]
  if zlib.crc32(data) != header.get("crc32"):
    return "fails its checksum"
  saved = {e["name"]: [e["shape"], e["dtype"]] for e in header["leaves"]}
  if saved != {k: [list(s), str(_dtype(d))] for k, (s, d) in described.items()}:
    return "holds another state (other leaves, shapes or dtypes)"
  offset = 0
  for e in header["leaves"]:
    dtype = _dtype(e["dtype"])
    for shard in e["shards"]:
      where = tuple(slice(a, b) for a, b in shard["bounds"])
      shape = [b - a for a, b in shard["bounds"]]
      block = np.frombuffer(data, dtype, count=int(np.prod(shape)),
                            offset=offset).reshape(shape)
      full[e["name"]][where] = block
      covered[e["name"]][where] = True
      offset += shard["nbytes"]
  return None
