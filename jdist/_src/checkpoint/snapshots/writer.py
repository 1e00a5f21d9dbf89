"""The background thread that writes a process's snapshot files; its error
is raised on the loop's thread at the next call. At exit a write in flight
is waited for `EXIT_WAIT_SECONDS` at most."""

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
  """One daemon thread running one job at a time: `start` it, `wait` for it."""

  def __init__(self, name: str):
    self._name = name
    self._jobs: queue.SimpleQueue = queue.SimpleQueue()
    self._idle = threading.Event()
    self._idle.set()
    self._thread = None
    self._result, self._error = None, None

  def start(self, job) -> None:
    """Runs `job()` on the thread (the one before must have been waited for)."""
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
    """The last job's result (None if none or late); raises its error once."""
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
  """Waits a few seconds for a snapshot being written at exit."""
  for writer in list(_LIVE):
    try:
      writer.wait(EXIT_WAIT_SECONDS)
    except BaseException as e:  # noqa: BLE001 (the process is ending)
      print(f"jdist: an in-memory snapshot could not be written: {e!r}",
            file=sys.stderr, flush=True)
