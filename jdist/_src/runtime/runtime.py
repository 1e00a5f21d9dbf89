"""`Runtime`: this process's membership in a run, and talking to its peers.

The `Runtime` owns every process-wide effect of a multi-process run (the
monitor, health reports, a `sys.excepthook` that tells the peers instead of
hanging in JAX's shutdown barrier, an `atexit` handler): `start` sets them
up, `shutdown` undoes them. `exchange` is the rendezvous of jdist's checks.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
import traceback

import jax

from jdist._src import jax_compat
from jdist._src.errors import (ClusterError, CollectiveTimeoutError,
                               PeerFailureError)
from jdist._src.launcher import ports
from jdist._src.runtime import cluster
from jdist._src.runtime import health_report
from jdist._src.runtime import resolution
from jdist._src.runtime.monitor import Monitor

DEFAULT_HEARTBEAT_SECONDS = 10
DEFAULT_RENDEZVOUS_SECONDS = 600.0
POLL_SECONDS = 0.5  # a rendezvous looks at its peers' failures this often


class Runtime:
  """This process's part in a run: its peers, and the watch over them.

  From `jdist.initialize()` (or `strategy.runtime`).

  Attributes:
    config: the `ClusterConfig` joined, or None for a single process.
    process_id: this process, 0 to `num_processes - 1`.
    num_processes: processes in the run.
    monitor: the process monitor of a multi-process run (else None).

  Example:
    >>> import jdist
    >>> runtime = jdist.initialize()  # no cluster here: a single process
    >>> runtime.num_processes, runtime.process_id
    (1, 0)
  """

  def __init__(self, config: cluster.ClusterConfig | None, process_id: int = 0,
               num_processes: int = 1):
    self.config = config
    self.process_id = process_id
    self.num_processes = num_processes
    self.monitor: Monitor | None = None
    self._health: health_report.Reporter | None = None
    self._previous_hook = None
    self._sequences: dict = {}

  def __repr__(self) -> str:
    where = f", {self.config.source}" if self.config else ""
    return (f"Runtime(process {self.process_id} of {self.num_processes}"
            f"{where})")

  @property
  def is_multiprocess(self) -> bool:
    return self.num_processes > 1

  def next_sequence(self, kind: str) -> int:
    """1, 2, ...: the next rendezvous of `kind` in this run (the same one on
    every process, which all run the same program)."""
    self._sequences[kind] = self._sequences.get(kind, 0) + 1
    return self._sequences[kind]

  @staticmethod
  def client():
    """The distributed runtime client, or None once shut down (or alone)."""
    return jax_compat.distributed_state().client

  # --- process-wide effects ---------------------------------------------------

  def start(self) -> "Runtime":
    """Starts the monitor and failure reporting (multi-process runs only)."""
    if self.is_multiprocess and self.monitor is None:
      self.monitor = Monitor(self.client, self.process_id, self.num_processes)
      # Under `jdist launch`: its agent watches this file to find a stuck process.
      self._health = health_report.Reporter.from_environment(self.monitor.health)
      self._previous_hook = sys.excepthook
      sys.excepthook = self._excepthook
      # Runs before JAX's own exit handler (registered earlier), which waits
      # at a shutdown barrier: the peers learn this process finished.
      atexit.register(self._at_exit)
    return self

  def shutdown(self) -> None:
    """Leaves the run: tells the peers, shuts JAX's runtime down, stops watching.

    Called at exit; call it yourself to leave earlier.
    """
    monitor = self.monitor
    if monitor is None:
      return
    try:
      monitor.finish()
      # JAX's own exit handler would do this after ours; doing it here keeps
      # the monitor watching the shutdown barrier (a peer that fails meanwhile
      # still ends this process with a message), then lets the thread stop
      # before the interpreter does. JAX's later call is then a no-op.
      jax.distributed.shutdown()
    except Exception:
      pass
    finally:
      monitor.stop()
      if self._health is not None:
        self._health.stop()
        self._health = None
      if sys.excepthook == self._excepthook:
        sys.excepthook = self._previous_hook
      atexit.unregister(self._at_exit)
      self.monitor = None

  def _at_exit(self) -> None:
    self.shutdown()

  def _excepthook(self, exc_type, exc, tb) -> None:
    monitor = self.monitor
    if monitor is not None and monitor.ending:
      monitor.fail("")  # a consequence of what the monitor already reported
    try:
      (self._previous_hook or sys.__excepthook__)(exc_type, exc, tb)
    except Exception:
      traceback.print_exception(exc_type, exc, tb)
    if monitor is not None:
      # The first entry: the error's own line (notes, such as JAX's about
      # filtered frames, come after it).
      summary = traceback.format_exception_only(exc_type, exc)[0].strip()
      monitor.fail(summary)  # ends the process; peers see the error at once

  # --- rendezvous ---------------------------------------------------------------

  def exchange(self, prefix: str, value: str, *, timeout: float | None,
               what: str) -> dict:
    """Publishes `value` under `prefix` and returns every process's value.

    Args:
      prefix: a key prefix unique to this rendezvous.
      value: this process's value.
      timeout: seconds to wait for the others (None: a generous default).
      what: what the processes meet for, for messages.

    Returns:
      Every process's value, keyed by process id.

    Raises:
      jdist.CollectiveTimeoutError: the others did not publish in time.
      jdist.PeerFailureError: a peer failed while this process waited.
    """
    me, n = self.process_id, self.num_processes
    if n == 1:
      return {me: value}
    c = self.client()
    timeout = DEFAULT_RENDEZVOUS_SECONDS if timeout is None else float(timeout)
    c.key_value_set(f"{prefix}{me}", value, allow_overwrite=True)
    values = {me: value}
    deadline = time.monotonic() + timeout
    monitor = self.monitor
    with monitor.waiting(what, prefix) if monitor else contextlib.nullcontext():
      for p in range(n):
        while p != me and p not in values:
          left = deadline - time.monotonic()
          if left <= 0:
            raise self._timeout_error(c, prefix, what, timeout)
          slice_ms = max(1, int(min(left, POLL_SECONDS) * 1000))
          try:
            values[p] = c.blocking_key_value_get(f"{prefix}{p}", slice_ms)
          except jax.errors.JaxRuntimeError:
            # The wait ended without the value: its time slice ran out, or
            # the store failed. Asking the store tells which (a failed store
            # raises here), and finds a value published as the wait ended.
            published = _published(c, prefix)
            if p in published:
              values[p] = published[p]
          if monitor is not None and p not in values:
            if monitor.peer_failure is not None:
              raise PeerFailureError(monitor.peer_failure.split(": ", 1)[-1])
            if monitor.diverged is not None:
              raise CollectiveTimeoutError(monitor.diverged)
    return values

  def _timeout_error(self, c, prefix: str, what: str, timeout: float):
    published = _published(c, prefix)
    missing = [q for q in range(self.num_processes) if q not in published]
    return CollectiveTimeoutError(
        f"Processes {missing} did not reach {what} within {timeout:g} s "
        f"(process {self.process_id} waited). They are running something else "
        "(a different program, or a different number of steps), are stuck, "
        "or died.")

  def delete(self, key: str) -> None:
    """Deletes one key of the store (what a finished rendezvous left)."""
    c = self.client() if self.is_multiprocess else None
    if c is not None:
      with contextlib.suppress(Exception):
        c.key_value_delete(key)


def _published(client, prefix: str) -> dict:
  """`{process_id: value}` of the values published under `prefix` so far."""
  tails = ((k.rsplit("/", 1)[-1], v)
           for k, v in client.key_value_dir_get(prefix))
  return {int(tail): v for tail, v in tails if tail.isdigit()}


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def current() -> Runtime:
  """The runtime of this process: the one `initialize` joined, else one
  attached to a direct `jax.distributed.initialize`, else a single process."""
  global _runtime
  with _runtime_lock:
    if _runtime is not None and _runtime.monitor is None and \
        _runtime.is_multiprocess:
      _runtime = None  # shut down: look again
    if _runtime is None:
      state = jax_compat.distributed_state()
      if state.client is not None and state.num_processes > 1:
        config = cluster.ClusterConfig(
            state.coordinator_address or "", state.num_processes,
            state.process_id, source="jax.distributed.initialize")
        _runtime = Runtime(config, state.process_id,
                           state.num_processes).start()
      else:
        return Runtime(None)
    return _runtime


def initialize(cluster_resolver=None, *, initialization_timeout: int = 300,
               heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_SECONDS
               ) -> Runtime:
  """Joins this process to its multi-process run; returns its `Runtime`.

  Call it before any JAX computation. The cluster comes from
  `cluster_resolver`, else `jdist launch`'s variables, else `TF_CONFIG`,
  else JAX's detection; with none the run is a single process.

  Args:
    cluster_resolver: a `jdist.cluster_resolver` resolver (or `ClusterConfig`).
    initialization_timeout: seconds to wait for the other processes.
    heartbeat_timeout_seconds: a process silent this long is declared dead.

  Returns:
    The `Runtime` (its `config` is None for a single process).

  Raises:
    jdist.ClusterError: the cluster cannot be joined (the error says why).

  Example:
    >>> import jdist
    >>> jdist.initialize().config is None  # no cluster here: a single process
    True
  """
  if jax.distributed.is_initialized():
    return _already_initialized(cluster_resolver)
  config = resolution.resolve(cluster_resolver)
  if config is None or config.num_processes == 1:
    return Runtime(config if config is not None and
                   config.num_processes > 1 else None)
  if jax_compat.backends_are_initialized():
    raise ClusterError(
        f"jdist.initialize() found a {config.num_processes}-process cluster "
        f"({config.source}), but JAX has already started its backend in this "
        "process, so it can no longer join. Call jdist.initialize() (or create "
        "the MultiWorkerMirroredStrategy) at the top of the program, before any "
        "JAX computation, jax.devices() call or array creation.")
  deadline = time.monotonic() + initialization_timeout
  if config.process_id == 0:
    _refuse_busy_port(config)
  else:
    _wait_for_coordinator(config, initialization_timeout)
  remaining = max(1.0, deadline - time.monotonic())
  with _startup_deadline(config, remaining):
    jax.distributed.initialize(
        config.coordinator_address, config.num_processes, config.process_id,
        local_device_ids=(None if config.local_device_ids is None
                          else list(config.local_device_ids)),
        cluster_detection_method="deactivate",
        # JAX aborts the process at its own deadline; ours comes first.
        initialization_timeout=int(remaining) + 30,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  global _runtime
  with _runtime_lock:
    _runtime = Runtime(config, config.process_id, config.num_processes).start()
  return _runtime


def _already_initialized(cluster_resolver) -> Runtime:
  runtime = current()
  if cluster_resolver is not None:
    wanted = resolution.resolve(cluster_resolver)
    if (wanted.num_processes, wanted.process_id) != (runtime.num_processes,
                                                     runtime.process_id):
      raise ClusterError(
          f"This process already joined a run as process {runtime.process_id} "
          f"of {runtime.num_processes}, but the cluster resolver describes "
          f"process {wanted.process_id} of {wanted.num_processes}. Initialize "
          "once, with one description of the cluster.")
  return runtime


def _refuse_busy_port(config) -> None:
  """Raises `ClusterError` if process 0's coordinator port is taken."""
  port = int(config.coordinator_address.rpartition(":")[2])
  address = ports.bind_address(port)
  busy = ports.in_use(address)
  if busy is not None:
    raise ClusterError(
        f"Process 0 of {config.num_processes} cannot start the coordinator on "
        f"port {port} ({address}): the port is already in use on this machine "
        f"({busy.strerror or busy}), by another job's coordinator or another "
        "program. Joining another job's coordinator would break both jobs. "
        f"Give this run a free port in its coordinator address "
        f"{config.coordinator_address} (cluster from {config.source}; "
        "`jdist launch` picks a free one when --port is left out), or stop what "
        "holds the port.")


def _wait_for_coordinator(config, timeout: float) -> None:
  """Raises `ClusterError` unless process 0's coordinator accepts connections."""
  host, _, port = config.coordinator_address.rpartition(":")
  host = host.strip("[]")
  deadline = time.monotonic() + timeout
  error = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host, int(port)),
                                    timeout=min(2.0, timeout)):
        return
    except OSError as e:
      error = e
      time.sleep(0.2)
  raise ClusterError(
      f"Process {config.process_id} of {config.num_processes} could not reach "
      f"the coordinator at {config.coordinator_address} within {timeout:g} s "
      f"({error}). Process 0 starts the coordinator: check that it is running, "
      "that this address reaches it from this host, and that the port is open. "
      f"(Cluster from {config.source}.)")


@contextlib.contextmanager
def _startup_deadline(config, timeout: float):
  """Ends the process with a clear message if joining takes too long
  (`jax.distributed.initialize` blocks in C++ and cannot be interrupted)."""
  joined = threading.Event()

  def watch():
    if joined.wait(timeout):
      return
    print(f"jdist.ClusterError: process {config.process_id} of "
          f"{config.num_processes} waited {timeout:.0f} s at the coordinator "
          f"{config.coordinator_address} for all {config.num_processes} processes "
          "to join, and some never did. Start every process with the same "
          "coordinator address and process count, and distinct process ids "
          f"0..{config.num_processes - 1} (cluster from {config.source}).",
          file=sys.stderr, flush=True)
    os._exit(1)

  thread = threading.Thread(target=watch, name="jdist-join", daemon=True)
  thread.start()
  try:
    yield
  finally:
    joined.set()
