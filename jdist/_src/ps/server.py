"""`ParameterServer`: one parameter-server task's variables and their versions.

An object in this process (threads backend) or the body of a Ray actor. It
holds numpy arrays on the host, as TensorFlow's servers hold variables on
their CPU, and applies updates one at a time under a lock. Each set of
variables (one per `strategy.replicate`) has a version per server: the
updates applied to it. An update carries the version it was computed from
and is refused when more than `max_staleness` updates (or a restore) came
since; the worker then reads again and recomputes. The answer to an update
carries the values after it (one round trip per step). Arrays are replaced,
never changed in place, so a reader may keep what it read.
"""

from __future__ import annotations

import threading

import numpy as np

from jdist._src.errors import ParameterServerError

ADD = "add"        # numbers: the server adds the worker's change
ASSIGN = "assign"  # booleans and keys: the last update wins


def unanswered(index: int, address: str, timeout: float) -> ParameterServerError:
  """The error of a server that did not answer a call within `timeout`:
  one message for both backends."""
  return ParameterServerError(
      f"Parameter server {index} ({address}) did not answer within "
      f"timeout_seconds={timeout:g}: it hangs (stopped, or stuck in a call). "
      "Its variables cannot be read or updated: restart the cluster and "
      "restore the variables from a checkpoint.")


class ParameterServer:
  """The variables one parameter-server task holds.

  Args:
    index: the task's index among the parameter servers.
  """

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

    Args:
      set_id: the variable set.
      base_version: the version the worker read before computing `changes`.
      changes: `{shard id: array}`: the difference to add (ADD shards) or the
        new value (ASSIGN shards).
      max_staleness: the most updates that may have been applied since
        `base_version`.

    Returns:
      `(accepted, version, shards)`: whether the update was applied, the
      version after it (or now, if refused), and the set's pieces at that
      version (`{shard id: array}`).
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
    """Replaces the set's values (a restore); counts as one update.

    Updates computed from values read before it are refused from then on.
    """
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
