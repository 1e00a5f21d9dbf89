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

  On a pod slice every host runs the same program; creating the strategy
  joins them (JAX detects the Cloud TPU environment). Steps, datasets and
  reductions behave exactly as with `MirroredStrategy`. The replicas follow
  the chips' interconnect, as `jax.make_mesh` orders them (a TPU v3-8 gives
  device ids 0, 1, 2, 3, 6, 7, 4, 5), slice after slice on a multislice run.

  Args:
    cluster_resolver: usually None (or `jdist.cluster_resolver.
      TPUClusterResolver()`); JAX finds the TPU hosts itself.
    communication_options: a `jdist.CommunicationOptions`.
    axis_name: name of the replica mesh axis (default "replica").
    mesh: a `jax.sharding.Mesh` (Auto or Explicit axes, as `jax.make_mesh`
      makes it) or a `jdist.DeviceMesh` of TPU cores on one axis, instead of every TPU core of the run:
      its devices in their order, its axis the replica axis. The strategy
      then also runs inside `with jax.set_mesh(mesh):`.

  Raises:
    jdist.ClusterError: no TPU is attached to this process (a RuntimeError).

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
