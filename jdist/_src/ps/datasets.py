"""Input under ParameterServerStrategy: datasets each worker builds
(`PerWorkerDataset`), batches shipped with their step (`WorkerBatch`), and
"the next batch of the worker that runs this step" (`PerWorkerBatches`)."""

from __future__ import annotations

import inspect
import itertools
import uuid
from typing import Any, Callable, Iterable

import jax
import numpy as np

from jdist._src.ps import worker as worker_lib
from jdist._src.ps.worker import PerWorkerResource


def _takes_input_context(fn: Callable) -> bool:
  try:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                     p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    return False
  return len(params) >= 1


class PerWorkerDataset:
  """A dataset every worker builds for itself; `iter()` it to get iterators.

  Args:
    dataset_fn: called on each worker, with no argument or a
      `jdist.InputContext` (`input_pipeline_id`: the worker's index); returns
      an iterable of global batches. Or an iterable each worker iterates.
  """

  def __init__(self, dataset_fn):
    if isinstance(dataset_fn, PerWorkerBatches):
      dataset_fn = dataset_fn.dataset_fn
    if not callable(dataset_fn) and not isinstance(dataset_fn, Iterable):
      raise TypeError(
          f"create_per_worker_dataset needs a function that returns a dataset "
          f"(or an iterable), got {type(dataset_fn).__name__}.")
    self._dataset_fn = dataset_fn
    self._key = uuid.uuid4().hex[:12]
    self._count = itertools.count()

  def __iter__(self) -> "PerWorkerIterator":
    return PerWorkerIterator(self._dataset_fn, f"{self._key}/{next(self._count)}")


class PerWorkerIterator(PerWorkerResource):
  """Each worker's iterator over its dataset; pass it to scheduled functions.

  Inside a scheduled function, `next(iterator)` gives the running worker's
  next `PerReplica` batch (a tuple unpacks as TensorFlow's does). A worker
  that failed and came back builds its dataset again.
  """

  def __init__(self, dataset_fn, key: str):
    self._dataset_fn = dataset_fn
    self.key = key

  def build(self, worker_context) -> Any:
    fn = self._dataset_fn
    if not callable(fn):
      data = fn
    elif _takes_input_context(fn):
      data = fn(worker_context.input_context())
    else:
      data = fn()
    return iter(worker_context.strategy.experimental_distribute_dataset(data))

  def __next__(self):
    raise TypeError(
        "A per-worker iterator is not iterated on the coordinator: pass it to "
        "coordinator.schedule(fn, args=(iterator,)) and call next() on it "
        "inside fn, where it is the worker's own iterator.")

  def __repr__(self) -> str:
    return f"PerWorkerIterator({self.key})"


class WorkerBatch:
  """A host batch shipped with a step, for its worker to distribute."""

  def __init__(self, batch: Any, global_batch_size: int | None,
               options=None):
    self.batch = batch
    self.global_batch_size = global_batch_size
    self.options = options

  def distribute(self, strategy):
    """The batch as a `PerReplica` over `strategy`'s devices."""
    return next(iter(strategy.experimental_distribute_dataset(
        [self.batch], self.options,
        global_batch_size=self.global_batch_size)))


class WorkerBatches:
  """What `experimental_distribute_dataset` returns under parameter servers."""

  def __init__(self, dataset: Iterable, global_batch_size: int | None,
               options=None):
    self._dataset = dataset
    self._size = global_batch_size
    self._options = options

  def __iter__(self):
    size = self._size
    for batch in self._dataset:
      if size is None:
        size = _batch_size(batch)
      yield WorkerBatch(batch, size, self._options)


class PerWorkerBatch(WorkerBatch):
  """The next batch of the worker that runs the step this is passed to."""

  def __init__(self, iterator: PerWorkerIterator):
    super().__init__(None, None, None)
    self.iterator = iterator

  def distribute(self, strategy):
    """The running worker's next batch (a `PerReplica` over its devices)."""
    del strategy  # the worker's iterator distributes over its devices
    ctx = worker_lib.current()
    if ctx is None:
      raise TypeError(
          "A per-worker batch is taken on a worker: pass it to a "
          "strategy.function step (which schedules it), not to code that "
          "runs on the coordinator.")
    return next(ctx.resource(self.iterator))


class PerWorkerBatches:
  """`distribute_datasets_from_function` under parameter servers: each
  `iter()` makes every worker's pipeline anew and yields `PerWorkerBatch`
  items without end."""

  def __init__(self, dataset_fn):
    self.dataset_fn = dataset_fn
    self._dataset = PerWorkerDataset(dataset_fn)

  def __iter__(self):
    batch = PerWorkerBatch(iter(self._dataset))
    while True:
      yield batch


def _batch_size(batch) -> int:
  leaves = jax.tree.leaves(batch)
  return int(np.shape(leaves[0])[0]) if leaves else 0
