"""Which snapshot every process restores, and reading it.

The processes exchange which parts each host holds, take the newest
snapshot every part of which exists somewhere, read it, and exchange whether
each could; else all fall back to the persistent directory. Each assembles
every leaf whole and cuts its own shards, so the process count may change.
"""

from __future__ import annotations

import json
import os

import numpy as np

from jdist._src.checkpoint.snapshots import files as files_lib
from jdist._src.checkpoint.snapshots.naming import groups, held
from jdist._src.runtime import runtime as runtime_lib


def _seen(directory: str) -> dict:
  """`{(step, attempt, world): ({ranks}, {ranks})}`: the processes whose
  parts, and whose replicas, are on this host."""
  seen: dict = {}
  for group, rank in groups(os.listdir(directory)):
    parts, replicas = seen.setdefault(group, (set(), set()))
    parts.add(rank)
    replicas.update(held(rank, group[2])[1:])
  return seen


def agree(directory: str, newest_checkpoint: int | None = None) -> tuple:
  """`(group, note, newest_checkpoint, from_replicas)`, the same on every
  process: the newest complete snapshot `(step, attempt, world)` or None, why
  newer ones are not used, the newest persistent step any process sees, and
  the processes whose parts only replicas hold."""
  mine = [[*g, sorted(p), sorted(r)] for g, (p, r) in _seen(directory).items()]
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
  from_replicas = [] if best is None else sorted(replicas[best] - parts[best])
  newer = sorted(g for g in holding if best is None or g[0] > best[0])
  notes = [f"the snapshot of step {s} (attempt {a}) lacks the parts of "
           f"processes {sorted(set(range(w)) - holding[(s, a, w)])} of {w}"
           for s, a, w in newer]
  return best, "; ".join(notes), max(disk, default=None), from_replicas


def _parts(files, group) -> list:
  """The files of `group` on this host to read, this process's own first."""
  world = group[2]
  paths, found = [], set()
  for r in sorted(range(world), key=lambda r: r != files.rank):  # own first
    for k in () if r in found else (r, (r + 1) % world):
      path = files.path(group, k)
      if os.path.exists(path):
        paths.append(path)
        found.update(held(k, world))
        break
  return paths


def saved_shape(files, group, name: str) -> list | None:
  """The shape of leaf `name` in snapshot `group`, from a header, or None."""
  paths = _parts(files, group)
  return files_lib.header_shape(paths[0], name) if paths else None


def read(files, group, described: dict) -> tuple:
  """`(leaves, problem)`: each leaf of `described` (`{name: [shape, dtype]}`)
  whole, as numpy, from snapshot `group`; or `(None, why)`. Every process
  calls it: all read it, or none does."""
  leaves, problem = _read(files, group, described)
  runtime = runtime_lib.current()
  key = f"jdist/snapshot_read/{runtime.next_sequence('snapshot_read')}/"
  problems = runtime.exchange(key, problem or "", timeout=None,
                              what="reading the in-memory snapshot")
  problems = [p for _, p in sorted(problems.items()) if p]
  return (None, problems[0]) if problems else (leaves, None)


def _read(files, group, described: dict) -> tuple:
  full = {n: np.empty(s, files_lib.dtype(d)) for n, (s, d) in described.items()}
  covered = {n: np.zeros(s, bool) for n, (s, _) in described.items()}
  for path in _parts(files, group):
    try:
      with open(path, "rb") as f:
        raw = f.read()
    except OSError as e:
      return None, f"{os.path.basename(path)} cannot be read ({e})"
    problem = files_lib.fill(raw, described, full, covered)
    if problem:
      return None, f"{os.path.basename(path)} {problem}"
    if all(c.all() for c in covered.values()):
      return list(full.values()), None
  missing = [n for n, c in covered.items() if not c.all()]
  return None, (f"process {files.rank}'s host lacks the parts that hold "
                f"{', '.join(missing[:3])}")
