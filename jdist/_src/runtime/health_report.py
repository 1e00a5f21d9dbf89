"""Health reporting: a `Reporter` thread rewrites the file `jdist launch`
named ten times a second with `Monitor.health`, for the node's agent."""

from __future__ import annotations

import json
import os
import threading
from typing import Callable

from jdist._src.launcher.job_env import ENV_HEALTH_FILE

TICK_SECONDS = 0.1  # a write of ~100 bytes: the step it names is at most this old


class Reporter:
  """A daemon thread that rewrites `path` with `summary()` every `tick` s."""

  def __init__(self, path: str, summary: Callable[[], dict], *,
               tick: float = TICK_SECONDS):
    self._path = path
    self._summary = summary
    self._tick = tick
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jdist-health",
                                    daemon=True)
    self._thread.start()

  @classmethod
  def from_environment(cls, summary: Callable[[], dict]) -> "Reporter | None":
    """A reporter to the file `jdist launch` named, or None outside it."""
    path = os.environ.get(ENV_HEALTH_FILE)
    return cls(path, summary) if path else None

  def _run(self) -> None:
    beat = 0
    while True:
      beat += 1
      try:
        write_atomically(self._path, json.dumps({"n": beat, **self._summary()}))
      except OSError:
        pass  # the agent removed its directory: the job is ending
      if self._stop.wait(self._tick):
        return

  def stop(self) -> None:
    """Stops beating and says so: the process left the job (it may live on)."""
    self._stop.set()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout=5 * self._tick)
    try:
      write_atomically(self._path, json.dumps({"left": True}))
    except OSError:
      pass


def write_atomically(path: str, text: str) -> None:
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)
