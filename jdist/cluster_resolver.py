"""How a process finds its multi-process run (TensorFlow's `cluster_resolver`).

`jdist.initialize()` and `jdist.MultiWorkerMirroredStrategy()` use, in order:
an explicit resolver, jdist's own variables (set by `jdist launch`),
`TF_CONFIG`, and JAX's detection of SLURM, Open MPI, Kubernetes and Cloud TPU.

Example:
  >>> import jdist
  >>> r = jdist.cluster_resolver.TFConfigClusterResolver(
  ...     {"cluster": {"worker": ["h0:2222", "h1:2222"]},
  ...      "task": {"type": "worker", "index": 1}})
  >>> r.resolve().process_id
  1
"""

from jdist._src.ps.cluster import LocalClusterResolver
from jdist._src.runtime.cluster import ClusterConfig
from jdist._src.runtime.cluster import ClusterResolver
from jdist._src.runtime.cluster import EnvironmentClusterResolver
from jdist._src.runtime.cluster import JaxClusterResolver
from jdist._src.runtime.cluster import SimpleClusterResolver
from jdist._src.runtime.cluster import TPUClusterResolver
from jdist._src.runtime.resolution import resolve
from jdist._src.runtime.tf_config import TFConfigClusterResolver

__all__ = [
    "ClusterConfig",
    "ClusterResolver",
    "EnvironmentClusterResolver",
    "JaxClusterResolver",
    "LocalClusterResolver",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "resolve",
]
