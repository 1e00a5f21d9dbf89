"""Joining a multi-process run, and talking to the peers outside XLA.

`initialize` resolves the cluster (`jdist.cluster_resolver`) and calls
`jax.distributed.initialize`, with two additions that make failures loud: a
process that cannot reach the coordinator raises at once (JAX would abort the
process after its timeout), and once joined, every process runs a monitor
(`jdist/_src/monitor.py`) and reports an uncaught exception to its peers
instead of waiting in JAX's shutdown barrier while they hang.

`exchange` is the rendezvous jdist builds its checks on: every process
publishes a value under a key prefix of the coordination service's key-value
store and reads everybody else's.
"""

from __future__ import annotations

import atexit
import contextlib
import socket
import sys
import threading
import time
import traceback

import jax

from jdist._src import cluster
from jdist._src.monitor import Monitor
from jdist._src.types import ClusterError, CollectiveTimeoutError

DEFAULT_HEARTBEAT_SECONDS = 10
DEFAULT_RENDEZVOUS_SECONDS = 600.0

_monitor: Monitor | None = None
_monitor_lock = threading.Lock()


def _global_state():
  from jax._src import distributed
  return distributed.global_state


def client():
  """The distributed runtime client, or None in a single-process run."""
  return _global_state().client


def initialize(cluster_resolver=None, *, initialization_timeout: int = 300,
               heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_SECONDS):
  """Joins this process to its multi-process run; a no-op for one process.

  Call it first thing in the program, before any JAX computation (creating a
  `jdist.MultiWorkerMirroredStrategy` calls it for you). The cluster comes
  from `cluster_resolver`, else jdist's variables (`jdist launch`), else
  `TF_CONFIG`, else JAX's detection of SLURM, Open MPI, Kubernetes or Cloud
  TPU; with none of them the run is a single process and nothing happens.

  Args:
    cluster_resolver: a `jdist.cluster_resolver` resolver (or `ClusterConfig`).
    initialization_timeout: seconds to wait for the coordinator and the other
      processes to join.
    heartbeat_timeout_seconds: a process silent this long is declared dead and
      the others stop (JAX's default of 100 s makes a killed peer a long hang).

  Returns:
    The `ClusterConfig` joined, or None for a single process.

  Raises:
    jdist.ClusterError: the coordinator cannot be reached in time, JAX already
      started its backend, or the cluster description is wrong.

  Example:
    >>> import jdist
    >>> jdist.initialize() is None  # no cluster here: a single process
    True
  """
  import jax
  from jax._src import xla_bridge
  if jax.distributed.is_initialized():
    return _already_initialized(cluster_resolver)
  config = cluster.resolve(cluster_resolver)
  if config is None or config.num_processes == 1:
    return None
  if xla_bridge.backends_are_initialized():
    raise ClusterError(
        f"jdist.initialize() found a {config.num_processes}-process cluster "
        f"({config.source}), but JAX has already started its backend in this "
        "process, so it can no longer join. Call jdist.initialize() (or create "
        "the MultiWorkerMirroredStrategy) at the top of the program, before any "
        "JAX computation, jax.devices() call or array creation.")
  deadline = time.monotonic() + initialization_timeout
  if config.process_id != 0:
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
  ensure_monitor()
  return config


def _already_initialized(cluster_resolver):
  state = _global_state()
  current = cluster.ClusterConfig(state.coordinator_address or "",
                                  state.num_processes, state.process_id,
                                  source="jax.distributed.initialize")
  if cluster_resolver is not None:
    wanted = cluster.resolve(cluster_resolver)
    if (wanted.num_processes, wanted.process_id) != (current.num_processes,
                                                     current.process_id):
      raise ClusterError(
          f"This process already joined a run as process {current.process_id} "
          f"of {current.num_processes}, but the cluster resolver describes "
          f"process {wanted.process_id} of {wanted.num_processes}. Initialize "
          "once, with one description of the cluster.")
  ensure_monitor()
  return current if current.num_processes > 1 else None


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
  """Ends the process with a clear message if joining takes too long."""
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
    import os
    os._exit(1)

  thread = threading.Thread(target=watch, name="jdist-join", daemon=True)
  thread.start()
  try:
    yield
  finally:
    joined.set()


def ensure_monitor() -> Monitor | None:
  """Starts the process monitor once per multi-process run (None otherwise)."""
  global _monitor
  state = _global_state()
  if state.client is None or state.num_processes <= 1:
    return None
  with _monitor_lock:
    if _monitor is None:
      _monitor = Monitor(lambda: _global_state().client, state.process_id,
                         state.num_processes)
      _install_failure_reporting(_monitor)
    return _monitor


def _install_failure_reporting(monitor: Monitor) -> None:
  previous = sys.excepthook

  def excepthook(exc_type, exc, tb):
    if monitor.ending:  # a consequence of what the monitor already reported
      monitor.fail("")
    try:
      previous(exc_type, exc, tb)
    except Exception:
      traceback.print_exception(exc_type, exc, tb)
    summary = traceback.format_exception_only(exc_type, exc)[-1].strip()
    monitor.fail(summary)  # ends the process; peers see the error at once

  sys.excepthook = excepthook
  # Runs before JAX's own exit handler (registered earlier), which waits at a
  # shutdown barrier: the peers learn that this process finished its program.
  atexit.register(_finish, monitor)


def _finish(monitor: Monitor) -> None:
  """At exit: report the end, shut the runtime down while watched, stop."""
  try:
    monitor.finish()
    # JAX's own exit handler would do this after ours; doing it here keeps the
    # monitor watching its shutdown barrier (a peer that fails meanwhile still
    # ends this process with a message), then lets the thread stop before the
    # interpreter does. JAX's later call is then a no-op.
    jax.distributed.shutdown()
  except Exception:
    pass
  finally:
    monitor.stop()


def process_id() -> int:
  return _global_state().process_id


def num_processes() -> int:
  state = _global_state()
  return state.num_processes if state.client is not None else 1


def exchange(prefix: str, value: str, *, timeout: float | None, what: str
             ) -> dict:
  """Publishes `value` under `prefix` and returns every process's value.

  Args:
    prefix: a key prefix unique to this rendezvous (the same on every process).
    value: this process's value.
    timeout: seconds to wait for the others (None: a generous default).
    what: what the processes meet for, for messages.

  Returns:
    `{process_id: value}` for every process.

  Raises:
    jdist.CollectiveTimeoutError: some processes did not publish in time.
  """
  c = client()
  me, n = process_id(), num_processes()
  timeout = DEFAULT_RENDEZVOUS_SECONDS if timeout is None else float(timeout)
  c.key_value_set(f"{prefix}{me}", value, allow_overwrite=True)
  values = {me: value}
  deadline = time.monotonic() + timeout
  monitor = ensure_monitor()
  with monitor.waiting(what) if monitor else contextlib.nullcontext():
    for p in range(n):
      if p == me:
        continue
      left_ms = max(1, int((deadline - time.monotonic()) * 1000))
      try:
        values[p] = c.blocking_key_value_get(f"{prefix}{p}", left_ms)
      except Exception as e:
        if "DEADLINE" not in str(e).upper():
          raise
        published = {int(k.rsplit("/", 1)[-1]) for k, _ in
                     c.key_value_dir_get(prefix)}
        missing = [q for q in range(n) if q not in published]
        raise CollectiveTimeoutError(
            f"Processes {missing} did not reach {what} within {timeout:g} s "
            f"(process {me} waited). They are running something else (a "
            "different program, or a different number of steps), are stuck, "
            "or died.") from None
  return values


def delete(key: str) -> None:
  c = client()
  if c is not None:
    with contextlib.suppress(Exception):
      c.key_value_delete(key)
