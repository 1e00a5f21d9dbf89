"""jdist: tf.distribute's strategies as JAX transforms.

Example:
  >>> import jdist
  >>> strategy = jdist.MirroredStrategy()
  >>> strategy.num_replicas_in_sync >= 1
  True
"""

from jdist._src.input import DistributedDataset
from jdist._src.input import DistributedIterator
from jdist._src.input import InputContext
from jdist._src.engine import DistributedFunction
from jdist._src.losses import compute_average_loss
from jdist._src.losses import scale_regularization_loss
from jdist._src.mirrored import MirroredStrategy
from jdist._src.mirrored import OneDeviceStrategy
from jdist._src.mirrored import mirrored
from jdist._src.random import dropout
from jdist._src.random import example_keys
from jdist._src.replica_context import ReplicaContext
from jdist._src.scope import all_reduce
from jdist._src.scope import get_replica_context
from jdist._src.scope import get_strategy
from jdist._src.scope import has_strategy
from jdist._src.scope import in_cross_replica_context
from jdist._src.strategy import Strategy
from jdist._src.types import DistributionError
from jdist._src.types import DoubleReductionError
from jdist._src.types import ReduceOp
from jdist._src.types import StrategyMismatchError
from jdist._src.types import VariableAggregation
from jdist._src.types import VaryingStateError
from jdist._src.values import PerReplica
from jdist._src.values import SyncOnRead
from jdist._src.values import ValueContext
from jdist._src.values import read_value

__version__ = "0.1.0"

__all__ = [
    "DistributedDataset",
    "DistributedFunction",
    "DistributedIterator",
    "DistributionError",
    "DoubleReductionError",
    "InputContext",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyMismatchError",
    "SyncOnRead",
    "ValueContext",
    "VariableAggregation",
    "VaryingStateError",
    "all_reduce",
    "compute_average_loss",
    "dropout",
    "example_keys",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "mirrored",
    "read_value",
    "scale_regularization_loss",
]
