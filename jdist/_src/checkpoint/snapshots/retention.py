"""A process's snapshot files: which it keeps, and the spare it writes the
next snapshot over.

Writing snapshot k keeps only the last two snapshots and k: the step that
computed k needed every process, each dispatched after its write of k-2
was done. An old file of at most `SPARE_BYTES` is written over.
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
    """Whether this host holds every part of `group` (in files or replicas)."""
    found = set(held(self.rank, self.world))
    for r in range(self.world):  # part r: in file r, or in r + 1's
      for k in () if r in found else (r, (r + 1) % self.world):
        if os.path.exists(self.path(group, k)):
          found.update(held(k, self.world))
          break
    return len(found) == self.world

  def keep_only(self, keep: set, others: bool = False) -> None:
    """Removes the files of the snapshots not in `keep` (at the first write, any
    in the directory and those of dead writers; then this process's own; with
    `others`, the other processes' files of those snapshots too)."""
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
    """Makes this process's file of an old snapshot its spare."""
    try:
      os.rename(path, self._tmp)
      self._spare = (fd, size)
    except FileNotFoundError:  # the directory was removed
      os.close(fd)

  def put(self, group, buffers: list) -> None:
    """Writes this process's file of snapshot `group`, renamed when complete."""
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
    """Closes the files this process keeps open, and removes its spare."""
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
    """Removes, of `entries`, old snapshots' files and dead writers' files."""
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
    """Removes the snapshots on this host (every process calls it, after a
    collective entered once every process wrote its last, such as `agree`)."""
    self.close_files()
    self.remove(os.listdir(self.directory), keep=set())
    self._written, self._swept = {}, False
