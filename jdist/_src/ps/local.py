"""The threads backend, for notebooks and tests: workers are threads of this
process (worker `i` on local device `i % D`), servers objects served by
threads. A worker whose function runs past the timeout is lost: a thread
can neither be stopped nor asked whether it lives."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Callable

import jax

from jdist._src.errors import ParameterServerError, WorkerFailedError
from jdist._src.ps import worker as worker_lib
from jdist._src.ps.excused import EXCUSED, listen_to_compiles
from jdist._src.ps.server import ParameterServer, unanswered
from jdist._src.strategies.mirrored import MirroredStrategy

# How often a worker's thread is looked at again while its function is past
# the timeout but compiling or waiting on a parameter server.
_RECHECK_SECONDS = 0.05


class TaskThread:
  """A daemon thread that runs the calls given to it one at a time, in order
  (a call that never returns keeps it: threads cannot be ended from outside)."""

  def __init__(self, name: str):
    self._calls: queue.SimpleQueue = queue.SimpleQueue()
    self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
    self._thread.start()

  @property
  def thread(self) -> threading.Thread:
    return self._thread

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    self._calls.put((future, fn, args))
    return future

  def stop(self, timeout: float = 1.0) -> None:
    """Ends the thread after the calls given so far; waits up to `timeout`."""
    self._calls.put(None)
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout)

  def _loop(self) -> None:
    while (call := self._calls.get()) is not None:
      future, fn, args = call
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # the caller's: it gets it from result()
          future.set_exception(e)


class LocalStore:
  """The servers' API over `ParameterServer` objects, each in its thread; a
  call waits `timeout` seconds at most for all the servers it asks."""

  def __init__(self, servers: list, addresses, timeout: float):
    self._servers = servers
    self._threads = [TaskThread(f"jdist-ps-{s.index}") for s in servers]
    self._addresses = tuple(addresses)
    self._timeout = timeout
    self._closed = False

  def _call(self, calls: dict) -> dict:
    """`{server: (method, args)}` -> `{server: result}`, in parallel."""
    if self._closed:
      raise ParameterServerError(
          "The parameter servers are shut down (the coordinator's shutdown() "
          "stopped the cluster); their variables are gone.")
    deadline = time.monotonic() + self._timeout
    futures = {s: self._threads[s].submit(getattr(self._servers[s], m), *a)
               for s, (m, a) in calls.items()}
    out = {}
    EXCUSED.begin(threading.current_thread())
    try:
      for s, future in futures.items():
        done, _ = concurrent.futures.wait(
            [future], timeout=max(0.0, deadline - time.monotonic()))
        if not done:
          raise unanswered(s, self._addresses[s], self._timeout)
        out[s] = future.result()
    finally:
      EXCUSED.end(threading.current_thread())
    return out

  def create(self, set_id, per_server: dict, kinds: dict) -> None:
    self._call({s: ("create", (set_id, shards, kinds[s]))
                for s, shards in per_server.items()})

  def read(self, set_id, servers) -> dict:
    return self._call({s: ("read", (set_id,)) for s in servers})

  def push(self, set_id, pushes: dict, max_staleness) -> dict:
    return self._call({s: ("push", (set_id, base, changes, max_staleness))
                       for s, (base, changes) in pushes.items()})

  def assign(self, set_id, per_server: dict) -> None:
    self._call({s: ("assign", (set_id, shards))
                for s, shards in per_server.items()})

  def delete(self, set_id) -> None:
    if not self._closed:
      for server, thread in zip(self._servers, self._threads):
        thread.submit(server.delete, set_id)  # nobody waits for a set's end

  def stats(self) -> list:
    got = self._call({s: ("stats", ()) for s in range(len(self._servers))})
    return [got[s] for s in range(len(self._servers))]

  def close(self) -> None:
    """Refuses every later call and ends the servers' threads."""
    self._closed = True
    for thread in self._threads:
      thread.stop()


class ThreadWorker:
  """One worker: a context over one local device and a thread for its
  closures; one running past `timeout` (excused time aside) loses the thread."""

  def __init__(self, index: int, num_workers: int, device, parameter_strategy,
               timeout: float):
    self.index = index
    self.context = worker_lib.WorkerContext(
        index, num_workers, MirroredStrategy([device]), parameter_strategy)
    self._timeout = timeout
    self._thread = TaskThread(f"jdist-worker-{index}-run")

  depth = 1  # closures it is given at a time

  def submit(self, closure):
    thread = self._thread.thread
    return (EXCUSED.clock(thread), self._thread.submit(
        worker_lib.run, self.context, closure.fn, closure.args,
        closure.kwargs))

  def result(self, ticket):
    started, future = ticket  # started: a reading of the thread's clock
    thread = self._thread.thread
    while True:
      late = EXCUSED.clock(thread) - started - self._timeout
      if late >= 0 and not EXCUSED.active(thread):
        break
      wait = _RECHECK_SECONDS if late >= 0 else -late
      if concurrent.futures.wait([future], timeout=wait)[0]:
        return future.result()
    if future.done():
      return future.result()
    self._thread.stop(timeout=0.0)  # ends when the hung call returns
    self._thread = None
    raise WorkerFailedError(
        f"Worker {self.index} did not finish a scheduled function within "
        f"timeout_seconds={self._timeout:g} (compiling and waiting on "
        "parameter servers aside): it counts as hung and is restarted, and "
        "its function runs again on a worker (the hung call keeps its thread "
        "until it returns; its result is dropped).")

  def recover(self) -> bool:
    """A failed worker comes back at once, without what it had built."""
    self.context.restart()
    if self._thread is None:
      self._thread = TaskThread(f"jdist-worker-{self.index}-run")
    return True

  def close(self) -> None:
    if self._thread is not None:
      self._thread.stop()


class ThreadCluster:
  """Servers and workers of a `ParameterServerStrategy` in this process."""

  def __init__(self, spec, strategy, timeout: float):
    listen_to_compiles()
    devices = jax.local_devices()
    self.store = LocalStore([ParameterServer(i) for i in range(spec.num_ps)],
                            spec.ps, timeout)
    self.workers = [ThreadWorker(i, spec.num_workers, devices[i % len(devices)],
                                 strategy, timeout)
                    for i in range(spec.num_workers)]
    self.replicas_per_worker = 1

  # Its workers never leave (a failed one comes back at once) nor join.
  min_workers = 1

  def watch(self, on_join) -> None:
    del on_join  # the threads are this process's: none joins later

  def left(self, worker) -> None:
    del worker  # unreachable: `ThreadWorker.recover` always succeeds

  def prepare(self, closure) -> None:
    del closure  # functions run in this process as they are

  def close(self) -> None:
    for worker in self.workers:
      worker.close()
    self.store.close()
