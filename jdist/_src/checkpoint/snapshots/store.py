"""`Snapshots`: the in-memory snapshots of one `CheckpointManager` in a job.

`write` dispatches one program that packs this process's blocks (and the
copy for the next process); the next `save` hands the snapshot to the
writer thread, which writes the file while the loop goes on. At most one
snapshot is in flight.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jdist._src.checkpoint import peer_copy
from jdist._src.checkpoint.snapshots import agreement
from jdist._src.checkpoint.snapshots import files as files_lib
from jdist._src.checkpoint.snapshots import layout as layout_lib
from jdist._src.checkpoint.snapshots.naming import held
from jdist._src.checkpoint.snapshots.retention import Files
from jdist._src.checkpoint.snapshots.writer import Writer


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
    self._layouts_key, self._layouts = None, None
    self._files = Files(directory, self.rank, self.world)
    self._pending = None
    self._writer = Writer(f"jdist-snapshots-{self.rank}")
    self._peer = peer_copy.PeerCopy.for_this_job()
    # The processes whose parts the last agreement found only as replicas.
    self.from_replicas: list = []

  def write(self, step: int, names: list, leaves: list) -> None:
    """Takes snapshot `step` of `leaves` (every process calls it), after waiting
    for the one before; `flush` writes it.

    Raises:
      The error of the snapshot before it, if its writer failed.
    """
    self.flush()
    mine, before, plan = self._plan(names, leaves)
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
    """Writes this process's file of the last snapshot taken, if not yet
    written (with `wait=False`: hands it to the writer thread and returns
    None); returns whether it was written (not with NaN or infinite values).

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
      self._files.close_files()

  def _write(self, pending: tuple) -> bool:
    """Writes snapshot `pending` (see `flush`)."""
    step, layout, packed, host, before, received = pending
    if isinstance(received, int):  # one buffer: the part, then the copy
      both = np.asarray(packed.addressable_data(0))  # (spans the processes)
      packed, received = both[:received], both[received:]
    arrays = files_lib.checked(step, layout, packed, host)
    if arrays is None:
      return False
    if before is not None:  # the replica of the part of the process before
      data = files_lib.replica(step, before, received)
      if data is None:
        return False
      arrays.append(data)
    group = (int(step), self.attempt, self.world)
    # The last two snapshots this process wrote, and `group`: every process
    # has written the one before the last (`retention.py`).
    previous = self.complete
    self._files.keep_only({group, previous, self._before})
    self._files.put(group, files_lib.buffers(group, self.rank, layout.header,
                                             arrays))
    if previous != group:
      self._before, self.complete = previous, group
    if self._files.holds_all(group):  # the last part of `group` is in
      # (the files of the others too, when its own does not hold them all)
      others = set(held(self.rank, self.world)) != set(range(self.world))
      self._files.keep_only({group}, others=others)
    return True

  def _plan(self, names: list, leaves: list) -> tuple:
    """`layout.plan` of `leaves`, worked out once per state layout."""
    key = [(x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves]
    if self._layouts_key is None or self._layouts_key != (names, key):
      self._layouts_key = (list(names), key)
      self._layouts = layout_lib.plan(names, leaves, self.rank, self.world,
                                      self._peer)
    return self._layouts

  def clear(self) -> None:
    """Removes the snapshots on this host (see `Files.clear`)."""
    self._files.clear()
    self.complete = self._before = None

  def agree(self, newest_checkpoint: int | None = None) -> tuple:
    """`agreement.agree`, setting `from_replicas` (every process calls it)."""
    group, note, disk, self.from_replicas = agreement.agree(
        self.directory, newest_checkpoint)
    return group, note, disk

  def saved_shape(self, group, name: str) -> list | None:
    """`agreement.saved_shape` of leaf `name` in snapshot `group`."""
    return agreement.saved_shape(self._files, group, name)

  def read(self, group, described: dict) -> tuple:
    """`agreement.read` of snapshot `group` (every process calls it)."""
    return agreement.read(self._files, group, described)
