"""A process's snapshot files: which it keeps, which it removes, and the
spare it writes the next snapshot over.

A process removes every file but its last two snapshots' and the new one's,
when it writes one: all processes have written the one before its last.
Why, with the writing in the background: a process's writer writes snapshot
k only once its blocks are there, that is once the step that computed them
has run, and that step needed every process's collectives; each process
dispatches that step (later than snapshot k-1's) after its `write` of
snapshot k-1, which waited for its writer to finish snapshot k-2: so every
process's part of k-2 is there. The process that completes a snapshot (its
file and the files of the others it finds hold all of its parts; at 2
processes its own file does, and it looks for no other) removes the older
ones it wrote, and, when its own file does not hold all the parts, those
the other processes wrote. So at rest the directory holds the newest
complete snapshot (on one machine; across hosts, until the next two
snapshots, also the ones before it), and the launcher removes the directory
when the job ends.

A process lists the directory once, at its first write (the files of earlier
attempts, the temporary files of writers that died); after that it removes
the files it wrote, by name. It keeps its files open; when one's snapshot is
old, it does not remove it but renames it back to its temporary name and
writes the next snapshot over it (its spare: no file made or removed, no
page of memory taken anew; at most `SPARE_BYTES`, a larger file is
removed; `close_files` and `clear` remove the spare).
"""

from __future__ import annotations

import os

from jdist._src.checkpoint.snapshots import files as files_lib
from jdist._src.checkpoint.snapshots.naming import held, parse, part_name
from jdist._src.checkpoint.snapshots.naming import tmp_name
from jdist._src.launcher import liveness

# The largest file a process keeps as its spare, to write the next snapshot
# over (a larger one is removed: the spare holds as much memory as the file).
SPARE_BYTES = 1 << 20


class Files:
  """The snapshot files process `rank` of `world` writes in `directory`.

  Example:
    Process 0 of 3 writes its file of step 3 (its part, and the replica of
    process 2's); part 1 is not on this host until process 1's file is:

    >>> import tempfile
    >>> from jdist._src.checkpoint.snapshots.retention import Files
    >>> files = Files(tempfile.mkdtemp(), rank=0, world=3)
    >>> files.put((3, 0, 3), [b"data"])
    >>> files.holds_all((3, 0, 3))
    False
    >>> open(files.path((3, 0, 3), 1), "wb").close()
    >>> files.holds_all((3, 0, 3))
    True
  """

  def __init__(self, directory: str, rank: int, world: int):
    self.directory = directory
    self.rank, self.world = rank, world
    self._prefix = os.path.join(directory, "")  # (of its files' paths)
    # The temporary name of the file this process is writing.
    self._tmp = self._prefix + tmp_name(rank)
    # The files this process wrote, by snapshot, since it last listed the
    # directory (`_swept`: at its first write): `{group: (path, fd,
    # size)}`, each file kept open: once old, it becomes the spare, `(fd,
    # size)`, that the next snapshot is written over.
    self._written: dict = {}
    self._spare = None
    self._swept = False

  def path(self, group, rank: int) -> str:
    """The file of process `rank` of snapshot `group`."""
    return self._prefix + part_name(*group[:2], rank, group[2])

  def holds_all(self, group) -> bool:
    """Whether this host holds every part of `group` (in its files or as
    their replicas), looking only at the files it needs to."""
    found = set(held(self.rank, self.world))
    for r in range(self.world):  # part r: in file r, or in r + 1's
      for k in () if r in found else (r, (r + 1) % self.world):
        if os.path.exists(self.path(group, k)):
          found.update(held(k, self.world))
          break
    return len(found) == self.world

  def keep_only(self, keep: set, others: bool = False) -> None:
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
      self.remove(entries, keep)
      self._swept = True
    for group in [g for g in self._written if g not in keep]:
      path, fd, size = self._written.pop(group)
      if (not others and self._spare is None and fd is not None
          and size <= SPARE_BYTES):
        self._retire(path, fd, size)
        continue
      files_lib.close(fd)
      for path in ([path] if not others else
                   [self.path(group, r) for r in range(self.world)]):
        try:
          os.unlink(path)
        except FileNotFoundError:
          pass  # another process of this host removed it first

  def _retire(self, path: str, fd: int, size: int) -> None:
    """Makes this process's file of an old snapshot its spare: renamed to
    its temporary name (which no reader takes), kept open, and written
    over with the next snapshot (`put`): no file made or removed, and no
    page of memory taken anew, a snapshot."""
    try:
      os.rename(path, self._tmp)
      self._spare = (fd, size)
    except FileNotFoundError:  # the directory was removed
      os.close(fd)

  def put(self, group, buffers: list) -> None:
    """Writes this process's file of snapshot `group` (`buffers`, as
    `files.buffers` makes them) under a temporary name (over the spare, if
    there is one), renamed when complete."""
    tmp, path = self._tmp, self.path(group, self.rank)
    spare, self._spare = self._spare, None
    try:
      fd, size = files_lib.write_all(tmp, buffers, spare)
    except FileNotFoundError:  # removed by a launcher that left the job
      os.makedirs(self.directory, exist_ok=True)
      fd, size = files_lib.write_all(tmp, buffers)
    try:
      os.replace(tmp, path)
    except FileNotFoundError:  # the spare, removed with the directory
      os.close(fd)
      os.makedirs(self.directory, exist_ok=True)
      fd, size = files_lib.write_all(tmp, buffers)
      os.replace(tmp, path)
    self._written[group] = (path, fd, size)

  def close_files(self) -> None:
    """Closes the files this process keeps open (it forgets them), and
    removes its spare."""
    if self._spare is not None:
      os.close(self._spare[0])
      try:
        os.unlink(self._tmp)
      except FileNotFoundError:
        pass  # (the directory was removed)
    for _, fd, _ in self._written.values():
      files_lib.close(fd)
    self._spare = None
    self._written = {k: (path, None, 0) for k, (path, _, _) in
                     self._written.items()}

  def remove(self, entries: list, keep: set) -> None:
    """Removes, of `entries`, the files of the snapshots not in `keep`, and
    the temporary files of writers that died."""
    for entry in entries:
      group, _, pid = parse(entry)
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
    self.close_files()
    self.remove(os.listdir(self.directory), keep=set())
    self._written, self._swept = {}, False
