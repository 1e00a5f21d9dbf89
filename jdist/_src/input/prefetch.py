"""Reading and placing batches ahead of the loop, in a background thread
that holds the iterator weakly (an abandoned iterator stops it)."""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Callable


class _Failure:
  __slots__ = ("error",)

  def __init__(self, error: BaseException):
    self.error = error


_END = object()


class BackgroundPrefetch:
  """Items of a bound `method` made `depth` ahead in a daemon thread."""

  def __init__(self, method: Callable, depth: int):
    self._queue = queue.Queue(maxsize=max(1, depth))
    self._stop = threading.Event()
    produce = weakref.WeakMethod(method)
    self._thread = threading.Thread(
        target=_run, args=(produce, self._queue, self._stop), daemon=True,
        name="jdist-input-prefetch")
    self._thread.start()
    weakref.finalize(method.__self__, self._stop.set)

  def next(self):
    """The next item, or None at the end (re-raises the thread's error)."""
    item = self._queue.get()
    if isinstance(item, _Failure):
      self._stop.set()
      raise item.error
    return None if item is _END else item

  def close(self) -> None:
    self._stop.set()


def _run(produce: weakref.WeakMethod, out: queue.Queue,
         stop: threading.Event) -> None:
  while not stop.is_set():
    method = produce()
    if method is None:  # the iterator is gone
      return
    try:
      item = method()
    except BaseException as e:  # handed to the loop, raised there
      item = _Failure(e)
    del method
    item = _END if item is None else item
    while not stop.is_set():
      try:
        out.put(item, timeout=0.1)
        break
      except queue.Full:
        continue
    if item is _END or isinstance(item, _Failure):
      return
