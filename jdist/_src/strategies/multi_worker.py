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

  Every process runs the same program (multi-controller SPMD). Creating the
  strategy joins the run (`jdist.initialize`) if that has not happened yet;
  without a cluster it is a single process over its local devices, like
  `MirroredStrategy`. Each process feeds only its own replicas: with
  `experimental_distribute_dataset` every process iterates the same global
  batches and keeps its rows; with `distribute_datasets_from_function` each
  reads its own shard (`ctx.input_pipeline_id` of `ctx.num_input_pipelines`),
  and processes whose data ends at different steps are kept in step.

  The replicas follow the physical topology on GPU and TPU (the ring
  `jax.make_mesh` builds) and each process's devices in turn on CPU; see
  `strategy.devices` for the order.

  Args:
    cluster_resolver: how to find the cluster (see `jdist.cluster_resolver`);
      None reads the environment (`jdist launch`, `TF_CONFIG`, SLURM, ...).
    communication_options: a `jdist.CommunicationOptions`; its
      `timeout_seconds` turns a stuck collective into an error.
    axis_name: name of the replica mesh axis (default "replica").
    mesh: a `jax.sharding.Mesh` (Auto or Explicit axes, as `jax.make_mesh`
      makes it) or a `jdist.DeviceMesh` of one axis, instead of every device of the run:
      its devices in their order, its axis the replica axis. The strategy
      then also runs inside `with jax.set_mesh(mesh):`.

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
