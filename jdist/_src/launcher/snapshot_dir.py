"""Where a `jdist launch` job keeps its in-memory snapshots: under /dev/shm
(or `JDIST_SNAPSHOT_ROOT`), named by `JDIST_RUN_ID`, which every attempt
shares; the launcher removes it when the job ends.

Example:
  >>> from jdist._src.launcher import snapshot_dir
  >>> snapshot_dir.job_directory("7f3a").split("/")[-1].startswith("jdist-snapshots-")
  True
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

ENV_ROOT = "JDIST_SNAPSHOT_ROOT"
PREFIX = "jdist-snapshots-"
_SHM = "/dev/shm"
_RUN_ID = re.compile(r"[A-Za-z0-9_.-]+")


def root() -> str:
  """The directory the jobs' snapshot directories go in."""
  chosen = os.environ.get(ENV_ROOT)
  if chosen:
    return chosen
  if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK):
    return _SHM
  return tempfile.gettempdir()


def job_directory(run_id: str) -> str:
  """The snapshot directory of job `run_id` for this user.

  Raises:
    ValueError: `run_id` is not a plain name (letters, digits, `-_.`).
  """
  if not _RUN_ID.fullmatch(run_id or "") or run_id in (".", ".."):
    raise ValueError(f"JDIST_RUN_ID={run_id!r} is not a plain name (letters, "
                     "digits, '-', '_', '.'); `jdist launch` sets it.")
  uid = os.getuid() if hasattr(os, "getuid") else 0
  return os.path.join(root(), f"{PREFIX}{uid}-{run_id}")


def remove(run_id: str | None) -> None:
  """Removes job `run_id`'s snapshots from this host (nothing if none)."""
  if run_id:
    shutil.rmtree(job_directory(run_id), ignore_errors=True)
