"""`fit(DatasetCreator(dataset_fn), steps_per_epoch=...)`: TensorFlow's input
made by a function, once per input pipeline.

fit reads it through the strategy's `distribute_datasets_from_function`, so
each strategy decides where the pipelines run: under
`ParameterServerStrategy` every worker builds its own (the data never passes
through the coordinator) and each scheduled step takes the next batch of the
worker that runs it; under the synchronous strategies every process builds
one, whose batches are per-replica (each step takes one per replica). Either
way `dataset_fn` runs once per pipeline and `fit`, and its iterator continues
from epoch to epoch; `steps_per_epoch` says where an epoch ends.

The host still calls `dataset_fn` once itself, for one batch: the Trainer
builds the model and checks the loss and metrics against it before any step
(a Keras model knows its input shapes; a flax model learns them from a batch).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

from jdist._src.input.context import InputContext
from jdist._src.training import data as data_lib


class DatasetCreator:
  """A function that makes a dataset, passed to `fit` (TensorFlow's name).

  `Trainer.fit(jdist.DatasetCreator(dataset_fn), steps_per_epoch=...)` has
  each input pipeline build its own data: under a
  `jdist.ParameterServerStrategy` every worker calls `dataset_fn` (once per
  `fit`; `input_context.input_pipeline_id` is the worker's index among
  `num_input_pipelines`, for sharding) and each of its batches is one step's
  batch, split over the worker's devices. Under the synchronous strategies
  it is `strategy.distribute_datasets_from_function(dataset_fn)`: every
  process calls it, and its batches are per-replica batches
  (`input_context.get_per_replica_batch_size`). Batches are `(x, y)`,
  `(x, y, sample_weight)` or `{"x", "y"}`. Make the dataset endless (repeat
  it): `fit` requires `steps_per_epoch`, and the next epoch continues the
  iterator.

  Args:
    dataset_fn: `dataset_fn(input_context) -> iterable of batches`.
    input_options: TensorFlow's `tf.distribute.InputOptions`; only None is
      supported.

  Example:
    >>> import jdist, numpy as np
    >>> def dataset_fn(ctx):
    ...   while True:
    ...     yield np.ones((8, 4), np.float32), np.zeros(8, np.int32)
    >>> creator = jdist.DatasetCreator(dataset_fn)
    >>> x, y = next(iter(creator(jdist.InputContext(2, 0, 1))))
    >>> x.shape
    (8, 4)
  """

  def __init__(self, dataset_fn: Callable, input_options=None):
    if not callable(dataset_fn):
      raise TypeError(
          f"DatasetCreator needs a function dataset_fn(input_context) that "
          f"returns the dataset, got {type(dataset_fn).__name__}.")
    if input_options is not None:
      raise ValueError(
          "DatasetCreator(input_options=...) is not supported: each pipeline "
          "places its batches as the strategy's "
          "distribute_datasets_from_function does by default. Leave "
          "input_options=None.")
    self.dataset_fn = dataset_fn
    self.input_options = input_options

  def __call__(self, input_context: InputContext) -> Any:
    """The dataset for one input pipeline: `dataset_fn(input_context)`."""
    return self.dataset_fn(input_context)


class _PipelineInput:
  """What each pipeline calls: the user's batches in the Trainer's
  `{"x", "y"}` form, checked as fit checks its batches."""

  def __init__(self, creator: DatasetCreator, class_weight, check):
    self._creator = creator
    self._class_weight = class_weight
    self._check = check

  def __call__(self, input_context: InputContext) -> Iterator[dict]:
    for i, batch in enumerate(self._creator(input_context)):
      yield data_lib.host_batch(batch, i, True, self._class_weight,
                                self._check)


class CreatorSource:
  """fit's `Source` for a `DatasetCreator` (see `data.Source`).

  Args:
    creator: the `DatasetCreator`.
    strategy: the strategy training runs under.
    steps_per_epoch: batches (steps) per epoch; required.
    class_weight: Keras' `class_weight`, applied where the batches are read.
    batches_per_call: batches each call of the train function takes
      (`steps_per_execution`, gradient accumulation): above 1, the items
      are `BatchGroup`s of that many batches.

  Raises:
    ValueError: no `steps_per_epoch`, or one that is not a multiple of
      `batches_per_call`.
  """

  one_shot = True
  pass_length = None  # (each worker's iterator continues from epoch to epoch)

  def __init__(self, creator: DatasetCreator, *, strategy,
               steps_per_epoch: int | None, class_weight=None,
               batches_per_call: int = 1):
    if steps_per_epoch is None:
      raise ValueError(
          "fit(jdist.DatasetCreator(...)) needs steps_per_epoch, as in "
          "TensorFlow: the dataset should be endless (repeated), so only "
          "steps_per_epoch says where an epoch ends.")
    if steps_per_epoch % batches_per_call:
      raise ValueError(
          f"fit(jdist.DatasetCreator(...)) with steps_per_epoch="
          f"{steps_per_epoch}: each compiled call takes {batches_per_call} "
          "batches (steps_per_execution, gradient_accumulation_steps), so "
          f"steps_per_epoch must be a multiple of {batches_per_call}.")
    self.steps_per_epoch = int(steps_per_epoch)
    self._per_call = batches_per_call
    self._creator = creator
    self._strategy = strategy
    self._class_weight = class_weight
    self._first = None
    self._check = None
    self._iterator = None

  def peek(self) -> dict:
    """One batch, from a pipeline this host builds for it (the whole data as
    one pipeline); the model and the objectives are checked on it."""
    if self._first is None:
      context = InputContext(1, 0, self._strategy.num_replicas_in_sync)
      for batch in self._creator(context):
        self._first = data_lib.host_batch(batch, 0, True, self._class_weight,
                                          None)
        break
      else:
        raise ValueError("The DatasetCreator's dataset_fn gave no batches.")
    return self._first

  def check_targets(self, check: Callable) -> None:
    """Checks the peeked batch's targets now, and every batch's as read."""
    check(self.peek()["y"], lambda row: f"row {row} of batch 0")
    self._check = check

  def distributed(self, epoch: int, start: int = 0) -> Iterator:
    """The epoch's distributed batches from `start` on, continuing one
    iterator of the strategy's `distribute_datasets_from_function` all fit
    long (under parameter servers: each item is "the next batch of the worker
    that runs the step")."""
    del epoch
    if self._iterator is None:
      dataset = self._strategy.distribute_datasets_from_function(
          _PipelineInput(self._creator, self._class_weight, self._check))
      if self._per_call > 1:
        dataset = dataset.group(self._per_call)
      self._iterator = iter(dataset)
    return itertools.islice(self._iterator,
                            (self.steps_per_epoch - start) // self._per_call)

  def state(self, consumed: int) -> dict:
    del consumed
    return {}

  def resume(self, state: dict, consumed: int) -> None:
    # The pipelines cannot be rewound: a resumed fit reads fresh ones (as
    # TensorFlow's does), from the resumed position's epoch and batch.
    del state, consumed
