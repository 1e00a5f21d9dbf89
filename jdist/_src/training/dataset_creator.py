"""`DatasetCreator`: TensorFlow's input made by a function, once per input
pipeline (`distribute_datasets_from_function`); the host also calls it
once for a batch to check the model on.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

from jdist._src.input.context import InputContext
from jdist._src.training import batches as batches_lib
from jdist._src.training.source import Source


class DatasetCreator:
  """A function that makes a dataset, passed to `fit` (TensorFlow's name).

  Each input pipeline builds its own data (under parameter servers, each
  worker; else each process, per-replica batches). Make it endless: `fit`
  requires `steps_per_epoch` (docs/parameter_servers.md).

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
  """Each pipeline's batches in fit's `{"x", "y"}` form, checked."""

  def __init__(self, creator: DatasetCreator, class_weight, check):
    self._creator = creator
    self._class_weight = class_weight
    self._check = check

  def __call__(self, input_context: InputContext) -> Iterator[dict]:
    for i, batch in enumerate(self._creator(input_context)):
      yield batches_lib.host_batch(batch, i, True, self._class_weight,
                                self._check)


class CreatorSource(Source):
  """fit's `Source` for a `DatasetCreator` (the strategy's pipelines)."""

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
    """One batch from a pipeline built on this host, to check the model."""
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
    """The epoch's items from `start` on, one iterator all fit long."""
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
    """Fresh pipelines (they cannot be rewound), from the resumed epoch."""
    del state, consumed
