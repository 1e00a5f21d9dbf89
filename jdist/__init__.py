"""jdist: tf.distribute's strategies as JAX transforms.

The facade: every public name, imported from the module that defines it on
first use (PEP 562), so that `import jdist` loads only what a program uses:
`jdist launch` starts its processes without loading JAX. Type checkers and
IDEs read the same names from `__init__.pyi` beside this file, which
tests/test_typing.py keeps equal to `_EXPORTS`.

Example:
  >>> import jdist
  >>> strategy = jdist.MirroredStrategy()
  >>> strategy.num_replicas_in_sync >= 1
  True
"""

import importlib

__version__ = "0.1.0"

# Each public name and the module that defines it (a name that is a module
# maps to itself).
_EXPORTS = {
    "BackupAndRestore": "jdist._src.training.checkpoint_callbacks",
    "BatchGroup": "jdist._src.core.values",
    "CSVLogger": "jdist._src.training.loggers",
    "Callback": "jdist._src.training.callbacks",
    "CancelledError": "jdist._src.errors",
    "CentralStorageStrategy": "jdist._src.strategies.central_storage",
    "CheckpointDirectoryError": "jdist._src.errors",
    "CheckpointError": "jdist._src.errors",
    "CheckpointInUseError": "jdist._src.errors",
    "CheckpointManager": "jdist._src.checkpoint.manager",
    "CheckpointMismatchError": "jdist._src.errors",
    "CheckpointNotFoundError": "jdist._src.errors",
    "ClusterCoordinator": "jdist._src.ps.coordinator",
    "ClusterError": "jdist._src.errors",
    "CollectiveTimeoutError": "jdist._src.errors",
    "CommunicationOptions": "jdist._src.runtime.options",
    "CrossDeviceOps": "jdist._src.strategies.cross_device_ops",
    "DTypePolicy": "jdist._src.ops.precision",
    "DatasetCreator": "jdist._src.training.dataset_creator",
    "DeviceMesh": "jdist._src.strategies.device_mesh",
    "Diagnosis": "jdist._src.diagnose",
    "DistributedDataset": "jdist._src.input.dataset",
    "DistributedFunction": "jdist._src.core.function",
    "DistributedIterator": "jdist._src.input.dataset",
    "DistributionError": "jdist._src.errors",
    "DoubleReductionError": "jdist._src.errors",
    "DynamicLossScale": "jdist._src.ops.loss_scale",
    "EarlyStopping": "jdist._src.training.control",
    "Error": "jdist._src.errors",
    "FixedShardsPartitioner": "jdist._src.ps.partitioners",
    "HierarchicalCopyAllReduce": "jdist._src.strategies.cross_device_ops",
    "History": "jdist._src.training.history",
    "InputContext": "jdist._src.input.context",
    "InputOptions": "jdist._src.input.options",
    "KerasFunctions": "jdist._src.keras.functions",
    "KerasVariables": "jdist._src.keras.functions",
    "LayoutMap": "jdist._src.strategies.layout_map",
    "LearningRateScheduler": "jdist._src.training.control",
    "LossScaleState": "jdist._src.ops.loss_scale",
    "LossScalingError": "jdist._src.errors",
    "MemoryBudgetError": "jdist._src.errors",
    "MaxSizePartitioner": "jdist._src.ps.partitioners",
    "MinSizePartitioner": "jdist._src.ps.partitioners",
    "MirroredStrategy": "jdist._src.strategies.mirrored",
    "ModelCheckpoint": "jdist._src.training.checkpoint_callbacks",
    "ModelParallelStrategy": "jdist._src.strategies.model_parallel",
    "MultiStepFunction": "jdist._src.core.multi_step",
    "MultiWorkerMirroredStrategy": "jdist._src.strategies.multi_worker",
    "NcclAllReduce": "jdist._src.strategies.cross_device_ops",
    "OneDeviceStrategy": "jdist._src.strategies.mirrored",
    "Optional": "jdist._src.input.optional",
    "OutOfRangeError": "jdist._src.errors",
    "ParameterServerError": "jdist._src.errors",
    "ParameterServerStrategy": "jdist._src.ps.strategy",
    "Partitioner": "jdist._src.ps.partitioners",
    "PeerFailureError": "jdist._src.errors",
    "PerReplica": "jdist._src.core.values",
    "Plan": "jdist._src.planning.report",
    "PerWorkerDataset": "jdist._src.ps.datasets",
    "PerWorkerIterator": "jdist._src.ps.datasets",
    "ProgramMismatchError": "jdist._src.errors",
    "ReduceLROnPlateau": "jdist._src.training.control",
    "ReduceOp": "jdist._src.core.reduce_op",
    "ReductionToOneDevice": "jdist._src.strategies.cross_device_ops",
    "RemoteValue": "jdist._src.ps.remote",
    "ReplicaContext": "jdist._src.core.replica_context",
    "ReplicaContextError": "jdist._src.errors",
    "Runtime": "jdist._src.runtime.runtime",
    "ServerVariables": "jdist._src.ps.variables",
    "Sharded": "jdist._src.core.values",
    "ShardedOptimizer": "jdist._src.ops.sharded_optimizer",
    "ShardingError": "jdist._src.errors",
    "StepTimes": "jdist._src.diagnose",
    "Strategy": "jdist._src.strategies.spmd",
    "StrategyMismatchError": "jdist._src.errors",
    "SyncOnRead": "jdist._src.core.values",
    "TPUStrategy": "jdist._src.strategies.tpu",
    "TensorBoard": "jdist._src.training.loggers",
    "TerminateOnNaN": "jdist._src.training.terminate_on_nan",
    "TrainState": "jdist._src.training.state",
    "Trainer": "jdist._src.training.trainer",
    "ValueContext": "jdist._src.core.values",
    "VariableAggregation": "jdist._src.core.reduce_op",
    "VaryingStateError": "jdist._src.errors",
    "WorkerFailedError": "jdist._src.errors",
    "accumulate_gradients": "jdist._src.ops.accumulation",
    "all_finite": "jdist._src.ops.loss_scale",
    "all_reduce": "jdist._src.current",
    "cluster_resolver": "jdist.cluster_resolver",
    "compute_average_loss": "jdist._src.ops.losses",
    "diagnose": "jdist._src.diagnose",
    "dropout": "jdist._src.ops.random",
    "example_keys": "jdist._src.ops.random",
    "get_replica_context": "jdist._src.current",
    "get_strategy": "jdist._src.current",
    "has_strategy": "jdist._src.current",
    "in_cross_replica_context": "jdist._src.current",
    "initialize": "jdist._src.runtime.runtime",
    "keras_functions": "jdist._src.keras.functions",
    "loss_scale_optimizer": "jdist._src.ops.loss_scale",
    "losses": "jdist.losses",
    "metrics": "jdist.metrics",
    "mirrored": "jdist._src.strategies.mirrored",
    "multi_step": "jdist._src.core.multi_step",
    "pipeline": "jdist._src.ops.pipeline",
    "plan": "jdist._src.planning",
    "read_value": "jdist._src.core.values",
    "scale_regularization_loss": "jdist._src.ops.losses",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  """Imports `name`'s module on first use and keeps the name here."""
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'jdist' has no attribute {name!r}")
  value = importlib.import_module(module)
  if module != f"{__name__}.{name}":
    value = getattr(value, name)
  globals()[name] = value  # later uses do not come here
  return value


def __dir__() -> list:
  return sorted(set(globals()) | set(__all__))
