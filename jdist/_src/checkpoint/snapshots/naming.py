"""The names of the snapshot files, and what the name of each says.

One file per process and snapshot:
`step-<step>.attempt-<attempt>.part-<rank>-of-<world>.snap`. It holds the
process's part and, in a job of several processes, after it, the replica of
the part of the process before it (`rank - 1 mod world`). A snapshot (a
step, written by the processes of one attempt) is identified by its group
`(step, attempt, world)`. A file being written has a temporary name,
`.tmp-<rank>-<pid>.snap`, which no reader takes; its rename makes it a part.
"""

from __future__ import annotations

import functools
import os
import re

MAGIC = b"JDSNAP1\n"  # the first bytes of every file
_PART = re.compile(r"step-(\d+)\.attempt-(\d+)\.part-(\d+)-of-(\d+)\.snap")
_TMP = re.compile(r"\.tmp-(\d+)-(\d+)\.snap")  # the writer's rank and pid


@functools.lru_cache(maxsize=1024)
def parse(entry: str) -> tuple:
  """`(group, rank, pid)` of a directory entry: a process's file's
  snapshot `(step, attempt, world)` and process (else None each), and a
  temporary file's writer's pid (else None). Cached: the writer looks at
  the same names snapshot after snapshot."""
  m = _PART.fullmatch(entry)
  if m:
    return (int(m[1]), int(m[2]), int(m[4])), int(m[3]), None
  tmp = _TMP.fullmatch(entry)
  return None, None, (int(tmp[2]) if tmp else None)


def groups(entries) -> list:
  """`[((step, attempt, world), rank)]` of the processes' files among
  `entries`."""
  return [parsed[:2] for parsed in map(parse, entries) if parsed[0]]


def part_name(step: int, attempt: int, rank: int, world: int) -> str:
  """The file of process `rank` of snapshot `step`: its part, and in a job
  of several processes the replica of process `(rank - 1) % world`'s.

  Example:
    >>> from jdist._src.checkpoint.snapshots.naming import part_name
    >>> part_name(12, 0, 1, 2)
    'step-000000000012.attempt-0.part-1-of-2.snap'
  """
  return f"step-{step:012d}.attempt-{attempt}.part-{rank}-of-{world}.snap"


def tmp_name(rank: int) -> str:
  """The temporary name of the file this process (`rank`) writes."""
  return f".tmp-{rank}-{os.getpid()}.snap"


def held(rank: int, world: int) -> tuple:
  """The processes whose parts the file of process `rank` holds: its own,
  and the one before it (its replica)."""
  return (rank,) if world == 1 else (rank, (rank - 1) % world)
