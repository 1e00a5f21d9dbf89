"""Which tasks a parameter-server cluster has; only the chief runs the
program (the workers and servers are its threads, or Ray actors)."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax

from jdist._src.errors import ClusterError
from jdist._src.runtime.tf_config import TFConfigClusterResolver


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """The tasks of a parameter-server cluster, by role."""

  workers: tuple
  ps: tuple
  chief: tuple = ()
  source: str = "explicit arguments"

  def __post_init__(self):
    where = f" (from {self.source})"
    if not self.ps:
      raise ClusterError(
          f"The cluster has no 'ps' tasks{where}: ParameterServerStrategy needs "
          "at least one parameter server. List them under 'ps' (TF_CONFIG's "
          "cluster), or pass jdist.cluster_resolver.LocalClusterResolver("
          "num_workers=2, num_ps=1); for synchronous training without "
          "parameter servers use jdist.MultiWorkerMirroredStrategy.")
    if not self.workers:
      raise ClusterError(f"The cluster has no 'worker' tasks{where}: "
                         "ParameterServerStrategy needs at least one worker.")

  @property
  def num_workers(self) -> int:
    return len(self.workers)

  @property
  def num_ps(self) -> int:
    return len(self.ps)


class LocalClusterResolver:
  """A parameter-server cluster on this machine: worker and server counts.

  Args:
    num_workers: how many workers (default: one per local device).
    num_ps: how many parameter servers.

  Example:
    >>> import jdist
    >>> r = jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1)
    >>> r.cluster_spec()
    {'worker': ['localhost:0', 'localhost:1'], 'ps': ['localhost:2']}
  """

  def __init__(self, num_workers: int | None = None, num_ps: int = 1):
    if num_workers is None:
      num_workers = len(jax.local_devices())
    for name, n in (("num_workers", num_workers), ("num_ps", num_ps)):
      if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {n!r}.")
    self.num_workers = num_workers
    self.num_ps = num_ps

  def cluster_spec(self) -> dict:
    """The roles and made-up addresses, as TensorFlow's ClusterSpec dict."""
    names = [f"localhost:{i}" for i in range(self.num_workers + self.num_ps)]
    return {"worker": names[:self.num_workers], "ps": names[self.num_workers:]}


def _from_mapping(spec: Mapping, source: str) -> ClusterSpec:
  unknown = set(spec) - {"chief", "worker", "ps", "evaluator"}
  if unknown:
    raise ClusterError(f"Unknown cluster roles {sorted(unknown)} (from "
                       f"{source}); a parameter-server cluster has 'chief', "
                       "'worker' and 'ps' tasks.")
  def tasks(role):
    value = spec.get(role) or ()
    if isinstance(value, int) and not isinstance(value, bool):
      return tuple(f"{role}:{i}" for i in range(value))
    if isinstance(value, Mapping):  # TF's sparse form {index: address}
      return tuple(value[k] for k in sorted(value))
    return tuple(value)
  return ClusterSpec(tasks("worker"), tasks("ps"), tasks("chief"), source)


def spec_from(cluster_resolver=None) -> ClusterSpec:
  """The cluster a `ParameterServerStrategy` runs on: from a resolver, a
  mapping of roles to addresses (or counts), or None (`TF_CONFIG` if set,
  else a `LocalClusterResolver()`).

  Raises:
    jdist.ClusterError: no "ps" (or "worker") tasks, or this process is not
      `TF_CONFIG`'s chief.
  """
  if cluster_resolver is None:
    if os.environ.get("TF_CONFIG"):
      cluster_resolver = TFConfigClusterResolver()
    else:
      cluster_resolver = LocalClusterResolver()
  if isinstance(cluster_resolver, LocalClusterResolver):
    return _from_mapping(cluster_resolver.cluster_spec(),
                         "LocalClusterResolver")
  if isinstance(cluster_resolver, TFConfigClusterResolver):
    spec = cluster_resolver.cluster_spec()
    task_type = cluster_resolver.task_type
    if task_type in ("worker", "ps"):
      raise ClusterError(
          f"This process is TF_CONFIG's {task_type!r} {cluster_resolver.task_id}. "
          "Under jdist only the chief runs the training program: the workers "
          "and parameter servers are Ray actors (backend='ray') that Ray starts "
          "on the machines of its cluster (`ray start --address=HEAD:6379` on "
          "each), or threads of the chief. Run this program only as the chief.")
    return _from_mapping(spec, "TF_CONFIG")
  if isinstance(cluster_resolver, Mapping):
    return _from_mapping(cluster_resolver, "the cluster mapping")
  raise TypeError(
      f"ParameterServerStrategy needs a cluster resolver "
      f"(jdist.cluster_resolver.TFConfigClusterResolver or "
      f"LocalClusterResolver) or a mapping of roles to tasks, got "
      f"{type(cluster_resolver).__name__}.")
