"""`Source`: the one protocol through which data reaches `fit`, `evaluate`
and `predict` (Keras' `DataAdapter`).

Arrays, iterables and datasets, and a `DatasetCreator`'s pipelines are
sources; the loop asks each epoch's `distributed(...)` of one.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

from jdist._src.input import host


class Source:
  """What `fit`, `evaluate` and `predict` read data through; the defaults
  serve global batches read on this host.

  Attributes:
    steps_per_epoch: batches per epoch, or None (until the data ends).
    pass_length: batches in a pass over the data, or None (unknown or
      one-shot); shorter epochs continue a pass.
    one_shot: an iterator that cannot start again.
    whole_calls: an epoch must hold whole calls (a `DatasetCreator`).
  """

  steps_per_epoch: int | None = None
  pass_length: int | None = None
  one_shot = False
  whole_calls = False

  def peek(self) -> dict:
    """The first batch, checked, without using it up."""
    raise NotImplementedError

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    """Epoch `epoch`'s global batches from batch `start` on, on the host."""
    raise NotImplementedError

  def check_targets(self, check: Callable) -> None:
    """Has every target checked by `check(y, where)` (batches as read)."""
    raise NotImplementedError

  def state(self, consumed: int) -> dict:
    """What a checkpoint stores to continue after `consumed` batches."""
    del consumed
    return {}

  def resume(self, state: dict, consumed: int) -> None:
    """Continues after `consumed` batches, from `state(consumed)`."""
    del state, consumed

  def distributed(self, strategy, epoch: int, start: int = 0, *,
                  options=None, batch_size: int | None = None,
                  per_call: int = 1, inputs_only: bool = False) -> Iterable:
    """Epoch `epoch`'s items from batch `start` on, as a step takes them:
    distributed by `strategy`, grouped by `per_call` (`BatchGroup`), only
    `{"x"}` if `inputs_only`."""
    batches = self.batches(epoch, start)
    if inputs_only:
      batches = ({"x": b["x"]} for b in batches)
    dataset = strategy.experimental_distribute_dataset(
        batches, options, global_batch_size=batch_size)
    return dataset.group(per_call) if per_call > 1 else dataset

  def static_batch_size(self, strategy, what: str, *, micro_batches: int = 1,
                        pad: bool = False) -> int | None:
    """The global batch size steps compile for (None: the first batch does
    not tell). ValueError if batches do not split without `pad`."""
    rows = host.batch_size_of(self.peek()["x"], f"{what}'s first batch")
    num_replicas = strategy.num_replicas_in_sync
    split, split_what = host.batch_split(strategy)
    parts = num_replicas * math.lcm(micro_batches, split // num_replicas)
    if rows % parts == 0:
      return rows
    if pad or self.steps_per_epoch == 1:
      return host.padded_size(rows, parts)
    or_pad = (" Or pass pad_to_replicas=True to jdist.Trainer to pad every "
              "such batch with masked rows, which losses and metrics leave "
              "out.")
    if rows % split:
      if self.one_shot and self.steps_per_epoch is None:
        return None
      raise ValueError(f"In the {what}: "
                       f"{host.split_error(rows, split, split_what)}{or_pad}")
    fsdp = ("" if split == num_replicas else
            f" and of the {split // num_replicas} devices that split it "
            "(FSDP)")
    raise ValueError(
        f"micro_batches={micro_batches} splits each replica's "
        f"batch into {micro_batches} micro-batches, but the global batch of "
        f"{rows} gives {rows // num_replicas} rows to each of {num_replicas} "
        f"replicas, not a multiple of {micro_batches}{fsdp}. Use a batch "
        f"size that is a multiple of {parts}.{or_pad}")
