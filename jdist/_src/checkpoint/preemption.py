"""Noticing preemption (SIGTERM) and agreeing on the step to stop at.

With several processes, JAX's runtime catches SIGTERM and
`reached_preemption_sync_point(step)` is True on every process at the same
step; in one process, a SIGTERM handler sets a flag.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

from jdist._src import jax_compat

def _distributed_client() -> bool:
  state = jax_compat.distributed_state()
  return (getattr(state, "client", None) is not None and
          getattr(state, "preemption_sync_manager", None) is not None)


class PreemptionWatcher:
  """Tells the training loop when to save and stop.

  Example:
    >>> from jdist._src.checkpoint.preemption import PreemptionWatcher
    >>> watcher = PreemptionWatcher()
    >>> watcher.reached(0)
    False
    >>> watcher.close()
  """

  def __init__(self):
    self._flag = False
    self._handled = False
    self._previous = None
    self._multi = jax.process_count() > 1 and _distributed_client()
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._flag = True

  def reached(self, step: int) -> bool:
    """Whether to save and stop after `step` (every process, every step)."""
    if self._multi:
      return bool(multihost_utils.reached_preemption_sync_point(step))
    return self._flag

  def handled(self) -> None:
    """Marks the SIGTERM as dealt with (saved and exiting)."""
    self._handled = True

  def close(self) -> None:
    """Puts back the previous SIGTERM handler, and sends again a SIGTERM that
    came too late to stop training at a step."""
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
      if self._flag and not self._handled:
        os.kill(os.getpid(), signal.SIGTERM)
