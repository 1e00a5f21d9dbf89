"""The background thread that writes a process's snapshot files.

One daemon thread per `Snapshots` runs one job at a time (writing the
snapshot taken last) while the training loop goes on; the job's error is
raised on the loop's thread at its next call, never lost. At the process's
exit, a write in flight is waited for a few seconds (`EXIT_WAIT_SECONDS`):
the thread is a daemon, so a write stuck on a dead peer's copy does not
hold the exit, and a part it did not finish is a temporary file that no
reader takes.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import weakref

# How long a process's exit waits for a snapshot being written.
EXIT_WAIT_SECONDS = 10.0
_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # the writers to wait for at exit


class Writer:
  """One background daemon thread that runs one job at a time: `start` a
  job, `wait` for it (its result, or its error raised here)."""

  def __init__(self, name: str):
    self._name = name
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._idle = threading.Event()
    self._idle.set()
    self._thread = None
    self._result, self._error = None, None

  def start(self, job) -> None:
    """Runs `job()` on the thread (the one before must have been waited
    for)."""
    if not self._idle.is_set():
      raise RuntimeError("a snapshot is already being written")
    if self._thread is None:
      global _AT_EXIT
      if not _AT_EXIT:
        # Registered now, it runs before the exit handlers registered
        # earlier (the JAX runtime's shutdown: a write may need the runtime).
        _AT_EXIT = True
        atexit.register(_wait_at_exit)
      self._thread = threading.Thread(target=self._run, name=self._name,
                                      daemon=True)
      self._thread.start()
      _LIVE.add(self)
    self._idle.clear()
    self._jobs.put(job)

  def _run(self) -> None:
    while True:
      job = self._jobs.get()
      if job is None:
        return
      try:
        self._result, self._error = job(), None
      except BaseException as e:  # raised on the training thread by `wait`
        self._result, self._error = None, e
      job = None  # the snapshot's arrays: not kept alive until the next one
      self._idle.set()

  @property
  def busy(self) -> bool:
    return not self._idle.is_set()

  @property
  def failed(self) -> bool:
    """Whether the last job raised an error that `wait` has not raised."""
    return self._error is not None

  def wait(self, timeout: float | None = None):
    """The last job's result (None if none, or not done in `timeout`);
    raises its error, once."""
    if not self._idle.wait(timeout):
      return None
    error, self._error = self._error, None
    result, self._result = self._result, None
    if error is not None:
      raise error
    return result

  def stop(self) -> None:
    """Ends the thread (after waiting for its job)."""
    if self._thread is not None:
      self._jobs.put(None)
      self._thread = None
      _LIVE.discard(self)


_AT_EXIT = False  # whether `_wait_at_exit` is registered


def _wait_at_exit() -> None:
  """A snapshot being written as the process exits: waited for (a few
  seconds at most), its error printed."""
  for writer in list(_LIVE):
    try:
      writer.wait(EXIT_WAIT_SECONDS)
    except BaseException as e:  # noqa: BLE001 (the process is ending)
      print(f"jdist: an in-memory snapshot could not be written: {e!r}",
            file=sys.stderr, flush=True)
