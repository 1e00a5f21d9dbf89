"""Every error jdist raises on purpose: a `jdist.Error` that keeps a builtin
base (docs/errors.md lists where each is raised).

Example:
  >>> import jdist
  >>> issubclass(jdist.DoubleReductionError, (jdist.Error, ValueError))
  True
"""

from __future__ import annotations


class Error(Exception):
  """Base class of every error jdist raises on purpose."""


class DistributionError(Error, ValueError):
  """A distributed computation was set up in a way that cannot be right."""


class DoubleReductionError(DistributionError):
  """A SUM all-reduce of a value that is already the same on every replica."""


class VaryingStateError(DistributionError):
  """A step returned replica-varying values where mirrored state was passed in."""


class LossScalingError(DistributionError):
  """A step's loss is a mean over its replica's batch (gradients too large)."""


class StrategyMismatchError(DistributionError):
  """A distributed value, step or scope belongs to a different strategy."""


class ShardingError(DistributionError):
  """Optimizer state cannot be split over the replicas as asked."""


class MemoryBudgetError(DistributionError):
  """A step's planned per-device memory exceeds the device's or the budget."""


class ProgramMismatchError(DistributionError):
  """Processes of one run compiled different programs for the same step."""


class ReplicaContextError(Error, RuntimeError):
  """Code ran in the wrong context (a collective outside a step, ...)."""


class ClusterError(Error, RuntimeError):
  """This process could not join (or describe) a multi-process run."""


class CollectiveTimeoutError(Error, RuntimeError):
  """Peers did not join a collective or a rendezvous within the timeout."""


class PeerFailureError(Error, RuntimeError):
  """Another process of the run failed, so this one cannot continue."""


class CheckpointError(Error, RuntimeError):
  """A checkpoint cannot be written, or none in a directory restores."""


class CheckpointDirectoryError(Error, OSError):
  """A checkpoint directory cannot be used: a file, or not writable."""


class CheckpointInUseError(CheckpointDirectoryError):
  """Another running job writes checkpoints to the same directory."""


class CheckpointNotFoundError(Error, FileNotFoundError):
  """A directory holds no checkpoint to load."""


class CheckpointMismatchError(DistributionError):
  """A checkpoint holds a different model or optimizer than the trainer."""


class WorkerFailedError(Error, RuntimeError):
  """A worker of a parameter-server cluster failed (or hung); raise it from
  a scheduled function to say its worker is unusable."""


class ParameterServerError(Error, RuntimeError):
  """A parameter server is unavailable: its variables are lost (restart the
  cluster and restore them from a checkpoint)."""


class CancelledError(Error, RuntimeError):
  """A scheduled function did not run because an earlier one failed."""


class OutOfRangeError(Error, IndexError):
  """A per-worker iterator ran out of data inside a scheduled function."""


PUBLIC = (Error, DistributionError, DoubleReductionError, VaryingStateError,
          LossScalingError,
          StrategyMismatchError, ProgramMismatchError, ShardingError,
          MemoryBudgetError,
          ReplicaContextError,
          ClusterError, CollectiveTimeoutError, PeerFailureError,
          CheckpointError, CheckpointNotFoundError, CheckpointMismatchError,
          WorkerFailedError, ParameterServerError, CancelledError,
          OutOfRangeError, CheckpointDirectoryError, CheckpointInUseError)

# Tracebacks show the public name (jdist.ClusterError), not jdist._src.errors.
for _error in PUBLIC:
  _error.__module__ = "jdist"
del _error
