"""Distributed datasets: global or per-replica batches in, `PerReplica` out.

A batch that is shorter than the first one (the end of an epoch) is padded to
the same static shape and carries a validity mask and its global count of valid
examples, so the step compiles once and losses, metrics and `reduce(MEAN)` are
exact: nothing is dropped and nothing is counted twice.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from jdist._src import input_sync
from jdist._src import placement
from jdist._src.values import PerReplica


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


def _batch_len(batch: Any, what: str) -> int:
  """The batch size shared by every leaf of `batch` (numpy arrays)."""
  leaves = jax.tree.leaves(batch)
  sizes = {np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in leaves}
  if len(sizes) == 1 and None not in sizes:
    return sizes.pop()
  return _batch_len_error(batch, what)


def _batch_len_error(batch: Any, what: str):
  """Raises the error that explains why `batch` has no single batch size."""
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError(f"The {what} has no arrays in it.")
  sizes = {}
  for path, leaf in leaves:
    if not np.ndim(leaf):
      raise ValueError(
          f"{what.capitalize()} leaf {jax.tree_util.keystr(path)} is a scalar; "
          "every leaf of a batch needs a leading batch axis.")
    sizes.setdefault(np.shape(leaf)[0], jax.tree_util.keystr(path))
  detail = ", ".join(f"{p or '<batch>'} has {n}" for n, p in sizes.items())
  raise ValueError(
      f"The leaves of one {what} disagree on the batch size ({detail}); "
      "every leaf must have the same leading axis.")


def _split_error(size: int, n: int) -> ValueError:
  return ValueError(
      f"A global batch of {size} examples cannot split evenly over {n} "
      f"replicas. Use a global batch size that is a multiple of {n} "
      f"(for example {max(n, size - size % n)} or {size + n - size % n}); "
      "the last, shorter batch of an epoch may be any size and is padded.")


def _pad(x: np.ndarray, size: int) -> np.ndarray:
  if x.shape[0] == size:
    return x
  pad = np.zeros((size - x.shape[0],) + x.shape[1:], dtype=x.dtype)
  return np.concatenate([x, pad], axis=0)


class _Placer:
  """Places stacked local rows as global `(R, b, ...)` arrays; caches validity."""

  def __init__(self, strategy):
    self.strategy = strategy
    self.local_ids = placement.local_replica_ids(strategy.devices)
    ids = self.local_ids
    # This process's replicas: a slice (a view of the batch) when contiguous.
    contiguous = ids == tuple(range(ids[0], ids[-1] + 1))
    self.local_rows = slice(ids[0], ids[-1] + 1) if contiguous else list(ids)
    self._full = {}        # (rows, b) -> host validity of a full batch
    self._full_masks = {}  # (rows, b) -> the host mask of a full batch

  def full_mask(self, rows: int, b: int) -> np.ndarray:
    """The all-valid host mask of shape (rows, b), one object per shape."""
    mask = self._full_masks.get((rows, b))
    if mask is None:
      mask = self._full_masks[(rows, b)] = np.ones((rows, b), bool)
    return mask

  def put(self, local_rows):
    """Places a pytree of local rows, all leaves in one transfer."""
    s = self.strategy
    return placement.put_per_replica(local_rows, s.mesh, s.axis_name,
                                     s.num_replicas_in_sync)

  def validity(self, local_mask: np.ndarray, num_valid: int | None):
    """The host array `[mask | global count]`; full batches reuse one.

    Only the host copy is shared: every batch gets device buffers of its own,
    so a step that donates its batch cannot delete another batch's.
    """
    key = local_mask.shape
    if num_valid is None:
      num_valid = int(local_mask.sum())  # one process holds every row
    capacity = self.strategy.num_replicas_in_sync * local_mask.shape[1]
    full = num_valid == capacity and (
        local_mask is self._full_masks.get(key) or bool(local_mask.all()))
    if full and key in self._full:
      return self._full[key]
    host = np.empty((local_mask.shape[0], local_mask.shape[1] + 1), np.int32)
    host[:, :-1] = local_mask
    host[:, -1] = num_valid
    if full:
      self._full[key] = host
    return host


class DistributedDataset:
  """An iterable of distributed batches; each `iter()` starts a new pass.

  Made by `strategy.experimental_distribute_dataset` (global batches in) or
  `strategy.distribute_datasets_from_function` (per-replica batches in). Every
  item is a `PerReplica` whose leaves have shape `(num_replicas, b, ...)`.
  """

  def __init__(self, strategy, make_iterator: Callable[[], Iterator],
               mode: str, *, prefetch: int = 2, batch_size: int | None = None):
    self._strategy = strategy
    self._make_iterator = make_iterator
    self._mode = mode
    self._prefetch = max(1, int(prefetch))
    self._batch_size = batch_size

  @property
  def strategy(self):
    return self._strategy

  def __iter__(self) -> "DistributedIterator":
    return DistributedIterator(self)


class DistributedIterator:
  """Iterator over a `DistributedDataset`; places batches ahead of use."""

  def __init__(self, dataset: DistributedDataset):
    self._ds = dataset
    self._source = iter(dataset._make_iterator())
    self._placer = _Placer(dataset.strategy)
    self._buffer = collections.deque()
    # The static batch: global (global mode) or per replica; None: the first.
    self._size = dataset._batch_size
    self._done = False
    self.position = 0  # batches handed out so far
    # Processes must agree on how many steps there are, or one waits forever.
    self._agreement = None
    if placement.spans_processes(dataset.strategy.mesh):
      self._agreement = input_sync.StepAgreement(
          self._next_host_batch, per_process=dataset._mode != "global",
          timeout=dataset.strategy.communication_options.timeout_seconds)

  def __iter__(self):
    return self

  def __next__(self) -> PerReplica:
    while not self._done and len(self._buffer) < self._ds._prefetch:
      item = (self._next_host_batch() if self._agreement is None
              else self._agreement.next())
      if item is None:
        self._done = True
        break
      self._buffer.append(self._place(*item))
    if not self._buffer:
      raise StopIteration
    self.position += 1
    return self._buffer.popleft()

  # --- reading and padding on the host --------------------------------------

  def _next_host_batch(self):
    if self._ds._mode == "global":
      return self._next_global()
    return self._next_per_replica()

  def _next_global(self):
    strategy = self._ds.strategy
    n = strategy.num_replicas_in_sync
    try:
      batch = next(self._source)
    except StopIteration:
      return None
    leaves, treedef = jax.tree.flatten(batch)
    leaves = [np.asarray(x) for x in leaves]
    size = _batch_len(leaves, "batch") if leaves else _batch_len(batch, "batch")
    if self._size is None:
      if size % n:
        raise _split_error(size, n)
      self._size = size
    elif size > self._size:
      raise ValueError(
          f"A batch of {size} examples follows batches of {self._size}. Batches "
          "may shrink at the end of the data but not grow: keep the global "
          "batch size fixed.")
    b = self._size // n
    local = self._placer.local_rows
    # Views, no copies, unless the batch is short.
    rows = [_pad(x, self._size).reshape((n, b) + x.shape[1:])[local]
            for x in leaves]
    if size == self._size:
      valid = self._placer.full_mask(len(self._placer.local_ids), b)
    else:
      valid = (np.arange(self._size) < size).reshape(n, b)[local]
    return jax.tree.unflatten(treedef, rows), valid, size

  def _next_per_replica(self):
    ids = self._placer.local_ids
    parts = list(itertools.islice(self._source, len(ids)))
    if not parts:
      return None
    parts = [jax.tree.map(np.asarray, p) for p in parts]
    sizes = [_batch_len(p, "per-replica batch") for p in parts]
    if self._size is None:
      self._size = sizes[0]
    if max(sizes) > self._size:
      raise ValueError(
          f"A per-replica batch of {max(sizes)} examples follows batches of "
          f"{self._size}; dataset_fn must batch with a fixed per-replica size "
          "(ctx.get_per_replica_batch_size(global_batch_size)).")
    template = parts[0]
    while len(parts) < len(ids):  # the data ran out inside this step
      parts.append(jax.tree.map(lambda x: x[:0], template))
      sizes.append(0)
    stacked = jax.tree.map(lambda *xs: np.stack([_pad(x, self._size) for x in xs]),
                           *parts)
    valid = np.arange(self._size)[None, :] < np.asarray(sizes)[:, None]
    count = sum(sizes)  # across processes, the input agreement adds them up
    return stacked, valid, count

  def _place(self, rows, valid, count) -> PerReplica:
    values, validity = self._placer.put(
        (rows, self._placer.validity(valid, count)))  # one transfer
    return PerReplica(values, validity=validity)


def from_values(strategy, value_fn: Callable) -> PerReplica:
  """See `Strategy.experimental_distribute_values_from_function`."""
  from jdist._src.values import ValueContext
  n = strategy.num_replicas_in_sync
  ids = placement.local_replica_ids(strategy.devices)
  values = [value_fn(ValueContext(i, n)) for i in ids]
  stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                         *values)
  return PerReplica(_Placer(strategy).put(stacked))


def global_batches(strategy, dataset: Iterable, *, prefetch: int = 2,
                   global_batch_size: int | None = None):
  """See `Strategy.experimental_distribute_dataset`."""
  n = strategy.num_replicas_in_sync
  if global_batch_size is not None and (global_batch_size <= 0 or
                                        global_batch_size % n):
    raise _split_error(global_batch_size, n)
  return DistributedDataset(strategy, lambda: iter(dataset), "global",
                            prefetch=prefetch, batch_size=global_batch_size)


def per_replica_batches(strategy, dataset_fn: Callable, *, prefetch: int = 2):
  """See `Strategy.distribute_datasets_from_function`."""
  ctx = InputContext(jax.process_count(), jax.process_index(),
                     strategy.num_replicas_in_sync)
  # Across processes, StepAgreement turns each process's count into the
  # global one, so steps never need an all-reduce to count examples.
  return DistributedDataset(strategy, lambda: iter(dataset_fn(ctx)),
                            "per_replica", prefetch=prefetch)
