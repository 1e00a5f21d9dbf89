"""`Source`: the one protocol through which data reaches `fit`, `evaluate`
and `predict`, in the manner of Keras' `DataAdapter`.

Every kind of input is a `Source`: arrays (`array_source.py`), re-iterables
and one-shot iterators of batches, tf.data and grain datasets
(`iterable_source.py`), and a `DatasetCreator`'s per-pipeline input, which
under parameter servers is each worker's own (`dataset_creator.py`). The
loop asks a source one thing per epoch, `distributed(...)`: what the train
function takes for each call, already placed by the strategy. A source read
on this host gives global batches (`batches`), which the strategy
distributes and groups; a `DatasetCreator`'s pipelines are the strategy's
own. The Trainer checks each source the same way before any step
(`peek`, `check_targets`, `static_batch_size`), and a checkpoint stores
what each needs to resume (`state`, `resume`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

from jdist._src.input import host


class Source:
  """What `fit`, `evaluate` and `predict` read data through.

  The defaults serve sources of global batches read on this host; a
  source whose batches come from elsewhere overrides `distributed` and
  `static_batch_size`.

  Attributes:
    steps_per_epoch: batches per epoch, or None (until the data ends).
    pass_length: batches in a pass over the data, or None (not known, or
      the data cannot start again). Epochs shorter than a pass continue it
      (`epochs.epoch_span`).
    one_shot: the batches come from an iterator that cannot start again:
      an epoch continues where the last one ended, and how many batches
      follow the first is known only by reading them.
    whole_calls: the data is read in whole calls of the train function (a
      `DatasetCreator`'s pipelines): an epoch must hold whole calls.
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
    """Has every target checked by `check(y, where)`: arrays at once, batches
    as they are read (the first one at once)."""
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
    """Epoch `epoch`'s items from batch `start` on, as a step function takes
    them: the batches distributed by `strategy` (with `options`, padded to
    `batch_size`), in groups of `per_call` (`BatchGroup`s) when a call takes
    several, with their inputs alone (`{"x"}`) if `inputs_only`."""
    batches = self.batches(epoch, start)
    if inputs_only:
      batches = ({"x": b["x"]} for b in batches)
    dataset = strategy.experimental_distribute_dataset(
        batches, options, global_batch_size=batch_size)
    return dataset.group(per_call) if per_call > 1 else dataset

  def static_batch_size(self, strategy, what: str, *, micro_batches: int = 1,
                        pad: bool = False) -> int | None:
    """The global batch size steps compile for: the first batch's.

    Data that fits in one batch (fewer examples than `batch_size`, fewer
    than the replicas) is one short batch, padded as the input layer pads a
    short last batch (`input/host.py: padded_size`). None for a one-shot
    iterator whose first batch does not split: the distributed dataset
    decides when it sees whether another batch follows.

    Args:
      strategy: the strategy whose replicas (and, under FSDP, the devices
        of each replica: `host.batch_split`) share every batch.
      what: the data's name in messages ("training data", ...).
      micro_batches: M: each replica's share of a batch is split into M
        micro-batches (the Trainer's `micro_batches`), so each replica's
        share must be a multiple of M (and of its FSDP devices).
      pad: pad every batch to such a multiple instead
        (`InputOptions.pad_to_replicas`).

    Raises:
      ValueError: the batches cannot split evenly over the replicas (and
        micro-batches, and FSDP's devices); the message names
        `pad_to_replicas`.
    """
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
