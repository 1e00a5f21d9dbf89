"""`InputContext`: what a dataset function is told of its pipeline."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class InputContext:
  """What `distribute_datasets_from_function` tells the dataset function.

  Attributes:
    num_input_pipelines: how many pipelines (processes) read data.
    input_pipeline_id: this pipeline's index, 0 to `num_input_pipelines - 1`.
    num_replicas_in_sync: replicas that consume each step's batches.

  Example:
    >>> import jdist
    >>> ctx = jdist.InputContext(1, 0, 4)
    >>> ctx.get_per_replica_batch_size(64)
    16
  """

  num_input_pipelines: int = 1
  input_pipeline_id: int = 0
  num_replicas_in_sync: int = 1

  def get_per_replica_batch_size(self, global_batch_size: int) -> int:
    """The batch each replica takes from a global batch of this size."""
    if global_batch_size % self.num_replicas_in_sync:
      raise ValueError(
          f"The global batch size {global_batch_size} does not divide evenly "
          f"over {self.num_replicas_in_sync} replicas. Use a multiple of "
          f"{self.num_replicas_in_sync}.")
    return global_batch_size // self.num_replicas_in_sync
