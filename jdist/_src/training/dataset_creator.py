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
from jdist._src.training import batches as batches_lib
from jdist._src.training.source import Source


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
      yield batches_lib.host_batch(batch, i, True, self._class_weight,
                                self._check)


class CreatorSource(Source):
  """fit's `Source` for a `DatasetCreator`: its batches come from the
  strategy's `distribute_datasets_from_function`, one pipeline per input
  pipeline (per worker under parameter servers), not from this host.

  Args:
    creator: the `DatasetCreator`.
    num_replicas: the replicas of the strategy training runs under (the
      host's own pipeline, built to check the model on one batch, is told
      it).
    steps_per_epoch: batches (steps) per epoch; required.
    class_weight: Keras' `class_weight`, applied where the batches are read.

  Raises:
    ValueError: no `steps_per_epoch`.
  """

  one_shot = True
  whole_calls = True  # (a pipeline's iterator is read in whole calls)

  def __init__(self, creator: DatasetCreator, *, num_replicas: int,
               steps_per_epoch: int | None, class_weight=None):
    if steps_per_epoch is None:
      raise ValueError(
          "fit(jdist.DatasetCreator(...)) needs steps_per_epoch, as in "
          "TensorFlow: the dataset should be endless (repeated), so only "
          "steps_per_epoch says where an epoch ends.")
    self.steps_per_epoch = int(steps_per_epoch)
    self._creator = creator
    self._num_replicas = num_replicas
    self._class_weight = class_weight
    self._first = None
    self._check = None
    self._iterator = None  # (per_call, the pipelines' iterator), once read

  def peek(self) -> dict:
    """One batch, from a pipeline this host builds for it (the whole data as
    one pipeline); the model and the objectives are checked on it."""
    if self._first is None:
      context = InputContext(1, 0, self._num_replicas)
      for batch in self._creator(context):
        self._first = batches_lib.host_batch(batch, 0, True,
                                             self._class_weight, None)
        break
      else:
        raise ValueError("The DatasetCreator's dataset_fn gave no batches.")
    return self._first

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    """Refused: the batches are the pipelines', read through `distributed`."""
    raise TypeError(
        "A DatasetCreator's batches are built by each input pipeline, not on "
        "this host: fit reads them through the strategy. evaluate and "
        "predict take arrays or a dataset.")

  def check_targets(self, check: Callable) -> None:
    """Checks the peeked batch's targets now, and every batch's as read."""
    check(self.peek()["y"], lambda row: f"row {row} of batch 0")
    self._check = check

  def distributed(self, strategy, epoch: int, start: int = 0, *,
                  options=None, batch_size: int | None = None,
                  per_call: int = 1, inputs_only: bool = False) -> Iterator:
    """The epoch's items from `start` on, continuing one iterator of the
    strategy's `distribute_datasets_from_function` all fit long (under
    parameter servers: each item is "the next batch of the worker that runs
    the step"), in groups of `per_call` when a call takes several. The
    pipelines batch for themselves: `options` and `batch_size` do not
    apply."""
    del epoch, options, batch_size
    if inputs_only:
      raise TypeError("A DatasetCreator feeds fit only.")
    if self._iterator is None or self._iterator[0] != per_call:
      dataset = strategy.distribute_datasets_from_function(
          _PipelineInput(self._creator, self._class_weight, self._check))
      if per_call > 1:
        dataset = dataset.group(per_call)
      self._iterator = (per_call, iter(dataset))
    return itertools.islice(self._iterator[1],
                            (self.steps_per_epoch - start) // per_call)

  def static_batch_size(self, strategy, what: str, *, micro_batches: int = 1,
                        pad: bool = False) -> int | None:
    """None: each pipeline batches for itself (per-replica batches)."""
    del strategy, what, micro_batches, pad
    return None

  def resume(self, state: dict, consumed: int) -> None:
    """The pipelines cannot be rewound: a resumed fit reads fresh ones (as
    TensorFlow's does), from the resumed position's epoch and batch."""
    del state, consumed
