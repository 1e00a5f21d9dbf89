"""Which cluster this process belongs to: the resolvers, tried in order."""

from __future__ import annotations

from jdist._src.runtime import cluster
from jdist._src.runtime.tf_config import TFConfigClusterResolver


def resolve(cluster_resolver=None) -> cluster.ClusterConfig | None:
  """The config `jdist.initialize` would use; None for a single process.

  Tries `cluster_resolver`, jdist's variables (`jdist launch`), `TF_CONFIG`,
  then JAX's auto-detection.

  Example:
    >>> import jdist
    >>> jdist.cluster_resolver.resolve(
    ...     jdist.cluster_resolver.SimpleClusterResolver("h:1", 4, 3)).process_id
    3
  """
  if isinstance(cluster_resolver, cluster.ClusterConfig):
    return cluster_resolver
  if cluster_resolver is not None:
    if not isinstance(cluster_resolver, cluster.ClusterResolver):
      raise TypeError(
          f"cluster_resolver must be a jdist.cluster_resolver resolver, got "
          f"{type(cluster_resolver).__name__}. For TensorFlow's resolvers use "
          "the jdist ones of the same name.")
    return cluster_resolver.cluster_config()
  for resolver in (cluster.EnvironmentClusterResolver(),
                   TFConfigClusterResolver(), cluster.JaxClusterResolver()):
    config = resolver.resolve()
    if config is not None:
      return config
  return None
