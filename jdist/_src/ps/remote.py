"""Scheduled functions, their results, and the queue that hands them out
(`ClosureQueue`: the first error cancels the queued closures, as in
TensorFlow)."""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import jax
import numpy as np

from jdist._src.errors import CancelledError


def to_numpy(tree: Any) -> Any:
  """Array leaves as numpy arrays (what `fetch()` returns)."""
  def leaf(x):
    if isinstance(x, jax.Array):
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
      return np.asarray(x)
    return x
  return jax.tree.map(leaf, tree)


class RemoteValue:
  """The result of a scheduled function, available once it has run.

  Example:
    >>> import jdist
    >>> strategy = jdist.ParameterServerStrategy(
    ...     jdist.cluster_resolver.LocalClusterResolver(num_workers=1, num_ps=1))
    >>> coordinator = jdist.ClusterCoordinator(strategy)
    >>> result = coordinator.schedule(lambda: 6 * 7)
    >>> result.fetch()
    42
    >>> coordinator.shutdown()
  """

  def __init__(self):
    self._done = threading.Event()
    self._value = None
    self._error = None

  # The coordinator's side (as `concurrent.futures.Future.set_result`):
  # the closure queue completes the value once; users only read it.

  def set_result(self, value: Any) -> None:
    """Completes the value with the function's result (the coordinator)."""
    self._value = value
    self._done.set()

  def set_exception(self, error: BaseException) -> None:
    """Completes the value with the function's error (the coordinator)."""
    self._error = error
    self._done.set()

  def cancel(self) -> None:
    """Completes a pending value as cancelled (`get()` raises
    `jdist.CancelledError`)."""
    if not self._done.is_set():
      self.set_exception(CancelledError(
          "This function was cancelled: an earlier scheduled function failed "
          "and join(), done() or schedule() raised its error. Schedule it "
          "again if it should still run."))

  def done(self) -> bool:
    """Whether the function has finished (run, failed or been cancelled)."""
    return self._done.is_set()

  def get(self) -> Any:
    """Waits for the result and returns it as the worker produced it.

    Raises:
      The function's error, or `jdist.CancelledError` if it was cancelled.
    """
    self._done.wait()
    if self._error is not None:
      raise self._error
    return self._value

  def fetch(self) -> Any:
    """Waits for the result and returns it with arrays as numpy arrays.

    Raises:
      The function's error, or `jdist.CancelledError` if it was cancelled.
    """
    return to_numpy(self.get())

  def __getitem__(self, index) -> "RemoteValue":
    """The remote value of `result[index]`."""
    return _Element(self, index)

  def __repr__(self) -> str:
    state = ("pending" if not self.done() else
             "failed" if self._error is not None else "done")
    return f"<RemoteValue {state}>"


class _Element(RemoteValue):
  """One element of a `RemoteValue` that holds a sequence or a dict."""

  def __init__(self, parent: RemoteValue, index):
    self._parent = parent
    self._index = index

  def done(self) -> bool:
    return self._parent.done()

  def get(self) -> Any:
    return self._parent.get()[self._index]


class Closure:
  """One scheduled function with its arguments and its `RemoteValue`."""

  def __init__(self, fn: Callable, args: tuple, kwargs: dict):
    self.fn = fn
    self.args = args
    self.kwargs = kwargs
    self.result = RemoteValue()
    self.attempts = 0  # runs started (more than one after a worker failed)


class ClosureQueue:
  """The scheduled closures: queued, in flight, and the first error."""

  def __init__(self):
    self._lock = threading.Lock()
    self._changed = threading.Condition(self._lock)
    self._queue: collections.deque = collections.deque()
    self._in_flight = 0
    self._error: BaseException | None = None
    self._aborted: BaseException | None = None
    self._stopped = False

  def put(self, closure: Closure) -> None:
    """Queues `closure`; raises the first error of earlier closures, if any."""
    with self._lock:
      self._raise_if_error()
      self._queue.append(closure)
      self._changed.notify_all()

  def get(self, block: bool = True) -> Closure | None:
    """The next closure to run; None when stopped (or none is ready now)."""
    with self._lock:
      if not self._changed.wait_for(
          lambda: self._stopped or (self._queue and self._error is None),
          timeout=None if block else 0):
        return None
      if self._stopped:
        return None
      self._in_flight += 1
      return self._queue.popleft()

  def finished(self, closure: Closure, value: Any) -> None:
    with self._lock:
      closure.result.set_result(value)
      self._in_flight -= 1
      self._changed.notify_all()

  def failed(self, closure: Closure, error: BaseException) -> None:
    """The closure raised: its error goes to its result and to `join()`."""
    with self._lock:
      closure.result.set_exception(error)
      if self._error is None:
        self._error = error
      self._in_flight -= 1
      self._changed.notify_all()

  def put_back(self, closure: Closure) -> bool:
    """The closure's worker failed: it runs again first, on another worker;
    returns False when an error or a shutdown cancelled it."""
    with self._lock:
      self._in_flight -= 1
      again = (self._error is None and not self._stopped and
               self._aborted is None)
      if again:
        self._queue.appendleft(closure)
      else:
        closure.result.cancel()
      self._changed.notify_all()
      return again

  def wait(self, timeout: float | None = None) -> bool:
    """Waits until nothing is queued or in flight and raises the first error;
    False if `timeout` passed first."""
    with self._lock:
      ok = self._changed.wait_for(
          lambda: self._stopped or self._aborted is not None or (
              self._in_flight == 0 and (self._error is not None or
                                        not self._queue)),
          timeout=timeout)
      if ok:
        self._raise_if_error()
      return ok

  def done(self) -> bool:
    with self._lock:
      self._raise_if_error()
      return not self._queue and self._in_flight == 0

  def fail_all(self, error: BaseException) -> None:
    """No worker is left: every queued closure fails with `error`."""
    with self._lock:
      if self._error is None:
        self._error = error
      while self._queue:
        self._queue.popleft().result.set_exception(error)
      self._changed.notify_all()

  def abort(self, error: BaseException) -> None:
    """A failure nothing recovers from: queued closures are cancelled, and every
    later wait, `done()` and `put()` raises `error`."""
    with self._lock:
      if self._aborted is None:
        self._aborted = error
      while self._queue:
        self._queue.popleft().result.cancel()
      self._changed.notify_all()

  def stop(self) -> None:
    """Wakes every waiter; queued closures are cancelled."""
    with self._lock:
      self._stopped = True
      while self._queue:
        self._queue.popleft().result.cancel()
      self._changed.notify_all()

  @property
  def error(self) -> BaseException | None:
    return self._error

  def _raise_if_error(self) -> None:
    """Raises the first error once (lock held), after the closures in flight
    ended, cancelling the queued ones; an abort's error every time."""
    if self._aborted is not None:
      raise self._aborted
    if self._error is None:
      return
    self._changed.wait_for(lambda: self._in_flight == 0)
    if self._error is None:  # another caller raised it meanwhile
      return
    while self._queue:
      self._queue.popleft().result.cancel()
    error, self._error = self._error, None
    raise error
