"""In-memory snapshots of a train state: the fast tier of `jdist.CheckpointManager`.

Every `snapshot_every` steps each process writes the blocks of the state it
holds (its addressable shards, one copy of each) to one file in the job's
snapshot directory under /dev/shm (`launcher/snapshot_dir.py`): host
memory that outlives the training processes, so a restarted job resumes
without reading the persistent directory. A file is written under a
temporary name and renamed when complete (tmpfs needs no fsync), so a reader
never sees half a file; its header holds a CRC-32 of its data.

Files, one per process and snapshot:
`step-<step>.attempt-<attempt>.part-<rank>-of-<world>.snap`. It holds the
process's part and, in a job of several processes, after it, the replica of
the part of the process before it (`rank - 1 mod world`): the blocks of that
part this process does not hold itself (its own part, next to them, holds
the others), brought over by `peer_copy.py` through the JAX runtime. One
file, so one write and rename a snapshot, and the part and the replica
appear together. A process keeps its files open; when one's snapshot is
old, it does not remove it but renames it back to its temporary name and
writes the next snapshot over it (its spare: no file made or removed, no
page of memory taken anew; at most `SPARE_BYTES`, a larger file is
removed; `close` and `clear` remove the spare). A snapshot (a step, written by the processes of one
attempt) is complete when the part of each of its `world` processes is
there, in its own file or, as its replica, in the next process's.
Restoring is collective: the processes exchange which parts and replicas
each sees (through the runtime's key-value store), take the newest complete
snapshot, read it (a process's part where its host has it, else its
replica), and exchange whether each could; if any could not (a part
unreadable, or this host lacks the blocks it needs), every process falls
back to the persistent directory, with a line that says why. The state may
be restored on another number of processes: each process assembles each
leaf from the blocks of the parts it sees and cuts its own shards out of it.
With one CPU device per process and a replicated (mirrored) state, every
part holds the whole state, so any single part is enough.

Writing: `write` takes the snapshot: one jitted program packs the blocks of
this process into one buffer on its device (and those the next process
lacks into another, `packing.py`), and starts the second's copy to the
next process (one dispatch and one collective per snapshot, whatever the
number of leaves; the layout of the blocks, the header and the program are
worked out once per state layout: a snapshot fills in only the header's
step, checksum, attempt and rank, in a short buffer written before the
rest). When the state's leaves lie on one mesh
of one device per process (the usual multi-process job), the packing and
the copy are one program over that mesh, dispatched with the leaves
themselves (`packing.packer_across`). Each buffer ends with a byte that
says whether its values are all finite, so the writer reads no value to
check. The buffers are copies, so a step that
donates the state's arrays next does not touch them. The next `save` of
the manager hands it to this `Snapshots`' writer, one background thread,
which writes the process's file (it copies the buffers to the host, then
checksum, file, rename),
while the loop goes on with its next steps; `restore` and `close` write it
at once. At most one snapshot is in flight: `write` first waits for the one
before it (written long ago at a snapshot every few steps), and so do
`restore`, `close` and `snapshot_step`. An error of the writer (a full
/dev/shm) is raised on the training thread at its next call (`save`,
`restore`, `close`), never lost; at the process's exit, a write in flight
is waited for a few seconds (the thread is a daemon, so a write stuck on a
dead peer's copy does not hold the exit), and a part it did not finish is
a temporary file that no reader takes (the rename makes it a part).

Cleanup, when a file is written: a process removes every file but its last
two snapshots' and the new one's: all processes have
written the one before its last. It lists the directory once, at its first
write (the files of earlier attempts, the temporary files of writers that
died); after that it removes the files it wrote itself, by name. Why, with
the writing in the background: a process's writer writes snapshot k only
once its blocks are there, that is once the step that computed them has run,
and that step needed every process's collectives; each process dispatches
that step (later than snapshot k-1's step) after its `write` of snapshot
k-1, which waited for its writer to finish snapshot k-2: so every process's
part of k-2 is there. (When each part was written in the loop, in the `save`
after its step, this held too, with one snapshot to spare; the rule is the
same.) The process that completes a snapshot (its file, and the files of
the others it finds, hold all of its parts; at 2 processes its own file
does, and it looks for no other) removes the older ones it wrote, and,
when its own file does not hold all the parts, those the other processes
wrote. So at rest the directory holds the newest complete snapshot
(on one machine; across hosts, until the next two snapshots, also the ones
before it), and the launcher removes the directory when the job ends.

What survives: on one machine, every process's part is in the one /dev/shm,
so a process that dies leaves its part to its successor (a process killed
before its writer renamed its file, a few milliseconds after the `save`
that handed it over, leaves that snapshot to its replica, in the next
process's file, or to the one before). Across hosts, each
host holds its own processes' parts and the replicas of the processes
before them: a host that goes away takes its parts with it, and the next
host's replicas stand in for them, so the job resumes from memory on the
hosts that are left. Two neighbouring hosts (in process order) that go away
together take a part and its replica: the snapshot is incomplete, and the
job resumes from the persistent directory. The copies hold what the next
process lacks: with a replicated (mirrored) state, nothing (the replica is
a line of the header, no copy is made: replicating costs nothing); with state
split over the processes, each process's blocks once (benchmarks/RESULTS.md
says what it costs).

orbax-checkpoint 0.12's emergency (multi-tier) CheckpointManager is not used:
its local tier restores onto the mesh the snapshot was saved from (it maps the
saved devices onto the new ones, `mesh_consistency.py`), so a restart on
another number of processes (4 -> 3) cannot use it; it asks for at least two
replica slices, each spanning whole processes (`replica_axis_index`); and it
is marked experimental, "do not use without specific approval".
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import queue
import re
import struct
import sys
import threading
import weakref
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jdist._src.checkpoint import packing
from jdist._src.checkpoint import peer_copy
from jdist._src.launcher import liveness
from jdist._src.runtime import runtime as runtime_lib

MAGIC = b"JDSNAP1\n"
# The file of process <rank>: its part, and (in a job of several processes)
# the replica of the part of the process before it.
_PART = re.compile(r"step-(\d+)\.attempt-(\d+)\.part-(\d+)-of-(\d+)\.snap")
_TMP = re.compile(r"\.tmp-(\d+)-(\d+)\.snap")  # the writer's rank and pid


@functools.lru_cache(maxsize=1024)
def _parse(entry: str) -> tuple:
  """`(group, rank, pid)` of a directory entry: a process's file's
  snapshot `(step, attempt, world)` and process (else None each), and a
  temporary file's writer's pid (else None). Cached: the writer looks at
  the same names snapshot after snapshot."""
  m = _PART.fullmatch(entry)
  if m:
    return (int(m[1]), int(m[2]), int(m[4])), int(m[3]), None
  tmp = _TMP.fullmatch(entry)
  return None, None, (int(tmp[2]) if tmp else None)


def _groups(entries) -> list:
  """`[((step, attempt, world), rank)]` of the processes' files among
  `entries`."""
  return [parsed[:2] for parsed in map(_parse, entries) if parsed[0]]


def part_name(step: int, attempt: int, rank: int, world: int) -> str:
  """The file of process `rank` of snapshot `step`: its part, and in a job
  of several processes the replica of process `(rank - 1) % world`'s."""
  return f"step-{step:012d}.attempt-{attempt}.part-{rank}-of-{world}.snap"


def held(rank: int, world: int) -> tuple:
  """The processes whose parts the file of process `rank` holds: its own,
  and the one before it (its replica)."""
  return (rank,) if world == 1 else (rank, (rank - 1) % world)


def say(message: str) -> None:
  """A line on process 0's error output (every process knows the same)."""
  if jax.process_index() == 0:
    print(f"jdist: {message}", file=sys.stderr, flush=True)


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


class _Layout:
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
    self.header = b""  # (`Snapshots._layout` sets it)
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
    if all(_finite(data, *run) for run in self._runs):
      return None
    offset = 0
    for i, (dtype, inexact, nbytes) in enumerate(self.sizes[:self.on_device]):
      for n in nbytes:
        if inexact and not _finite(data, dtype, offset, n):
          return i
        offset += n
    return None


def _one_program_mesh(leaves: list, mine: "_Layout", copies: list):
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


def _finite(data, dtype: np.dtype, offset: int, nbytes: int) -> bool:
  values = np.frombuffer(data, dtype, count=nbytes // dtype.itemsize,
                         offset=offset)
  wide = np.complex128 if np.issubdtype(dtype, np.complexfloating) else \
      np.float64
  return bool(np.isfinite(values.sum(dtype=wide)))


def _write_all(path: str, buffers: list, spare: tuple | None = None) -> tuple:
  """Writes `buffers` (of bytes, one dimension: `bytes`, uint8 arrays) to a
  new file `path`, or, with `spare` (`(fd, size)` of a file open under that
  name), over that file (no file made, no page of memory taken anew), cut
  to their length; one `writev` (more only when the system writes less at
  once). Returns `(fd, size)`: the file stays open, to be written over
  again once its snapshot is old (`Snapshots._retire`)."""
  fd, size = spare or (os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                                0o600), 0)
  try:
    total = sum(map(len, buffers))
    written = os.pwritev(fd, buffers, 0)
    if written < total:  # (rare) the rest, from where it stopped
      rest = memoryview(b"".join(buffers))[written:]
      while rest:
        rest = rest[os.pwrite(fd, rest, total - len(rest)):]
    if total < size:
      os.ftruncate(fd, total)
  except BaseException:
    os.close(fd)
    raise
  return fd, total


def _unpacked(packed) -> tuple:
  """`(data, finite)`: the bytes of a buffer `packing.py` made (this
  process's block of it, when it spans the processes), and its last byte,
  whether no value in it is NaN or infinite; `(empty, True)` for None."""
  if packed is None:
    return np.zeros(0, np.uint8), True
  raw = packed if type(packed) is np.ndarray else _host_bytes(packed)
  return raw[:-1], bool(raw[-1])


def _host_bytes(x) -> np.ndarray:
  """The bytes of `x` (this process's block of it, when it spans the
  processes) on the host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return np.asarray(x)


def _checked(step: int, layout: "_Layout", packed, host: list) -> list | None:
  """The arrays of a part to write (its bytes on devices, then its leaves
  on the host), or None, with a line, when a value of it is NaN or
  infinite (the packing program's byte says whether; the leaf is then
  found on the host)."""
  data, finite = _unpacked(packed)
  if finite and not host:  # the usual case
    return [data]
  bad = None if finite else layout.nonfinite(data)
  if not finite and bad is None:
    bad = 0
  if bad is None:
    bad = next((layout.on_device + k for k, h in enumerate(host)
                if np.issubdtype(h.dtype, np.inexact) and
                not _finite(np.ascontiguousarray(h), h.dtype, 0, h.nbytes)),
               None)
  if bad is not None:
    say(f"not writing the in-memory snapshot of step {step}: "
        f"{layout.names[bad]} has NaN or infinite values; the one before "
        "it stays the newest.")
    return None
  return [data, *(np.ascontiguousarray(h).reshape(-1).view(np.uint8)
                  for h in host)]  # (bfloat16 too)


def _replica(step: int, layout: "_Layout", received) -> np.ndarray | None:
  """The bytes of the replica to write (the blocks of the part of the
  process before this one that this one does not hold, `layout`), from
  those the copy brought; None, with a line, when a value of them is NaN
  or infinite (that process does not write its part either)."""
  data, finite = _unpacked(received)
  if not finite:
    bad = layout.nonfinite(data)
    say(f"not writing the in-memory snapshot of step {step}: "
        f"{layout.names[bad or 0]} has NaN or infinite values (in the part "
        "of the process before this one); the one before it stays the "
        "newest.")
    return None
  return data[:layout.nbytes]


# The largest file a process keeps as its spare, to write the next snapshot
# over (a larger one is removed: the spare holds as much memory as the file).
SPARE_BYTES = 1 << 20

# How long a process's exit waits for a snapshot being written.
EXIT_WAIT_SECONDS = 10.0
_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the writers to wait for at exit


class _Writer:
  """One background daemon thread that runs one job at a time: `start` a
  job, `wait` for it (its result, or its error raised here)."""

  def __init__(self, name: str):
    self._name = name
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._idle = threading.Event()
    self._idle.set()
    self._thread = None
    self._result, self._error = None, None

  def start(self, job) -> None:
    """Runs `job()` on the thread (the one before must have been waited
    for)."""
    if not self._idle.is_set():
      raise RuntimeError("a snapshot is already being written")
    if self._thread is None:
      global _AT_EXIT
      if not _AT_EXIT:
        # Registered now, it runs before the exit handlers registered
        # earlier (the JAX runtime's shutdown: a write may need the runtime).
        _AT_EXIT = True
        atexit.register(_wait_at_exit)
      self._thread = threading.Thread(target=self._run, name=self._name,
                                      daemon=True)
      self._thread.start()
      _LIVE.add(self)
    self._idle.clear()
    self._jobs.put(job)

  def _run(self) -> None:
    while True:
      job = self._jobs.get()
      if job is None:
        return
      try:
        self._result, self._error = job(), None
      except BaseException as e:  # raised on the training thread by `wait`
        self._result, self._error = None, e
      job = None  # the snapshot's arrays: not kept alive until the next one
      self._idle.set()

  @property
  def busy(self) -> bool:
    return not self._idle.is_set()

  @property
  def failed(self) -> bool:
    """Whether the last job raised an error that `wait` has not raised."""
    return self._error is not None

  def wait(self, timeout: float | None = None):
    """The last job's result (None if none, or not done in `timeout`);
    raises its error, once."""
    if not self._idle.wait(timeout):
      return None
    error, self._error = self._error, None
    result, self._result = self._result, None
    if error is not None:
      raise error
    return result

  def stop(self) -> None:
    """Ends the thread (after waiting for its job)."""
    if self._thread is not None:
      self._jobs.put(None)
      self._thread = None
      _LIVE.discard(self)


_AT_EXIT = False  # whether `_wait_at_exit` is registered


def _wait_at_exit() -> None:
  """A snapshot being written as the process exits: waited for (a few
  seconds at most), its error printed."""
  for writer in list(_LIVE):
    try:
      writer.wait(EXIT_WAIT_SECONDS)
    except BaseException as e:  # noqa: BLE001 (the process is ending)
      print(f"jdist: an in-memory snapshot could not be written: {e!r}",
            file=sys.stderr, flush=True)


def _close(fd: int | None) -> None:
  if fd is not None:
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
    self._prefix = os.path.join(directory, "")  # (of its files' paths)
    self.attempt = int(attempt)
    self.rank, self.world = jax.process_index(), jax.process_count()
    # The temporary name of the file this process is writing.
    self._tmp = f"{self._prefix}.tmp-{self.rank}-{os.getpid()}.snap"
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
    self._layouts_key, self._layouts = None, None
    # The files this process wrote, by snapshot, since it last listed the
    # directory (`_swept`: at its first write).
    # (`{group: (path, fd, size)}`, each file kept open: once old, it
    # becomes the spare, `(fd, size)`, that the next snapshot is written
    # over.)
    self._written: dict = {}
    self._spare = None
    self._swept = False
    self._pending = None
    self._writer = _Writer(f"jdist-snapshots-{self.rank}")
    self._peer = peer_copy.PeerCopy.for_this_job()
    # The processes whose parts the last agreement found only as replicas.
    self.from_replicas: list = []

  # --- writing ------------------------------------------------------------------

  def write(self, step: int, names: list, leaves: list) -> None:
    """Takes snapshot `step` of `leaves` (every process calls it).

    It waits for the snapshot before it to be written (at most one in
    flight), then dispatches one program that packs this process's blocks
    into one buffer (and those the next process lacks into another,
    `packing.py`) and, in a job of several processes, the copy of the other
    to the next process (`peer_copy.py`); the writer thread copies the
    buffers to the host (off the loop's thread, where an accelerator's
    transfer costs the loop nothing).
    The next `flush(wait=False)` (the manager's next `save`) hands the
    snapshot to the writer thread, which writes this process's file: the
    part, and the replica of the part the process before sent; `flush()`
    (the manager's `restore`, `close`) writes it at once. Either way the
    step that computed it has been dispatched by then and the loop does not
    wait for it. The buffers are copies: a later step may donate the
    state's arrays.

    Raises:
      The error of the snapshot before it, if its writer failed.
    """
    self.flush()
    mine, before, plan = self._layout(names, leaves)
    program, target, moves, length, across = plan
    host = [np.asarray(leaves[i]) for i in mine.host]
    if across:  # one program packs and sends: one result, this process's
      # part then the copy it received (the writer takes its block of it)
      both = program([leaves[i] for i, _ in mine.picks])
      self._pending = (int(step), mine, both, host, before, mine.nbytes + 1)
      return
    blocks = [b for i, pick in mine.picks for b in pick(leaves[i])]
    if moves:  # blocks on this process's other devices
      for j, b in zip(moves, jax.device_put([blocks[j] for j in moves],
                                            target)):
        blocks[j] = b
    packed = copy = received = None
    if blocks:
      packed, copy = program(blocks)  # (the writer copies them to the host)
    elif length:  # nothing of this process's for the next: its share of
      # zeros, and a 1: nothing in it is NaN
      copy = jax.device_put(np.append(np.zeros(length, np.uint8), 1), target)
    if copy is not None:
      received = self._peer.send(copy)
    self._pending = (int(step), mine, packed, host, before, received)

  def flush(self, wait: bool = True) -> bool | None:
    """Writes this process's file of the snapshot taken last, if not yet
    written (the part, and the replica of the part of the process before
    this one); with `wait=False`, hands it to the writer thread and returns
    at once.

    Returns:
      None with `wait=False`, or if there was none to write; else whether
      the last snapshot was written: not when it holds NaN or infinite
      values (the snapshot before it stays the newest).

    Raises:
      The error of the writer thread's last snapshot, if it failed.
    """
    pending, self._pending = self._pending, None
    if not wait:
      if pending is None:  # (the usual call: one look at an attribute)
        if self._writer.failed:
          self._writer.wait()  # raises the last one's error
        return None
      self._writer.wait()  # (none in flight: `write` waited for it)
      self._writer.start(lambda: self._write(pending))
      return None
    written = self._writer.wait()
    return written if pending is None else self._write(pending)

  def wait(self) -> None:
    """Waits for the snapshot being written, if any (its error is raised)."""
    self._writer.wait()

  def close(self) -> None:
    """Writes the last snapshot taken, and ends the writer thread."""
    try:
      self.flush()
    finally:
      self._writer.stop()
      self._close_files()

  def _write(self, pending: tuple) -> bool:
    """Writes snapshot `pending` (on the writer thread, or the training
    thread): see `flush`."""
    step, layout, packed, host, before, received = pending
    if isinstance(received, int):  # one buffer: the part, then the copy
      both = np.asarray(packed.addressable_data(0))  # (spans the processes)
      packed, received = both[:received], both[received:]
    arrays = _checked(step, layout, packed, host)
    if arrays is None:
      return False
    if before is not None:  # the replica of the part of the process before
      data = _replica(step, before, received)
      if data is None:
        return False
      arrays.append(data)
    crc = 0
    for raw in arrays:
      crc = zlib.crc32(raw, crc)
    group = (int(step), self.attempt, self.world)
    # The last two snapshots this process wrote, and `group`: every process
    # has written the one before the last (see the module's docstring).
    previous = self.complete
    self._keep_only({group, previous, self._before})
    self._put(group, crc, layout.header, arrays)
    if previous != group:
      self._before, self.complete = previous, group
    mine = set(held(self.rank, self.world))
    found = set(mine)
    for r in range(self.world):  # part r: in file r, or in r + 1's
      for k in () if r in found else (r, (r + 1) % self.world):
        if os.path.exists(self._path(group, k)):
          found.update(held(k, self.world))
          break
    if len(found) == self.world:  # the last part of `group` is in
      self._keep_only({group}, others=mine != found)
    return True

  def _path(self, group, rank: int) -> str:
    return self._prefix + part_name(*group[:2], rank, group[2])

  def _keep_only(self, keep: set, others: bool = False) -> None:
    """Removes the files of the snapshots not in `keep`: at this process's
    first write (and the first after `clear`), every such file in the
    directory, and the temporary files of writers that died (one listing);
    after it, those this process wrote (it knows their names: no listing);
    with `others`, also those the other processes wrote of the snapshots
    this process wrote (a process that cannot tell that the snapshot is
    complete leaves its own to the one that can)."""
    if not self._swept:
      try:
        entries = os.listdir(self.directory)
      except FileNotFoundError:  # removed by a launcher that left the job
        os.makedirs(self.directory, exist_ok=True)
        entries = []
      self._remove(entries, keep)
      self._swept = True
    for group in [g for g in self._written if g not in keep]:
      path, fd, size = self._written.pop(group)
      if (not others and self._spare is None and fd is not None
          and size <= SPARE_BYTES):
        self._retire(path, fd, size)
        continue
      _close(fd)
      for path in ([path] if not others else
                   [self._path(group, r) for r in range(self.world)]):
        try:
          os.unlink(path)
        except FileNotFoundError:
          pass  # another process of this host removed it first

  def _retire(self, path: str, fd: int, size: int) -> None:
    """Makes this process's file of an old snapshot its spare: renamed to
    its temporary name (which no reader takes), kept open, and written
    over with the next snapshot (`_put`): no file made or removed, and no
    page of memory taken anew, a snapshot."""
    try:
      os.rename(path, self._tmp)
      self._spare = (fd, size)
    except FileNotFoundError:  # the directory was removed
      os.close(fd)

  def _put(self, group, crc: int, header: bytes, arrays: list) -> None:
    """Writes this process's file of snapshot `group` (`header`: its
    layout's, after the step, checksum, attempt and rank, which go in a
    short buffer of their own before it; `arrays`: its data): under a
    temporary name, renamed when complete."""
    head = b'{"step": %d, "crc32": %d, "attempt": %d, "rank": %d, ' % (
        group[0], crc, self.attempt, self.rank)
    buffers = [MAGIC + struct.pack("<Q", len(head) + len(header)) + head,
               header, *arrays]
    tmp, path = self._tmp, self._path(group, self.rank)
    spare, self._spare = self._spare, None
    try:
      fd, size = _write_all(tmp, buffers, spare)
    except FileNotFoundError:  # removed by a launcher that left the job
      os.makedirs(self.directory, exist_ok=True)
      fd, size = _write_all(tmp, buffers)
    try:
      os.replace(tmp, path)
    except FileNotFoundError:  # the spare, removed with the directory
      os.close(fd)
      os.makedirs(self.directory, exist_ok=True)
      fd, size = _write_all(tmp, buffers)
      os.replace(tmp, path)
    self._written[group] = (path, fd, size)

  def _close_files(self) -> None:
    """Closes the files this process keeps open (it forgets them), and
    removes its spare."""
    if self._spare is not None:
      os.close(self._spare[0])
      try:
        os.unlink(self._tmp)
      except FileNotFoundError:
        pass  # (the directory was removed)
    for _, fd, _ in self._written.values():
      _close(fd)
    self._spare = None
    self._written = {k: (path, None, 0) for k, (path, _, _) in
                     self._written.items()}

  def _layout(self, names: list, leaves: list) -> tuple:
    """`(mine, before, plan)`: the layouts of this process's blocks of
    `leaves` and of those of the process before it that this one does not
    hold (the replica it writes; None in a job of one process), and `plan`:
    `(program, target, moves, length, across)`, the `packing.packer`
    program, the device it runs on, the positions of the blocks to move
    there first, the bytes each process sends the next (0: no copy, as for
    a mirrored state), and whether the program is `packing.packer_across`'s
    (it takes the leaves, and also makes the copy); `mine.header`: the
    header of this process's file after its step, checksum, attempt and
    rank (which `_put` fills in). Worked out
    once per names, shapes, dtypes and shardings, so that a snapshot costs
    little more than its copies and its file."""
    key = [(x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves]
    if self._layouts_key is None or self._layouts_key != (names, key):
      self._layouts_key = (list(names), key)
      self._layouts = self._new_layout(names, leaves)
      mine, before, _ = self._layouts
      replica = "" if before is None else (
          f', "replica": {{"rank": {(self.rank - 1) % self.world}, '
          f'"leaves": {before.entries}}}')
      mine.header = (f'"world": {self.world}, "leaves": {mine.entries}'
                     f'{replica}}}').encode()
    return self._layouts

  def _new_layout(self, names: list, leaves: list) -> tuple:
    target = None if self._peer is None else self._peer.device
    mine = _Layout(names, leaves, self.rank, target=target)
    target = target or next(iter(mine.devices), None)
    moves = [j for j, d in enumerate(mine.devices) if d != target]
    before, sent, length = None, None, 0
    if self._peer is not None:
      copies = [_Layout(names, leaves, p, but=(p + 1) % self.world)
                for p in range(self.world)]
      before = copies[self.rank - 1]
      length = max(c.nbytes for c in copies)
      if length:
        at = {k: j for j, k in enumerate(mine.keys)}
        mine_sent = _Layout(names, leaves, self.rank,
                            but=(self.rank + 1) % self.world, target=target)
        sent = [at[k] for k in mine_sent.keys]
        mesh = _one_program_mesh(leaves, mine, copies)
        if mesh is not None:
          specs = [leaves[i].sharding.spec for i, _ in mine.picks]
          return mine, before, (packing.packer_across(mesh, specs, sent,
                                                      length),
                                target, [], length, True)
    return mine, before, (packing.packer(sent, length), target, moves,
                          length, False)

  def _remove(self, entries: list, keep: set) -> None:
    """Removes, of `entries`, the files of the snapshots not in `keep`, and
    the temporary files of writers that died."""
    for entry in entries:
      group, _, pid = _parse(entry)
      gone = ((group is not None and group not in keep)
              or (pid is not None and not liveness.pid_exists(pid)))
      if gone:
        try:
          os.unlink(os.path.join(self.directory, entry))
        except FileNotFoundError:
          pass  # another process of this host removed it first

  def clear(self) -> None:
    """Removes the snapshots on this host (every process calls it, after
    a collective that every process enters once it has written its last,
    such as `agree`)."""
    self._close_files()
    self._remove(os.listdir(self.directory), keep=set())
    self.complete = self._before = None
    self._written, self._swept = {}, False

  # --- finding the newest complete snapshot ---------------------------------------

  def _seen(self) -> dict:
    """`{(step, attempt, world): ({ranks}, {ranks})}`: the processes whose
    parts, and whose replicas, are on this host (the file of process k
    holds its part and the replica of process k - 1's)."""
    seen: dict = {}
    for group, rank in _groups(os.listdir(self.directory)):
      parts, replicas = seen.setdefault(group, (set(), set()))
      parts.add(rank)
      replicas.update(held(rank, group[2])[1:])
    return seen

  def agree(self, newest_checkpoint: int | None = None) -> tuple:
    """`(group, note, newest_checkpoint)`: the newest snapshot of which
    every process's part (or its replica) exists on the job's hosts, as
    `(step, attempt, world)`, or None; `note` says why newer snapshots are
    not used (or ""); and the newest of the persistent checkpoints the
    processes see (each passes its own), so that every process chooses the
    same of the two. The same on every process; `from_replicas` is then
    the processes whose parts of `group` only their replicas hold."""
    mine = [[*g, sorted(p), sorted(r)] for g, (p, r) in self._seen().items()]
    runtime = runtime_lib.current()
    key = f"jdist/snapshots/{runtime.next_sequence('snapshots')}/"
    values = runtime.exchange(
        key, json.dumps([mine, newest_checkpoint]), timeout=None,
        what="the agreement on the in-memory snapshot")
    parts: dict = {}
    replicas: dict = {}
    disk = []
    for text in values.values():
      seen, newest = json.loads(text)
      if newest is not None:
        disk.append(newest)
      for step, attempt, world, ps, rs in seen:
        parts.setdefault((step, attempt, world), set()).update(ps)
        replicas.setdefault((step, attempt, world), set()).update(rs)
    holding = {g: parts[g] | replicas[g] for g in parts}
    complete = [g for g, r in holding.items() if r == set(range(g[2]))]
    best = max(complete, default=None)
    self.from_replicas = ([] if best is None else
                          sorted(replicas[best] - parts[best]))
    newer = sorted(g for g in holding if best is None or g[0] > best[0])
    notes = [f"the snapshot of step {s} (attempt {a}) lacks the parts of "
             f"processes {sorted(set(range(w)) - holding[(s, a, w)])} of {w}"
             for s, a, w in newer]
    return best, "; ".join(notes), max(disk, default=None)

  # --- reading ------------------------------------------------------------------

  def _parts(self, group) -> list:
    """The files of `group` on this host to read, this process's own
    first: each process's part is in its file, or where that is not here,
    as its replica in the next process's file."""
    world = group[2]
    paths, found = [], set()
    for r in sorted(range(world), key=lambda r: r != self.rank):  # own first
      for k in () if r in found else (r, (r + 1) % world):
        path = self._path(group, k)
        if os.path.exists(path):
          paths.append(path)
          found.update(held(k, world))
          break
    return paths

  def saved_shape(self, group, name: str) -> list | None:
    """The shape of leaf `name` in snapshot `group`, as the header of the
    first of its files on this host says (a leaf whose shape the reader
    cannot know, such as `CheckpointManager`'s metadata), or None."""
    paths = self._parts(group)
    try:
      with open(paths[0], "rb") as f:
        start = f.read(len(MAGIC) + 8)
        header = json.loads(f.read(struct.unpack("<Q", start[len(MAGIC):])[0]))
      return next((e["shape"] for e in header["leaves"] if e["name"] == name),
                  None)
    except (IndexError, OSError, ValueError, KeyError, TypeError,
            struct.error):
      return None  # `read` says what is wrong with it

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
  """Copies the blocks of a process's file (its part, and the replica it
  holds) into `full` (marking `covered`); what is wrong with it, or
  None."""
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
  entries = [*header["leaves"], *header.get("replica", {}).get("leaves", [])]
  wanted = {k: [list(s), str(_dtype(d))] for k, (s, d) in described.items()}
  if any(wanted.get(e["name"]) != [e["shape"], e["dtype"]] for e in entries
         ) or {e["name"] for e in header["leaves"]} != set(wanted):
    return "holds another state (other leaves, shapes or dtypes)"
  offset = 0
  for e in entries:
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
