"""Cluster resolvers: a description of a job (explicit values, jdist's
variables, JAX's detection) as a `ClusterConfig`, the arguments of
`jax.distributed.initialize`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from jdist._src import jax_compat
from jdist._src.errors import ClusterError
from jdist._src.launcher.job_env import (ENV_COORDINATOR,
                                             ENV_LOCAL_DEVICE_IDS,
                                             ENV_NUM_PROCESSES,
                                             ENV_PROCESS_ID)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """How this process joins a run: what `jax.distributed.initialize` needs.

  Attributes:
    coordinator_address: "host:port" of process 0's coordination service.
    num_processes: how many processes take part.
    process_id: this process, 0 to `num_processes - 1`.
    local_device_ids: the accelerators this process drives (None: all).
    source: where the values came from ("TF_CONFIG", ...).

  Example:
    >>> from jdist.cluster_resolver import ClusterConfig
    >>> ClusterConfig("10.0.0.1:1234", 2, 1).task_id
    1
  """

  coordinator_address: str
  num_processes: int
  process_id: int
  local_device_ids: tuple | None = None
  source: str = "explicit arguments"

  def __post_init__(self):
    where = f" (from {self.source})"
    if not isinstance(self.num_processes, int) or self.num_processes < 1:
      raise ClusterError(f"num_processes must be a positive integer, got "
                         f"{self.num_processes!r}{where}.")
    if (not isinstance(self.process_id, int) or
        not 0 <= self.process_id < self.num_processes):
      raise ClusterError(
          f"process_id must be an integer from 0 to {self.num_processes - 1}, "
          f"got {self.process_id!r}{where}. Number the processes 0, 1, ..., "
          "num_processes - 1, with the coordinator as process 0.")
    if self.num_processes > 1:
      _check_address(self.coordinator_address, where)
    if self.local_device_ids is not None:
      object.__setattr__(self, "local_device_ids",
                         tuple(int(i) for i in self.local_device_ids))

  # TensorFlow's names, for code written against tf.distribute resolvers.
  task_type = property(lambda self: "worker")
  task_id = property(lambda self: self.process_id)

  def master(self) -> str:
    """The coordinator's address (TensorFlow's name for it)."""
    return self.coordinator_address


def _check_address(address: Any, where: str) -> None:
  host, sep, port = str(address or "").rpartition(":")
  if not (isinstance(address, str) and sep and host and port.isdigit()):
    raise ClusterError(
        f"The coordinator address must look like 'host:port' (for example "
        f"'10.0.0.1:1234'), got {address!r}{where}.")


class ClusterResolver:
  """Base class: `resolve()` returns a `ClusterConfig`, or None when the
  environment it reads is absent."""

  def resolve(self) -> ClusterConfig | None:
    raise NotImplementedError

  def cluster_config(self) -> ClusterConfig:
    """The resolved config; raises `jdist.ClusterError` if there is none."""
    config = self.resolve()
    if config is None:
      raise ClusterError(f"{type(self).__name__} found nothing to resolve in "
                         "this environment.")
    return config


class SimpleClusterResolver(ClusterResolver):
  """A cluster given explicitly.

  Args:
    coordinator_address: "host:port" of process 0; the port must be free there.
    num_processes: how many processes take part.
    process_id: this process's index.
    local_device_ids: optional accelerator ids this process drives.

  Example:
    >>> import jdist
    >>> r = jdist.cluster_resolver.SimpleClusterResolver("10.0.0.1:1234", 2, 0)
    >>> r.resolve().num_processes
    2
  """

  def __init__(self, coordinator_address: str, num_processes: int,
               process_id: int, local_device_ids: Sequence[int] | None = None):
    self._config = ClusterConfig(coordinator_address, num_processes, process_id,
                                 local_device_ids)

  def resolve(self) -> ClusterConfig:
    return self._config


class EnvironmentClusterResolver(ClusterResolver):
  """jdist's own variables, as `jdist launch` sets them (`JDIST_*`).

  Example:
    >>> import jdist
    >>> env = {"JDIST_COORDINATOR_ADDRESS": "127.0.0.1:1234",
    ...        "JDIST_NUM_PROCESSES": "2", "JDIST_PROCESS_ID": "1"}
    >>> jdist.cluster_resolver.EnvironmentClusterResolver(env).resolve().process_id
    1
  """

  def __init__(self, environ: Mapping[str, str] | None = None):
    self._environ = os.environ if environ is None else environ

  def resolve(self) -> ClusterConfig | None:
    env = self._environ
    if ENV_NUM_PROCESSES not in env:
      return None
    where = "jdist's environment variables"
    ids = env.get(ENV_LOCAL_DEVICE_IDS)
    return ClusterConfig(
        env.get(ENV_COORDINATOR, ""),
        _int(env, ENV_NUM_PROCESSES, where), _int(env, ENV_PROCESS_ID, where),
        None if not ids else tuple(_ints(ids, ENV_LOCAL_DEVICE_IDS)),
        source=where)


def _int(env: Mapping[str, str], name: str, where: str) -> int:
  value = env.get(name)
  try:
    return int(value)
  except (TypeError, ValueError):
    raise ClusterError(f"{name}={value!r} is not an integer ({where}). Set it "
                       "to a whole number, or unset it.") from None


def _ints(text: str, name: str) -> list:
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ClusterError(f"{name}={text!r} must be a comma-separated list of "
                       "integers, e.g. '0,1'.") from None


class JaxClusterResolver(ClusterResolver):
  """JAX's own cluster auto-detection: SLURM, Open MPI, Kubernetes, Cloud TPU.

  Args:
    method: a JAX `cluster_detection_method` name ("slurm", ...) or None.

  Example:
    >>> import jdist
    >>> env = jdist.cluster_resolver.JaxClusterResolver()
    >>> env.resolve() is None or env.resolve().num_processes >= 1
    True
  """

  def __init__(self, method: str | None = None, *,
               initialization_timeout: int = 300):
    self._method = method
    self._timeout = initialization_timeout

  def detected(self):
    """The JAX `ClusterEnv` class found here, or None."""
    types = jax_compat.cluster_environments()
    if self._method is not None:
      env = next((e for e in types if e.name == self._method), None)
      if env is None:
        names = sorted(e.name for e in types if e.name)
        raise ClusterError(f"JAX knows no cluster detection method "
                           f"{self._method!r}; choose one of {names}.")
      return env if env.is_env_present() else None
    return next((e for e in types
                 if not e.opt_in_only_method and e.is_env_present()), None)

  def resolve(self) -> ClusterConfig | None:
    env = self.detected()
    if env is None:
      if self._method is not None:
        raise ClusterError(f"JAX's {self._method!r} cluster environment is not "
                           "present in this process.")
      return None
    port = os.environ.get("JAX_COORDINATOR_PORT")
    count = env.get_process_count()
    address = (os.environ.get("JAX_COORDINATOR_ADDRESS") or
               (env.get_coordinator_address(timeout_secs=self._timeout,
                                            override_coordinator_port=port)
                if count > 1 else ""))
    local = (None if jax_compat.running_in_cloud_tpu_vm()
             else env.get_local_process_id())
    return ClusterConfig(address, count, env.get_process_id(),
                         None if local is None else (local,),
                         source=f"JAX's {env.__name__} detection")


class TPUClusterResolver(JaxClusterResolver):
  """A Cloud TPU VM or pod slice, as JAX detects it (TensorFlow's name).

  Args:
    tpu: accepted for TensorFlow compatibility; JAX finds the TPU itself.
  """

  def __init__(self, tpu: str | None = None, **kwargs):
    del tpu
    super().__init__(None, **kwargs)

  def resolve(self) -> ClusterConfig:
    env = self.detected()
    if env is None or not jax_compat.is_cloud_tpu_cluster(env):
      raise ClusterError(
          "TPUClusterResolver found no Cloud TPU here. Run on a Cloud TPU VM or "
          "a Colab TPU runtime (with jax[tpu] installed).")
    return super().resolve()
