"""TPUStrategy: the same engine, on a TPU VM's or a pod slice's TPU cores."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jdist._src.errors import ClusterError
from jdist._src.runtime import runtime as runtime_lib
from jdist._src.strategies.device_mesh import DeviceMesh
from jdist._src.strategies.spmd import Strategy
from jdist._src.strategies.devices import from_mesh, replica_order


def tpu_devices() -> tuple:
  """Every TPU device of the run, or () when JAX has no TPU backend."""
  try:
    return tuple(jax.devices("tpu"))
  except RuntimeError:
    return ()


class TPUStrategy(Strategy):
  """Synchronous data parallelism over TPU cores, on one host or a pod slice.

  As `MirroredStrategy`; on a pod slice creating it joins the hosts.

  Args:
    cluster_resolver: usually None; JAX finds the TPU hosts itself.
    communication_options: a `jdist.CommunicationOptions`.
    axis_name: name of the replica mesh axis (default "replica").
    mesh: instead of every TPU core of the run, a mesh of one axis.

  Raises:
    jdist.ClusterError: no TPU is attached to this process.

  Example:
    >>> import jdist
    >>> strategy = jdist.TPUStrategy()  # doctest: +SKIP
    >>> strategy.num_replicas_in_sync  # doctest: +SKIP
    8
  """

  def __init__(self, cluster_resolver=None, communication_options=None, *,
               axis_name: str | None = None,
               mesh: Mesh | DeviceMesh | None = None):
    runtime_lib.initialize(cluster_resolver)
    devices = tpu_devices()
    if mesh is not None:
      devices, axis_name = from_mesh(mesh, "TPUStrategy", axis_name=axis_name)
      if any(d.platform != "tpu" for d in devices):
        devices = ()  # a mesh of other devices: the error below
    if not devices:
      seen = ", ".join(sorted({d.platform for d in jax.devices()}))
      raise ClusterError(
          f"TPUStrategy needs TPU devices, but JAX sees only {seen} devices here. "
          "On a Cloud TPU VM install jax[tpu]; in Colab pick a TPU runtime. "
          "On CPUs and GPUs use jdist.MirroredStrategy (one host) or "
          "jdist.MultiWorkerMirroredStrategy (several).")
    self._cluster_resolver = cluster_resolver
    super().__init__(devices if mesh is not None else replica_order(devices),
                     axis_name=axis_name or "replica",
                     communication_options=communication_options)

  @property
  def cluster_resolver(self):
    """The resolver given at construction (None: detected)."""
    return self._cluster_resolver
