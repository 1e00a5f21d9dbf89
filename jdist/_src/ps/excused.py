"""The time that does not count against a worker's `timeout_seconds`:
compiling, and waiting for a parameter server (whose own deadline decides,
so a stuck server is blamed, not its workers)."""

from __future__ import annotations

import threading
import time
import weakref

import jax.monitoring

# JAX's phases of making an executable: each records its start (a scalar)
# and its duration, in the thread that runs it.
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration"})


class ExcusedTime:
  """Per thread, the time excused from a worker's timeout (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._total = weakref.WeakKeyDictionary()  # thread -> seconds, ended
    self._since = weakref.WeakKeyDictionary()  # thread -> (start, depth)

  def begin(self, thread: threading.Thread) -> None:
    with self._lock:
      start, depth = self._since.get(thread, (time.monotonic(), 0))
      self._since[thread] = (start, depth + 1)

  def end(self, thread: threading.Thread) -> None:
    with self._lock:
      if thread not in self._since:
        return  # its start was not seen
      start, depth = self._since.pop(thread)
      if depth > 1:
        self._since[thread] = (start, depth - 1)
      else:
        self._total[thread] = (self._total.get(thread, 0.0) +
                               time.monotonic() - start)

  def seconds(self, thread: threading.Thread) -> float:
    """The excused seconds of `thread` so far, the current phase included."""
    with self._lock:
      seconds = self._total.get(thread, 0.0)
      if thread in self._since:
        seconds += time.monotonic() - self._since[thread][0]
      return seconds

  def active(self, thread: threading.Thread) -> bool:
    """Whether `thread` is in an excused phase now."""
    with self._lock:
      return thread in self._since

  def clock(self, thread: threading.Thread) -> float:
    """A clock of `thread` that stands still while its time is excused."""
    return time.monotonic() - self.seconds(thread)


EXCUSED = ExcusedTime()
_listening = threading.Lock()
_listeners: list = []


def _on_scalar(event: str, value, **kwargs) -> None:
  del value, kwargs
  if event in _COMPILE_EVENTS:
    EXCUSED.begin(threading.current_thread())


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  if event in _COMPILE_EVENTS:
    EXCUSED.end(threading.current_thread())


def listen_to_compiles() -> None:
  """Counts JAX's compilations as excused time (once per process)."""
  with _listening:
    if not _listeners:
      jax.monitoring.register_scalar_listener(_on_scalar)
      jax.monitoring.register_event_duration_secs_listener(_on_duration)
      _listeners.append(True)
