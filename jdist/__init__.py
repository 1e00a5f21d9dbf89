"""jdist: tf.distribute's strategies as JAX transforms.

Example:
  >>> import jdist
  >>> strategy = jdist.MirroredStrategy()
  >>> strategy.num_replicas_in_sync >= 1
  True
"""

from jdist import cluster_resolver
from jdist import losses
from jdist import metrics
from jdist._src.checkpoint.manager import CheckpointManager
from jdist._src.core.function import DistributedFunction
from jdist._src.core.multi_step import MultiStepFunction
from jdist._src.core.multi_step import multi_step
from jdist._src.core.reduce_op import ReduceOp
from jdist._src.core.reduce_op import VariableAggregation
from jdist._src.core.replica_context import ReplicaContext
from jdist._src.core.values import BatchGroup
from jdist._src.core.values import PerReplica
from jdist._src.core.values import Sharded
from jdist._src.core.values import SyncOnRead
from jdist._src.core.values import ValueContext
from jdist._src.core.values import read_value
from jdist._src.current import all_reduce
from jdist._src.current import get_replica_context
from jdist._src.current import get_strategy
from jdist._src.current import has_strategy
from jdist._src.current import in_cross_replica_context
from jdist._src.diagnose import Diagnosis
from jdist._src.diagnose import StepTimes
from jdist._src.diagnose import diagnose
from jdist._src.errors import CancelledError
from jdist._src.errors import CheckpointDirectoryError
from jdist._src.errors import CheckpointError
from jdist._src.errors import CheckpointInUseError
from jdist._src.errors import CheckpointMismatchError
from jdist._src.errors import CheckpointNotFoundError
from jdist._src.errors import ClusterError
from jdist._src.errors import CollectiveTimeoutError
from jdist._src.errors import DistributionError
from jdist._src.errors import DoubleReductionError
from jdist._src.errors import Error
from jdist._src.errors import LossScalingError
from jdist._src.errors import OutOfRangeError
from jdist._src.errors import ParameterServerError
from jdist._src.errors import PeerFailureError
from jdist._src.errors import ProgramMismatchError
from jdist._src.errors import ReplicaContextError
from jdist._src.errors import ShardingError
from jdist._src.errors import StrategyMismatchError
from jdist._src.errors import VaryingStateError
from jdist._src.errors import WorkerFailedError
from jdist._src.input.context import InputContext
from jdist._src.input.dataset import DistributedDataset
from jdist._src.input.dataset import DistributedIterator
from jdist._src.input.optional import Optional
from jdist._src.input.options import InputOptions
from jdist._src.multiprocess.options import CommunicationOptions
from jdist._src.multiprocess.runtime import Runtime
from jdist._src.multiprocess.runtime import initialize
from jdist._src.ops.accumulation import accumulate_gradients
from jdist._src.ops.loss_scale import DynamicLossScale
from jdist._src.ops.loss_scale import LossScaleState
from jdist._src.ops.loss_scale import all_finite
from jdist._src.ops.loss_scale import loss_scale_optimizer
from jdist._src.ops.losses import compute_average_loss
from jdist._src.ops.losses import scale_regularization_loss
from jdist._src.ops.precision import DTypePolicy
from jdist._src.ops.random import dropout
from jdist._src.ops.random import example_keys
from jdist._src.ops.sharded_optimizer import ShardedOptimizer
from jdist._src.ps.coordinator import ClusterCoordinator
from jdist._src.ps.datasets import PerWorkerDataset
from jdist._src.ps.datasets import PerWorkerIterator
from jdist._src.ps.partitioners import FixedShardsPartitioner
from jdist._src.ps.partitioners import MaxSizePartitioner
from jdist._src.ps.partitioners import MinSizePartitioner
from jdist._src.ps.partitioners import Partitioner
from jdist._src.ps.remote import RemoteValue
from jdist._src.ps.strategy import ParameterServerStrategy
from jdist._src.ps.variables import ServerVariables
from jdist._src.strategies.spmd import Strategy
from jdist._src.strategies.central_storage import CentralStorageStrategy
from jdist._src.strategies.cross_device_ops import CrossDeviceOps
from jdist._src.strategies.cross_device_ops import HierarchicalCopyAllReduce
from jdist._src.strategies.cross_device_ops import NcclAllReduce
from jdist._src.strategies.cross_device_ops import ReductionToOneDevice
from jdist._src.strategies.device_mesh import DeviceMesh
from jdist._src.strategies.layout_map import LayoutMap
from jdist._src.strategies.mirrored import MirroredStrategy
from jdist._src.strategies.mirrored import OneDeviceStrategy
from jdist._src.strategies.mirrored import mirrored
from jdist._src.strategies.model_parallel import ModelParallelStrategy
from jdist._src.strategies.multi_worker import MultiWorkerMirroredStrategy
from jdist._src.strategies.tpu import TPUStrategy
from jdist._src.training.callbacks import Callback
from jdist._src.training.checkpoint_callbacks import BackupAndRestore
from jdist._src.training.checkpoint_callbacks import ModelCheckpoint
from jdist._src.training.control import EarlyStopping
from jdist._src.training.dataset_creator import DatasetCreator
from jdist._src.training.control import LearningRateScheduler
from jdist._src.training.history import History
from jdist._src.training.loggers import CSVLogger
from jdist._src.training.loggers import TensorBoard
from jdist._src.training.state import TrainState
from jdist._src.training.terminate_on_nan import TerminateOnNaN
from jdist._src.training.trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "BackupAndRestore",
    "BatchGroup",
    "CSVLogger",
    "Callback",
    "CancelledError",
    "CentralStorageStrategy",
    "CheckpointDirectoryError",
    "CheckpointError",
    "CheckpointInUseError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ClusterCoordinator",
    "ClusterError",
    "CollectiveTimeoutError",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DTypePolicy",
    "DatasetCreator",
    "DeviceMesh",
    "Diagnosis",
    "DistributedDataset",
    "DistributedFunction",
    "DistributedIterator",
    "DistributionError",
    "DoubleReductionError",
    "DynamicLossScale",
    "EarlyStopping",
    "Error",
    "FixedShardsPartitioner",
    "HierarchicalCopyAllReduce",
    "History",
    "InputContext",
    "InputOptions",
    "LayoutMap",
    "LearningRateScheduler",
    "LossScaleState",
    "LossScalingError",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "MirroredStrategy",
    "ModelCheckpoint",
    "ModelParallelStrategy",
    "MultiStepFunction",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "Optional",
    "OutOfRangeError",
    "ParameterServerError",
    "ParameterServerStrategy",
    "Partitioner",
    "PeerFailureError",
    "PerReplica",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "ProgramMismatchError",
    "ReduceOp",
    "ReductionToOneDevice",
    "RemoteValue",
    "ReplicaContext",
    "ReplicaContextError",
    "Runtime",
    "ServerVariables",
    "Sharded",
    "ShardedOptimizer",
    "ShardingError",
    "StepTimes",
    "Strategy",
    "StrategyMismatchError",
    "SyncOnRead",
    "TPUStrategy",
    "TensorBoard",
    "TerminateOnNaN",
    "TrainState",
    "Trainer",
    "ValueContext",
    "VariableAggregation",
    "VaryingStateError",
    "WorkerFailedError",
    "accumulate_gradients",
    "all_finite",
    "all_reduce",
    "cluster_resolver",
    "compute_average_loss",
    "diagnose",
    "dropout",
    "example_keys",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "loss_scale_optimizer",
    "losses",
    "metrics",
    "mirrored",
    "multi_step",
    "read_value",
    "scale_regularization_loss",
]
