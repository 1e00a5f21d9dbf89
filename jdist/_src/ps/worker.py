"""What a worker knows while it runs scheduled functions: its current
`WorkerContext`."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import jax

from jdist._src.errors import OutOfRangeError
from jdist._src.input.context import InputContext

_local = threading.local()


class PerWorkerResource:
  """A value each worker builds for itself (`build(worker_context)`, keyed by
  `key`), on first use and again after the worker came back."""

  key: str = ""

  def build(self, worker_context) -> Any:
    raise NotImplementedError


class ResourceRef(PerWorkerResource):
  """Stands for a `PerWorkerResource` sent to a worker once (Ray backend)."""

  def __init__(self, key: str):
    self.key = key

  def build(self, worker_context) -> Any:
    return worker_context.definitions[self.key].build(worker_context)


class WorkerContext:
  """One worker: its index, the `MirroredStrategy` over its devices, its
  compiled steps and what it has built.

  With `reuse_answers`, a step starts from the values the servers answered
  the last update with, saving a read's round trip where it costs one (Ray).
  """

  def __init__(self, index: int, num_workers: int, strategy,
               parameter_strategy=None, *, reuse_answers: bool = False):
    self.index = index
    self.num_workers = num_workers
    self.strategy = strategy
    self.parameter_strategy = parameter_strategy
    self.programs: dict = {}
    self.definitions: dict = {}  # key -> PerWorkerResource (see ResourceRef)
    self.reuse_answers = reuse_answers
    self.snapshots: dict = {}  # set id -> the values its last update returned
    self._resources: dict = {}
    self.incarnation = 0

  def input_context(self) -> InputContext:
    """What a dataset function learns about this worker's input pipeline."""
    return InputContext(self.num_workers, self.index,
                        self.strategy.num_replicas_in_sync)

  def resource(self, item: PerWorkerResource) -> Any:
    """This worker's instance of `item`, built on first use."""
    if item.key not in self._resources:
      self._resources[item.key] = item.build(self)
    return self._resources[item.key]

  def restart(self) -> None:
    """Forgets what it built: a worker that failed comes back empty."""
    self._resources.clear()
    self.snapshots.clear()
    self.incarnation += 1


def current() -> WorkerContext | None:
  """The worker running the calling code, or None on the coordinator."""
  return getattr(_local, "ctx", None)


@contextlib.contextmanager
def active(ctx: WorkerContext):
  """Makes `ctx` the current worker of this thread for the block."""
  previous = getattr(_local, "ctx", None)
  _local.ctx = ctx
  try:
    yield ctx
  finally:
    _local.ctx = previous


def substitute(ctx: WorkerContext, tree: Any) -> Any:
  """`tree` with every `PerWorkerResource` replaced by this worker's instance."""
  is_resource = lambda x: isinstance(x, PerWorkerResource)
  return jax.tree.map(lambda x: ctx.resource(x) if is_resource(x) else x,
                      tree, is_leaf=is_resource)


def run(ctx: WorkerContext, fn: Callable, args: tuple, kwargs: dict) -> Any:
  """Runs a scheduled function on the worker `ctx`.

  Raises:
    jdist.OutOfRangeError: a per-worker iterator ran out.
  """
  with active(ctx):
    args, kwargs = substitute(ctx, (tuple(args), dict(kwargs or {})))
    try:
      return fn(*args, **kwargs)
    except StopIteration as e:
      raise OutOfRangeError(
          f"Worker {ctx.index} ran out of input: a per-worker iterator raised "
          "StopIteration. Repeat the per-worker dataset (an endless iterator) "
          "and schedule a finite number of steps, as with TensorFlow's "
          "ParameterServerStrategy.") from e
