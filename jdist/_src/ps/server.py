"""`ParameterServer`: one parameter-server task's variables and their versions.

Updates are applied one at a time under a lock; an update computed from a
version more than `max_staleness` updates (or a restore) old is refused.
Arrays are replaced, never changed in place, so a reader may keep them.
"""

from __future__ import annotations

import threading

import numpy as np

from jdist._src.errors import ParameterServerError

ADD = "add"        # numbers: the server adds the worker's change
ASSIGN = "assign"  # booleans and keys: the last update wins


def unanswered(index: int, address: str, timeout: float) -> ParameterServerError:
  """The error of a server that did not answer a call within `timeout`."""
  return ParameterServerError(
      f"Parameter server {index} ({address}) did not answer within "
      f"timeout_seconds={timeout:g}: it hangs (stopped, or stuck in a call). "
      "Its variables cannot be read or updated: restart the cluster and "
      "restore the variables from a checkpoint.")


class ParameterServer:
  """The variables one parameter-server task (`index`) holds."""

  def __init__(self, index: int = 0):
    self.index = index
    self._lock = threading.Lock()
    self._sets: dict = {}      # set id -> {shard id: array}
    self._kinds: dict = {}     # set id -> {shard id: ADD or ASSIGN}
    self._versions: dict = {}  # set id -> updates applied
    self._assigned: dict = {}  # set id -> the version its last assign made
    self._refused = 0

  def ping(self) -> int:
    """Answers while the server lives (the Ray backend's health check)."""
    return self.index

  def create(self, set_id: str, shards: dict, kinds: dict) -> None:
    """Holds `shards` (`{shard id: array}`) as the variable set `set_id`."""
    with self._lock:
      self._sets[set_id] = {k: np.array(v) for k, v in shards.items()}
      self._kinds[set_id] = dict(kinds)
      self._versions[set_id] = 0
      self._assigned[set_id] = 0

  def delete(self, set_id: str) -> None:
    with self._lock:
      self._sets.pop(set_id, None)
      self._kinds.pop(set_id, None)
      self._versions.pop(set_id, None)
      self._assigned.pop(set_id, None)

  def version(self, set_id: str) -> int:
    with self._lock:
      return self._versions[self._known(set_id)]

  def read(self, set_id: str) -> tuple:
    """`(version, {shard id: array})`: the set as it is now."""
    with self._lock:
      return self._versions[self._known(set_id)], dict(self._sets[set_id])

  def push(self, set_id: str, base_version: int, changes: dict,
           max_staleness: int) -> tuple:
    """Applies a worker's update if it is fresh enough.

    `changes` are per shard the difference to add (ADD) or the new value
    (ASSIGN), computed from `base_version`. Returns `(accepted, version,
    shards)`: the version after it (or now) and the pieces at that version.
    """
    with self._lock:
      version = self._versions[self._known(set_id)]
      shards = self._sets[set_id]
      if (version - base_version > max_staleness or
          base_version < self._assigned[set_id]):
        self._refused += 1
        return False, version, dict(shards)
      kinds = self._kinds[set_id]
      for k, change in changes.items():
        if kinds[k] == ADD:
          old = shards[k]
          shards[k] = (old + np.asarray(change)).astype(old.dtype, copy=False)
        else:
          shards[k] = np.array(change)
      self._versions[set_id] = version + 1
      return True, version + 1, dict(shards)

  def assign(self, set_id: str, shards: dict) -> int:
    """Replaces the set's values (a restore), as one update that refuses the
    updates computed before it."""
    with self._lock:
      self._known(set_id)
      self._sets[set_id] = {k: np.array(v) for k, v in shards.items()}
      self._versions[set_id] += 1
      self._assigned[set_id] = self._versions[set_id]
      return self._versions[set_id]

  def stats(self) -> dict:
    """How many updates were refused as too stale, and the sets' versions."""
    with self._lock:
      return {"refused": self._refused, "versions": dict(self._versions)}

  def _known(self, set_id: str) -> str:
    if set_id not in self._sets:
      raise KeyError(
          f"Parameter server {self.index} holds no variables {set_id!r}: they "
          "were deleted, or the server restarted and lost them.")
    return set_id
