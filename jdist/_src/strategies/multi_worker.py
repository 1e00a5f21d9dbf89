"""MultiWorkerMirroredStrategy: every device of every process, one replica each."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jdist._src.runtime import runtime as runtime_lib
from jdist._src.strategies.device_mesh import DeviceMesh
from jdist._src.strategies.spmd import Strategy
from jdist._src.strategies.devices import from_mesh, replica_order


class MultiWorkerMirroredStrategy(Strategy):
  """Synchronous data parallelism over the devices of all processes.

  Every process runs the same program and feeds its own replicas; creating
  the strategy joins the run (docs/many_hosts.md).

  Args:
    cluster_resolver: a `jdist.cluster_resolver` (None: the environment).
    communication_options: a `jdist.CommunicationOptions`.
    axis_name: name of the replica mesh axis (default "replica").
    mesh: instead of every device of the run, a mesh of one axis.

  Example:
    >>> import jax, jdist
    >>> strategy = jdist.MultiWorkerMirroredStrategy()
    >>> strategy.num_replicas_in_sync == len(jax.devices())
    True
  """

  def __init__(self, cluster_resolver=None, communication_options=None, *,
               axis_name: str | None = None,
               mesh: Mesh | DeviceMesh | None = None):
    self._cluster_config = runtime_lib.initialize(cluster_resolver).config
    self._cluster_resolver = cluster_resolver
    devices = replica_order(jax.devices())
    if mesh is not None:
      devices, axis_name = from_mesh(mesh, "MultiWorkerMirroredStrategy",
                                     axis_name=axis_name)
    super().__init__(devices, axis_name=axis_name or "replica",
                     communication_options=communication_options)

  @property
  def cluster_resolver(self):
    """The resolver given at construction (None: from the environment)."""
    return self._cluster_resolver

  @property
  def cluster_config(self):
    """The `ClusterConfig` joined, or None for a single process."""
    return self._cluster_config
