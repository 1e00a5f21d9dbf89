"""The names of the snapshot files: one per process and snapshot,
`step-<step>.attempt-<attempt>.part-<rank>-of-<world>.snap` (a snapshot's
group is `(step, attempt, world)`), and `.tmp-<rank>-<pid>.snap` while
written, which no reader takes."""

from __future__ import annotations

import functools
import os
import re

MAGIC = b"JDSNAP1\n"  # the first bytes of every file
_PART = re.compile(r"step-(\d+)\.attempt-(\d+)\.part-(\d+)-of-(\d+)\.snap")
_TMP = re.compile(r"\.tmp-(\d+)-(\d+)\.snap")  # the writer's rank and pid


@functools.lru_cache(maxsize=1024)
def parse(entry: str) -> tuple:
  """`(group, rank, pid)` of a directory entry: a part's group and rank (else
  None each), a temporary file's writer's pid (else None)."""
  m = _PART.fullmatch(entry)
  if m:
    return (int(m[1]), int(m[2]), int(m[4])), int(m[3]), None
  tmp = _TMP.fullmatch(entry)
  return None, None, (int(tmp[2]) if tmp else None)


def groups(entries) -> list:
  """`[((step, attempt, world), rank)]` of the parts among `entries`."""
  return [parsed[:2] for parsed in map(parse, entries) if parsed[0]]


def part_name(step: int, attempt: int, rank: int, world: int) -> str:
  """The file of process `rank` of snapshot `step`.

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
  """The processes whose parts the file of process `rank` holds."""
  return (rank,) if world == 1 else (rank, (rank - 1) % world)
