"""`ClusterCoordinator`: schedules functions on workers, TensorFlow's contract.

A function whose worker fails or hangs runs again on another ("at least
once") and the worker is restarted; a function's error reaches `join()` and
cancels the queued ones; a server's failure does so at once.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable

import jax

from jdist._src.errors import ParameterServerError, WorkerFailedError
from jdist._src.ps.datasets import PerWorkerDataset
from jdist._src.ps.remote import Closure, ClosureQueue, RemoteValue
from jdist._src.ps.variables import ServerVariables

# A function whose worker failed this many times (per worker of the cluster)
# fails itself: a function that kills every worker it runs on would otherwise
# be retried forever.
ATTEMPTS_PER_WORKER = 3

_log = logging.getLogger(__name__)


class ClusterCoordinator:
  """Schedules functions on a `ParameterServerStrategy`'s workers.

  One per strategy (the first starts the cluster); `shutdown()` stops it.

  Args:
    strategy: a `jdist.ParameterServerStrategy`.

  Example:
    >>> import jdist, numpy as np
    >>> strategy = jdist.ParameterServerStrategy(
    ...     jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1))
    >>> with jdist.ClusterCoordinator(strategy) as coordinator:
    ...   dataset = coordinator.create_per_worker_dataset(
    ...       lambda: (np.full((4, 1), 1.0, np.float32) for _ in range(100)))
    ...   iterator = iter(dataset)
    ...   def fn(iterator):
    ...     return strategy.reduce("sum", next(iterator), axis=0)
    ...   results = [coordinator.schedule(fn, args=(iterator,)) for _ in range(6)]
    ...   coordinator.join()
    ...   [float(r.fetch()[0]) for r in results]
    [4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
  """

  def __new__(cls, strategy):
    attached = getattr(strategy, "attached_coordinator", None)
    if not callable(getattr(strategy, "attach_coordinator", None)):
      raise TypeError(
          f"ClusterCoordinator works with jdist.ParameterServerStrategy, got "
          f"{type(strategy).__name__}. Synchronous strategies run steps "
          "directly: call the step, or strategy.run(fn, args).")
    if attached is not None:
      return attached  # one per strategy; __init__ sees it is started
    return super().__new__(cls)

  def __init__(self, strategy):
    if getattr(self, "_strategy", None) is not None:
      return  # the strategy's coordinator, made before
    self._strategy = strategy
    # The handshake: the strategy records its coordinator and starts the
    # servers and workers of its backend.
    self._cluster = strategy.attach_coordinator(self)
    self._queue = ClosureQueue()
    self._closed = False
    self._lock = threading.Lock()
    workers = list(self._cluster.workers)
    self._alive = len(workers)
    self._max_attempts = ATTEMPTS_PER_WORKER * max(len(workers), 1)
    self._threads = [threading.Thread(target=self._serve, args=(w,),
                                      name=f"jdist-worker-{w.index}",
                                      daemon=True) for w in workers]
    for t in self._threads:
      t.start()
    self._cluster.watch(self._join)  # workers that join later

  # --- TensorFlow's API --------------------------------------------------------

  @property
  def strategy(self):
    """The `ParameterServerStrategy` this coordinator schedules for."""
    return self._strategy

  def schedule(self, fn: Callable, args=(), kwargs=None) -> RemoteValue:
    """Queues `fn(*args, **kwargs)` to run on some worker; returns at once.

    `fn` runs at least once (again if its worker fails); per-worker
    arguments become the running worker's own.

    Args:
      fn: a function (picklable under Ray).
      args, kwargs: its arguments.

    Returns:
      A `RemoteValue` of `fn`'s result.

    Raises:
      TypeError: bad `fn`, `args` or `kwargs`, or a `RemoteValue` argument.
      The first error of an earlier function since the last `join()`.
    """
    if not callable(fn):
      raise TypeError(
          f"coordinator.schedule needs a function to run on a worker, got "
          f"{type(fn).__name__} {fn!r:.80}. Pass the function itself and its "
          "arguments separately: schedule(fn, args=(iterator,)).")
    if not isinstance(args, (tuple, list)):
      raise TypeError(f"schedule(args=...) must be a tuple of arguments, got "
                      f"{type(args).__name__}; write args=(x,) for one argument.")
    if kwargs is not None and not isinstance(kwargs, Mapping):
      raise TypeError(f"schedule(kwargs=...) must be a dict of keyword "
                      f"arguments or None, got {type(kwargs).__name__}; write "
                      "kwargs={'name': x}.")
    kwargs = dict(kwargs or {})
    if any(isinstance(x, RemoteValue) for x in jax.tree.leaves(
        (args, kwargs), is_leaf=lambda x: isinstance(x, RemoteValue))):
      raise TypeError(
          "A RemoteValue cannot be an argument of a scheduled function: fetch() "
          "it first, or compute it inside the function that needs it.")
    self._check_open()
    closure = Closure(fn, tuple(args), kwargs)
    self._cluster.prepare(closure)
    self._queue.put(closure)
    return closure.result

  def join(self) -> None:
    """Waits until every scheduled function has finished.

    Raises:
      The first error of a scheduled function since the last `join()` (the
      queued functions are cancelled), once nothing runs any more.
      `jdist.ParameterServerError` after a parameter server failed or hung.
    """
    self._queue.wait()

  def done(self) -> bool:
    """Whether every scheduled function has finished (raises like `join`)."""
    return self._queue.done()

  def fetch(self, value: Any) -> Any:
    """`value` with every `RemoteValue` fetched and every `ServerVariables`
    read; other values are returned as they are."""
    def one(x):
      if isinstance(x, RemoteValue):
        return x.fetch()
      if isinstance(x, ServerVariables):
        return x.read()
      return x
    return jax.tree.map(one, value, is_leaf=lambda x: isinstance(
        x, (RemoteValue, ServerVariables)))

  def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
    """A dataset each worker builds with `dataset_fn` (see `PerWorkerDataset`).

    `dataset_fn` runs on each worker when a function first takes its iterator;
    its error reaches `join()` with its traceback.
    """
    self._check_open()
    return PerWorkerDataset(dataset_fn)

  # --- lifetime ----------------------------------------------------------------

  @property
  def num_workers(self) -> int:
    """Workers able to run functions now."""
    return self._alive

  def shutdown(self, timeout: float = 60.0) -> None:
    """Stops the workers and the parameter servers; the variables are lost.

    Queued functions are cancelled; running ones are waited for up to
    `timeout` seconds. Nothing of the cluster is left but a thread stuck in a
    call that never returns (a Python thread cannot be stopped).
    """
    if self._closed:
      return
    with self._lock:
      self._closed = True  # no worker joins from now on
      threads = list(self._threads)
    self._queue.stop()
    deadline = time.monotonic() + timeout
    for t in threads:
      t.join(max(0.0, deadline - time.monotonic()))
    self._cluster.close()

  def __enter__(self) -> "ClusterCoordinator":
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()

  # --- the workers' threads ------------------------------------------------------

  def _serve(self, worker) -> None:
    # Up to `worker.depth` closures are sent ahead (a Ray worker gets its
    # next function while it runs one: the call's round trip is hidden).
    pending = collections.deque()
    while True:
      while len(pending) < worker.depth:
        closure = self._queue.get(block=not pending)
        if closure is None:
          break
        closure.attempts += 1
        pending.append((closure, worker.submit(closure)))
      if not pending:
        return  # stopped: a blocking get() gives None only then
      failure, again = self._finish(worker, *pending.popleft())
      if failure is not None:
        while pending:  # what the worker still had: done, or to run again
          again += self._finish(worker, *pending.popleft())[1]
        # Logged before the functions go back to the queue: another worker
        # may finish them (and join() return) at once. (Not when shut down:
        # stopping the workers is no failure.)
        if not self._closed:
          self._log_failure(worker, failure, len(again))
        for closure in again:
          self._queue.put_back(closure)
        if not self._closed and not self._restart(worker, failure):
          return

  def _finish(self, worker, closure, ticket) -> tuple:
    """Waits for one closure on `worker`; returns `(failure, again)`: the
    worker's failure or None, and the closures to run again."""
    try:
      value = worker.result(ticket)
    except WorkerFailedError as e:
      if closure.attempts >= self._max_attempts:
        self._queue.failed(closure, WorkerFailedError(
            f"The scheduled function {_name(closure.fn)} was started "
            f"{closure.attempts} times and its worker failed each time; "
            f"the last failure: {e}"))
        return e, []
      return e, [closure]
    except ParameterServerError as e:
      self._queue.failed(closure, e)
      self._queue.abort(e)
    except BaseException as e:  # the function's own error, for join()
      self._queue.failed(closure, e)
    else:
      self._queue.finished(closure, value)
    return None, []

  @staticmethod
  def _log_failure(worker, failure, rerun: int) -> None:
    _log.warning(
        "Worker %d failed (%s); %d scheduled function(s) it had run again "
        "on the workers (at least once), and the worker is restarted.",
        worker.index, failure, rerun)

  def _join(self, worker, where: str) -> bool:
    """A worker joined (Ray); False if the coordinator is shut down."""
    with self._lock:
      if self._closed:
        return False
      self._alive += 1
      alive = self._alive
      self._max_attempts = max(self._max_attempts, ATTEMPTS_PER_WORKER * alive)
      thread = threading.Thread(target=self._serve, args=(worker,),
                                name=f"jdist-worker-{worker.index}",
                                daemon=True)
      self._threads.append(thread)
      thread.start()
    _log.info("Worker %d joined the cluster (%s); scheduled functions run on "
              "it, %d worker(s) now.", worker.index, where, alive)
    return True

  def _restart(self, worker, failure) -> bool:
    """Waits for a failed worker to come back; False if it left."""
    if worker.recover():
      _log.info("Worker %d was restarted.", worker.index)
      return True
    self._cluster.left(worker)
    with self._lock:
      self._alive -= 1
      alive = self._alive
    minimum = self._cluster.min_workers
    why = getattr(worker, "death", "") or f"it did not come back: {failure}"
    _log.warning("Worker %d left the cluster (%s); it is dropped from "
                 "scheduling, %d worker(s) left.", worker.index, why, alive)
    if alive < minimum and not self._closed:
      error = WorkerFailedError(
          f"Too few workers are left to go on: worker {worker.index} left the "
          f"cluster ({why}), leaving {alive}, fewer than min_workers="
          f"{minimum}. The functions still queued fail with this error and "
          "nothing more runs on this cluster: add capacity to the Ray "
          "cluster and start a new strategy (restoring the variables from a "
          "checkpoint), or lower ray_options['min_workers'].")
      self._queue.fail_all(error)
      self._queue.abort(error)
    return False

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("This ClusterCoordinator was shut down, and its "
                         "cluster with it; make a new ParameterServerStrategy.")


def _name(fn) -> str:
  return getattr(fn, "__name__", None) or type(fn).__name__
