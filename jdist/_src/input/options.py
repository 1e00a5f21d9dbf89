"""`InputOptions`: how a distributed dataset brings batches to the devices."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """How a distributed dataset brings batches to the devices (TF's names).

  Attributes:
    experimental_fetch_to_device: place each batch on the devices ahead of
      the step, as TensorFlow does by default. Only True is supported: jdist
      hands out batches that are already placed (see the README, "Input").
    experimental_per_replica_buffer_size: batches (or groups) placed ahead of
      the one the loop is running (TF's default: 1). More hides slower or
      burstier host input, at the cost of device memory.
    experimental_prefetch_in_thread: read and place batches in a background
      thread. It pays when the loop waits for the devices and the host has
      work to do per batch (on 2 CPU devices with 100 us of host work per
      batch: 0.40 ms a step against 0.56 ms); with ready numpy batches it
      gains nothing, and on one CPU device it costs (the thread contends
      for Python's lock: 0.23 ms a step against 0.14 ms). One process only:
      with several, batches are read in the loop's thread.

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

  def __post_init__(self):
    size = self.experimental_per_replica_buffer_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
      raise ValueError(
          f"experimental_per_replica_buffer_size must be a whole number of "
          f"batches, 0 or more, got {size!r}.")
    if self.experimental_fetch_to_device is not True:
      raise ValueError(
          "InputOptions(experimental_fetch_to_device=False) is not supported: "
          "jdist places every batch on the devices ahead of the step (one "
          "transfer per batch, with its padding mask). Leave it True.")

  @classmethod
  def of(cls, options) -> "InputOptions":
    """Accepts None, an instance, or TensorFlow's `tf.distribute.InputOptions`
    (its fetch and buffer settings)."""
    if options is None:
      return cls()
    if isinstance(options, cls):
      return options
    if hasattr(options, "experimental_fetch_to_device"):
      return cls(
          experimental_fetch_to_device=bool(
              options.experimental_fetch_to_device is not False),
          experimental_per_replica_buffer_size=int(getattr(
              options, "experimental_per_replica_buffer_size", 1) or 1))
    raise TypeError(f"options must be jdist.InputOptions, got "
                    f"{type(options).__name__}.")
