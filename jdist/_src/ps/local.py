"""The threads backend: workers are threads of this process, servers objects.

Worker `i` runs its functions in the coordinator's thread for it, on local
device `i % D` (a one-device `MirroredStrategy`); the parameter servers are
`ParameterServer` objects that workers call directly. Nothing crosses a
process boundary, which makes it the backend for notebooks and tests.
"""

from __future__ import annotations

import jax

from jdist._src.errors import ParameterServerError
from jdist._src.ps import worker as worker_lib
from jdist._src.ps.server import ParameterServer
from jdist._src.strategies.mirrored import MirroredStrategy


class LocalStore:
  """The servers' API over `ParameterServer` objects in this process."""

  def __init__(self, servers: list):
    self._servers = servers
    self._closed = False

  def _server(self, index: int) -> ParameterServer:
    if self._closed:
      raise ParameterServerError(
          f"Parameter server {index} is shut down (the coordinator's "
          "shutdown() stopped the cluster); its variables are gone.")
    return self._servers[index]

  def create(self, set_id, per_server: dict, kinds: dict) -> None:
    for s, shards in per_server.items():
      self._server(s).create(set_id, shards, kinds[s])

  def read(self, set_id, servers) -> dict:
    return {s: self._server(s).read(set_id) for s in servers}

  def push(self, set_id, pushes: dict, max_staleness) -> dict:
    return {s: self._server(s).push(set_id, base, changes, max_staleness)
            for s, (base, changes) in pushes.items()}

  def assign(self, set_id, per_server: dict) -> None:
    for s, shards in per_server.items():
      self._server(s).assign(set_id, shards)

  def delete(self, set_id) -> None:
    if not self._closed:
      for server in self._servers:
        server.delete(set_id)

  def stats(self) -> list:
    return [self._server(i).stats() for i in range(len(self._servers))]

  def close(self) -> None:
    self._closed = True


class ThreadWorker:
  """One worker: a context over one local device; runs closures in place."""

  def __init__(self, index: int, num_workers: int, device, parameter_strategy):
    self.index = index
    self.context = worker_lib.WorkerContext(
        index, num_workers, MirroredStrategy([device]), parameter_strategy)

  depth = 1  # closures it is given at a time

  def submit(self, closure):
    return closure  # runs when its result is asked for, in that thread

  def result(self, closure):
    return worker_lib.run(self.context, closure.fn, closure.args,
                          closure.kwargs)

  def recover(self) -> bool:
    """A failed worker comes back at once, without what it had built."""
    self.context.restart()
    return True


class ThreadCluster:
  """Servers and workers of a `ParameterServerStrategy` in this process."""

  def __init__(self, spec, strategy):
    devices = jax.local_devices()
    self.store = LocalStore([ParameterServer(i) for i in range(spec.num_ps)])
    self.workers = [ThreadWorker(i, spec.num_workers, devices[i % len(devices)],
                                 strategy) for i in range(spec.num_workers)]
    self.replicas_per_worker = 1

  def prepare(self, closure) -> None:
    del closure  # functions run in this process as they are

  def close(self) -> None:
    self.store.close()
