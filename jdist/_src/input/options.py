"""`InputOptions`: how a distributed dataset brings batches to the devices."""

from __future__ import annotations

import dataclasses

# The most batches (or groups) placed ahead. Each holds device memory until
# its step runs, and a buffer only needs to cover the longest stall of the
# input: a few batches do (TensorFlow's default is 1).
MAX_BUFFER_SIZE = 64


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """How a distributed dataset brings batches to the devices (TF's names).

  Attributes:
    experimental_fetch_to_device: place batches on the devices ahead (True).
    experimental_per_replica_buffer_size: batches placed ahead (0 to 64).
    experimental_prefetch_in_thread: read and place batches in a background
      thread (one process only).
    pad_to_replicas: pad a global batch the replicas do not divide with
      masked zero rows (without it, an error).

  Example:
    >>> import jdist, numpy as np
    >>> strategy = jdist.get_strategy()
    >>> options = jdist.InputOptions(experimental_per_replica_buffer_size=2)
    >>> data = strategy.experimental_distribute_dataset(
    ...     [np.ones((4, 2), np.float32)] * 3, options)
    >>> len(list(data))
    3
  """

  experimental_fetch_to_device: bool = True
  experimental_per_replica_buffer_size: int = 1
  experimental_prefetch_in_thread: bool = False
  pad_to_replicas: bool = False

  def __post_init__(self):
    size = self.experimental_per_replica_buffer_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
      raise ValueError(
          f"experimental_per_replica_buffer_size must be a whole number of "
          f"batches, 0 or more, got {size!r}.")
    if size > MAX_BUFFER_SIZE:
      raise ValueError(
          f"experimental_per_replica_buffer_size={size} is above jdist's "
          f"limit of {MAX_BUFFER_SIZE} batches: every batch placed ahead "
          "holds device memory until its step runs, and a buffer only needs "
          "to cover the longest stall of the input (TensorFlow's default is "
          "1; a few batches hide bursty input). Use a size of at most "
          f"{MAX_BUFFER_SIZE}.")
    fetch = self.experimental_fetch_to_device
    if fetch is not True:
      raise ValueError(
          f"InputOptions(experimental_fetch_to_device={fetch!r}) is not "
          "supported: only True (the default) is. jdist places every batch "
          "on the devices ahead of the step (one transfer per batch, with "
          "its padding mask); batches kept on the host are not available. "
          "Leave it out, or pass True.")
    thread = self.experimental_prefetch_in_thread
    if not isinstance(thread, bool):
      raise TypeError(
          f"experimental_prefetch_in_thread must be True or False, got "
          f"{thread!r} ({type(thread).__name__}).")
    if not isinstance(self.pad_to_replicas, bool):
      raise TypeError(
          f"pad_to_replicas must be True or False, got "
          f"{self.pad_to_replicas!r} ({type(self.pad_to_replicas).__name__}).")

  @classmethod
  def of(cls, options) -> "InputOptions":
    """Accepts None, an instance, or TensorFlow's `tf.distribute.InputOptions`
    (settings jdist cannot honour are errors).

    Example:
      >>> import collections, jdist
      >>> TFOptions = collections.namedtuple("InputOptions", [
      ...     "experimental_fetch_to_device", "experimental_replication_mode",
      ...     "experimental_place_dataset_on_device",
      ...     "experimental_per_replica_buffer_size"])
      >>> options = jdist.InputOptions.of(TFOptions(None, "PER_WORKER", False, 0))
      >>> options.experimental_per_replica_buffer_size  # TF's 0: none ahead
      0
    """
    if options is None:
      return cls()
    if isinstance(options, cls):
      return options
    if hasattr(options, "experimental_fetch_to_device"):
      _refuse_tf_settings(options)
      fetch = options.experimental_fetch_to_device
      return cls(
          experimental_fetch_to_device=True if fetch is None else fetch,
          experimental_per_replica_buffer_size=getattr(
              options, "experimental_per_replica_buffer_size", 1))
    raise TypeError(f"options must be jdist.InputOptions, got "
                    f"{type(options).__name__}.")


def _refuse_tf_settings(options) -> None:
  """TensorFlow's input settings that jdist has no counterpart for."""
  mode = getattr(options, "experimental_replication_mode", None)
  mode_name = getattr(mode, "name", mode)
  if mode_name not in (None, "PER_WORKER"):
    raise ValueError(
        f"experimental_replication_mode={mode_name} is not supported: jdist "
        "builds one input pipeline per process (TensorFlow's PER_WORKER); "
        "distribute_datasets_from_function's ctx.input_pipeline_id says "
        "which shard each process reads.")
  if getattr(options, "experimental_place_dataset_on_device", False):
    raise ValueError(
        "experimental_place_dataset_on_device=True is not supported: jdist "
        "reads datasets on the host and places each batch on the devices "
        "ahead of the step. Leave it False.")
