"""The facade as type checkers and IDEs read it: each public name and the
module that defines it, as `jdist/__init__.py` imports it on first use.

tests/test_typing.py keeps this file equal to `jdist.__all__` and to the
modules `jdist/__init__.py` names.
"""

from jdist._src.checkpoint.manager import (
    CheckpointManager as CheckpointManager,
)
from jdist._src.core.function import (
    DistributedFunction as DistributedFunction,
)
from jdist._src.core.multi_step import (
    MultiStepFunction as MultiStepFunction,
    multi_step as multi_step,
)
from jdist._src.core.reduce_op import (
    ReduceOp as ReduceOp,
    VariableAggregation as VariableAggregation,
)
from jdist._src.core.replica_context import (
    ReplicaContext as ReplicaContext,
)
from jdist._src.core.values import (
    BatchGroup as BatchGroup,
    PerReplica as PerReplica,
    Sharded as Sharded,
    SyncOnRead as SyncOnRead,
    ValueContext as ValueContext,
    read_value as read_value,
)
from jdist._src.current import (
    all_reduce as all_reduce,
    get_replica_context as get_replica_context,
    get_strategy as get_strategy,
    has_strategy as has_strategy,
    in_cross_replica_context as in_cross_replica_context,
)
from jdist._src.diagnose import (
    Diagnosis as Diagnosis,
    StepTimes as StepTimes,
    diagnose as diagnose,
)
from jdist._src.errors import (
    CancelledError as CancelledError,
    CheckpointDirectoryError as CheckpointDirectoryError,
    CheckpointError as CheckpointError,
    CheckpointInUseError as CheckpointInUseError,
    CheckpointMismatchError as CheckpointMismatchError,
    CheckpointNotFoundError as CheckpointNotFoundError,
    ClusterError as ClusterError,
    CollectiveTimeoutError as CollectiveTimeoutError,
    DistributionError as DistributionError,
    DoubleReductionError as DoubleReductionError,
    Error as Error,
    LossScalingError as LossScalingError,
    MemoryBudgetError as MemoryBudgetError,
    OutOfRangeError as OutOfRangeError,
    ParameterServerError as ParameterServerError,
    PeerFailureError as PeerFailureError,
    ProgramMismatchError as ProgramMismatchError,
    ReplicaContextError as ReplicaContextError,
    ShardingError as ShardingError,
    StrategyMismatchError as StrategyMismatchError,
    VaryingStateError as VaryingStateError,
    WorkerFailedError as WorkerFailedError,
)
from jdist._src.input.context import (
    InputContext as InputContext,
)
from jdist._src.input.dataset import (
    DistributedDataset as DistributedDataset,
    DistributedIterator as DistributedIterator,
)
from jdist._src.input.optional import (
    Optional as Optional,
)
from jdist._src.input.options import (
    InputOptions as InputOptions,
)
from jdist._src.keras.functions import (
    KerasFunctions as KerasFunctions,
    KerasVariables as KerasVariables,
    keras_functions as keras_functions,
)
from jdist._src.ops.accumulation import (
    accumulate_gradients as accumulate_gradients,
)
from jdist._src.ops.loss_scale import (
    DynamicLossScale as DynamicLossScale,
    LossScaleState as LossScaleState,
    all_finite as all_finite,
    loss_scale_optimizer as loss_scale_optimizer,
)
from jdist._src.ops.losses import (
    compute_average_loss as compute_average_loss,
    scale_regularization_loss as scale_regularization_loss,
)
from jdist._src.ops.pipeline import (
    pipeline as pipeline,
)
from jdist._src.ops.precision import (
    DTypePolicy as DTypePolicy,
)
from jdist._src.ops.random import (
    dropout as dropout,
    example_keys as example_keys,
)
from jdist._src.ops.sharded_optimizer import (
    ShardedOptimizer as ShardedOptimizer,
)
from jdist._src.planning import (
    plan as plan,
)
from jdist._src.planning.report import (
    Plan as Plan,
)
from jdist._src.ps.coordinator import (
    ClusterCoordinator as ClusterCoordinator,
)
from jdist._src.ps.datasets import (
    PerWorkerDataset as PerWorkerDataset,
    PerWorkerIterator as PerWorkerIterator,
)
from jdist._src.ps.partitioners import (
    FixedShardsPartitioner as FixedShardsPartitioner,
    MaxSizePartitioner as MaxSizePartitioner,
    MinSizePartitioner as MinSizePartitioner,
    Partitioner as Partitioner,
)
from jdist._src.ps.remote import (
    RemoteValue as RemoteValue,
)
from jdist._src.ps.strategy import (
    ParameterServerStrategy as ParameterServerStrategy,
)
from jdist._src.ps.variables import (
    ServerVariables as ServerVariables,
)
from jdist._src.runtime.options import (
    CommunicationOptions as CommunicationOptions,
)
from jdist._src.runtime.runtime import (
    Runtime as Runtime,
    initialize as initialize,
)
from jdist._src.strategies.central_storage import (
    CentralStorageStrategy as CentralStorageStrategy,
)
from jdist._src.strategies.cross_device_ops import (
    CrossDeviceOps as CrossDeviceOps,
    HierarchicalCopyAllReduce as HierarchicalCopyAllReduce,
    NcclAllReduce as NcclAllReduce,
    ReductionToOneDevice as ReductionToOneDevice,
)
from jdist._src.strategies.device_mesh import (
    DeviceMesh as DeviceMesh,
)
from jdist._src.strategies.layout_map import (
    LayoutMap as LayoutMap,
)
from jdist._src.strategies.mirrored import (
    MirroredStrategy as MirroredStrategy,
    OneDeviceStrategy as OneDeviceStrategy,
    mirrored as mirrored,
)
from jdist._src.strategies.model_parallel import (
    ModelParallelStrategy as ModelParallelStrategy,
)
from jdist._src.strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from jdist._src.strategies.spmd import (
    Strategy as Strategy,
)
from jdist._src.strategies.tpu import (
    TPUStrategy as TPUStrategy,
)
from jdist._src.training.callbacks import (
    Callback as Callback,
)
from jdist._src.training.checkpoint_callbacks import (
    BackupAndRestore as BackupAndRestore,
    ModelCheckpoint as ModelCheckpoint,
)
from jdist._src.training.control import (
    EarlyStopping as EarlyStopping,
    LearningRateScheduler as LearningRateScheduler,
    ReduceLROnPlateau as ReduceLROnPlateau,
)
from jdist._src.training.dataset_creator import (
    DatasetCreator as DatasetCreator,
)
from jdist._src.training.history import (
    History as History,
)
from jdist._src.training.loggers import (
    CSVLogger as CSVLogger,
    TensorBoard as TensorBoard,
)
from jdist._src.training.state import (
    TrainState as TrainState,
)
from jdist._src.training.terminate_on_nan import (
    TerminateOnNaN as TerminateOnNaN,
)
from jdist._src.training.trainer import (
    Trainer as Trainer,
)
from jdist import cluster_resolver as cluster_resolver
from jdist import losses as losses
from jdist import metrics as metrics

__version__: str

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
    "KerasFunctions",
    "KerasVariables",
    "LayoutMap",
    "LearningRateScheduler",
    "LossScaleState",
    "LossScalingError",
    "MaxSizePartitioner",
    "MemoryBudgetError",
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
    "Plan",
    "ProgramMismatchError",
    "ReduceLROnPlateau",
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
    "keras_functions",
    "loss_scale_optimizer",
    "losses",
    "metrics",
    "mirrored",
    "multi_step",
    "pipeline",
    "plan",
    "read_value",
    "scale_regularization_loss",
]
