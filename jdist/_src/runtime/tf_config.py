"""TensorFlow's `TF_CONFIG`, translated so a TF job's environment works as is."""

from __future__ import annotations

import json
import os
from typing import Mapping

from jdist._src.errors import ClusterError
from jdist._src.runtime.cluster import ClusterConfig, ClusterResolver


class TFConfigClusterResolver(ClusterResolver):
  """Translates TensorFlow's `TF_CONFIG` so a TF job's environment works as is.

  The processes are the chief (if any), then the workers; the first hosts
  the coordinator.

  Args:
    tf_config: the JSON text or dict; default: the `TF_CONFIG` variable.

  Example:
    >>> import jdist
    >>> cfg = {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
    ...        "task": {"type": "worker", "index": 1}}
    >>> c = jdist.cluster_resolver.TFConfigClusterResolver(cfg).resolve()
    >>> (c.coordinator_address, c.num_processes, c.process_id)
    ('h0:2222', 3, 2)
  """

  def __init__(self, tf_config: str | Mapping | None = None):
    self._tf_config = tf_config

  def _parsed(self) -> dict:
    raw = self._tf_config
    if raw is None:
      raw = os.environ.get("TF_CONFIG")
      if not raw:
        return {}
    if isinstance(raw, str):
      try:
        raw = json.loads(raw)
      except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e}): {raw[:200]!r}") from None
    if not isinstance(raw, Mapping):
      raise ClusterError("TF_CONFIG must be a JSON object with 'cluster' and "
                         "'task' entries.")
    return raw

  def cluster_spec(self) -> dict:
    """TF_CONFIG's cluster, every role (also "ps", which `resolve` rejects)."""
    return dict(self._parsed().get("cluster") or {})

  @property
  def task_type(self) -> str | None:
    """This process's role in TF_CONFIG ("chief", "worker", "ps", ...)."""
    return (self._parsed().get("task") or {}).get("type")

  @property
  def task_id(self) -> int:
    """This process's index among the tasks of its role."""
    return int((self._parsed().get("task") or {}).get("index", 0))

  def resolve(self) -> ClusterConfig | None:
    raw = self._parsed()
    cluster, task = raw.get("cluster") or {}, raw.get("task") or {}
    if not cluster:
      return None  # TensorFlow treats a TF_CONFIG without cluster as local.
    roles = set(cluster) - {"chief", "worker"}
    task_type = task.get("type")
    if task_type in ("evaluator",):
      raise ClusterError(
          "This process is TF_CONFIG's 'evaluator', which is not part of the "
          "training cluster: run evaluation without MultiWorkerMirroredStrategy "
          "(for example with jdist.MirroredStrategy()).")
    if roles - {"evaluator"}:
      raise ClusterError(
          f"TF_CONFIG has roles {sorted(roles - {'evaluator'})}; synchronous "
          "training uses only 'chief' and 'worker'. Parameter servers belong to "
          "ParameterServerStrategy.")
    members = ([("chief", i, a) for i, a in enumerate(cluster.get("chief", []))] +
               [("worker", i, a) for i, a in enumerate(cluster.get("worker", []))])
    if not members:
      raise ClusterError("TF_CONFIG's cluster lists no 'chief' or 'worker'.")
    try:
      index = int(task.get("index", 0))
    except (TypeError, ValueError):
      raise ClusterError(f"TF_CONFIG task index {task.get('index')!r} is not an "
                         "integer.") from None
    ids = [k for k, (t, i, _) in enumerate(members) if (t, i) == (task_type, index)]
    if not ids:
      raise ClusterError(
          f"TF_CONFIG's task {{'type': {task_type!r}, 'index': {index}}} is not in "
          f"its cluster ({', '.join(f'{t}:{i}' for t, i, _ in members)}).")
    return ClusterConfig(members[0][2], len(members), ids[0], source="TF_CONFIG")
