"""jdist: tf.distribute's strategies as JAX transforms.

Example:
  >>> import jdist
  >>> strategy = jdist.MirroredStrategy()
  >>> strategy.num_replicas_in_sync >= 1
  True
"""

from jdist import cluster_resolver
from jdist._src.guard import CommunicationOptions
from jdist._src.input import DistributedDataset
from jdist._src.input import DistributedIterator
from jdist._src.input import InputContext
from jdist._src.engine import DistributedFunction
from jdist._src.losses import compute_average_loss
from jdist._src.losses import scale_regularization_loss
from jdist._src.mirrored import MirroredStrategy
from jdist._src.mirrored import OneDeviceStrategy
from jdist._src.mirrored import mirrored
from jdist._src.multi_worker import MultiWorkerMirroredStrategy
from jdist._src.multihost import initialize
from jdist._src.random import dropout
from jdist._src.random import example_keys
from jdist._src.replica_context import ReplicaContext
from jdist._src.scope import all_reduce
from jdist._src.scope import get_replica_context
from jdist._src.scope import get_strategy
from jdist._src.scope import has_strategy
from jdist._src.scope import in_cross_replica_context
from jdist._src.strategy import Strategy
from jdist._src.tpu import TPUStrategy
from jdist._src.training.callbacks import Callback
from jdist._src.training.checkpoint import CheckpointMismatchError
from jdist._src.training.checkpoint_callbacks import BackupAndRestore
from jdist._src.training.checkpoint_callbacks import ModelCheckpoint
from jdist._src.training.control import EarlyStopping
from jdist._src.training.control import LearningRateScheduler
from jdist._src.training.history import History
from jdist._src.training.loggers import CSVLogger
from jdist._src.training.loggers import TensorBoard
from jdist._src.training.state import TrainState
from jdist._src.training.trainer import Trainer
from jdist._src.types import DistributionError
from jdist._src.types import ClusterError
from jdist._src.types import CollectiveTimeoutError
from jdist._src.types import DoubleReductionError
from jdist._src.types import PeerFailureError
from jdist._src.types import ProgramMismatchError
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
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CheckpointMismatchError",
    "ClusterError",
    "CollectiveTimeoutError",
    "CommunicationOptions",
    "DistributedDataset",
    "DistributedFunction",
    "DistributedIterator",
    "DistributionError",
    "DoubleReductionError",
    "EarlyStopping",
    "History",
    "InputContext",
    "LearningRateScheduler",
    "MirroredStrategy",
    "ModelCheckpoint",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PeerFailureError",
    "PerReplica",
    "ProgramMismatchError",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyMismatchError",
    "SyncOnRead",
    "TPUStrategy",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "ValueContext",
    "VariableAggregation",
    "VaryingStateError",
    "all_reduce",
    "cluster_resolver",
    "compute_average_loss",
    "dropout",
    "example_keys",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "mirrored",
    "read_value",
    "scale_regularization_loss",
]
