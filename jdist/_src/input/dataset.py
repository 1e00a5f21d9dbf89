"""Distributed datasets: global or per-replica batches in, `PerReplica` out,
a short last batch padded and masked."""

from __future__ import annotations

import collections
import enum
import itertools
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np

from jdist._src.core import kinds
from jdist._src.core import placement
from jdist._src.core.values import BatchGroup, PerReplica, ValueContext
from jdist._src.input import host
from jdist._src.input import agreement
from jdist._src.input.context import InputContext
from jdist._src.input.optional import Optional
from jdist._src.input.options import InputOptions
from jdist._src.input.prefetch import BackgroundPrefetch


class Mode(enum.Enum):
  """What a distributed dataset's source yields."""

  GLOBAL = "global"            # global batches; each process keeps its rows
  PER_REPLICA = "per_replica"  # one batch per local replica (dataset_fn)


class _Passes:
  """The first pass over a source, shared by a dataset and its groups."""

  def __init__(self, source: Iterable, one_shot_advice: str):
    self.source = source
    self.one_shot_advice = one_shot_advice
    self.first = None  # the first DistributedIterator over the source

  def start(self) -> Iterator:
    """A new host iterator over the source; raises for a one-shot iterator an
    earlier pass has read from (its second pass would be empty)."""
    it = iter(self.source)
    first = self.first
    if first is not None and it is first.source and first.started:
      # A generator's second pass is empty, and batches the first pass
      # read ahead would be lost: TF re-runs its dataset; this cannot.
      raise ValueError(self.one_shot_advice)
    return it


_ONE_SHOT_GLOBAL = (
    "This distributed dataset was made from a one-shot iterator (a generator "
    "or an iterator), which its first pass used up: a second pass would yield "
    "nothing. Distribute a re-iterable instead (a list, or an object whose "
    "__iter__ starts over), or call experimental_distribute_dataset again "
    "with a new generator.")
_ONE_SHOT_FUNCTION = (
    "dataset_fn returned a one-shot iterator (a generator or an iterator), "
    "which the first pass over this distributed dataset used up: jdist calls "
    "dataset_fn once per input pipeline, as TensorFlow does, so a second pass "
    "would yield nothing. Return a re-iterable from dataset_fn (a list, or an "
    "object whose __iter__ starts a new pass, such as a tf.data.Dataset or a "
    "grain DataLoader), or call distribute_datasets_from_function again for "
    "each pass.")


class DistributedDataset:
  """An iterable of distributed batches; each `iter()` starts a new pass.

  Made by `strategy.experimental_distribute_dataset` or
  `strategy.distribute_datasets_from_function`. Every item is a `PerReplica`
  with leaves `(num_replicas, b, ...)`; each pass iterates the source again.
  """

  def __init__(self, strategy, source: Iterable, mode: Mode, *,
               options: InputOptions | None = None,
               batch_size: int | None = None, identity: str = "",
               steps: int | None = None, passes: _Passes | None = None):
    self._strategy = strategy
    self._mode = mode
    self._options = options or InputOptions()
    self._batch_size = batch_size
    self._identity = identity
    self._steps = steps
    self._pending = None  # the first pass, started by element_spec
    self._passes = passes or _Passes(
        source, _ONE_SHOT_GLOBAL if mode is Mode.GLOBAL else _ONE_SHOT_FUNCTION)

  def group(self, steps: int) -> "DistributedDataset":
    """The same batches, `steps` at a time, for a `jdist.multi_step` call.

    Each item is a `BatchGroup` of `steps` batches (the last may hold fewer).

    Args:
      steps: batches per group (Keras' `steps_per_execution`), at least 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
      raise ValueError(f"group() takes a whole number of steps of at least 1, "
                       f"got {steps!r}.")
    # The same source and identity: the same data for the agreement.
    return DistributedDataset(
        self._strategy, self._passes.source, self._mode, options=self._options,
        batch_size=self._batch_size, identity=self._identity, steps=steps,
        passes=self._passes)

  @property
  def strategy(self):
    """The strategy whose replicas the batches are for."""
    return self._strategy

  @property
  def element_spec(self) -> Any:
    """What one replica's step receives of each batch (TensorFlow's name).

    `jax.ShapeDtypeStruct` values of one replica's rows.

    Example:
      >>> import jdist, numpy as np
      >>> strategy = jdist.get_strategy()  # one replica
      >>> data = strategy.experimental_distribute_dataset(
      ...     [{"x": np.ones((8, 3), np.float32), "y": np.zeros(8, np.int32)}])
      >>> data.element_spec["x"], data.element_spec["y"].dtype
      (ShapeDtypeStruct(shape=(8, 3), dtype=float32), dtype('int32'))
    """
    first = self._passes.first
    if first is None:
      first = self._pending = iter(self)
    return first.element_spec

  def __iter__(self) -> "DistributedIterator":
    if self._pending is not None:  # the pass element_spec started
      it, self._pending = self._pending, None
      return it
    it = DistributedIterator(
        self._strategy, self._passes.start(), self._mode,
        options=self._options, batch_size=self._batch_size,
        identity=self._identity, steps=self._steps)
    if self._passes.first is None:
      self._passes.first = it
    return it


class DistributedIterator:
  """Iterator over a `DistributedDataset`; places batches ahead of use.

  Args:
    strategy: the strategy to place batches for.
    source: the host iterator (global or per-replica batches, by `mode`).
    mode: a `Mode`.
    options: an `InputOptions` (how far ahead to place batches, and where).
    batch_size: the static batch (global, or per replica); None: the first.
    identity: what the dataset is, for the input agreement's keys.
    steps: if set, items are each a `BatchGroup` of this many batches.
  """

  def __init__(self, strategy, source: Iterator, mode: Mode, *,
               options: InputOptions | None = None,
               batch_size: int | None = None, identity: str = "",
               steps: int | None = None):
    options = options or InputOptions()
    self._strategy = strategy
    self._source = source
    self._mode = mode
    self._ahead = options.experimental_per_replica_buffer_size
    self._background = None
    self._drained = False  # the background thread's items are all handed out
    self._placer = host.Placer(strategy)
    self._buffer = collections.deque()
    self._pad = options.pad_to_replicas
    # What a global batch splits into (the replicas, and FSDP's devices).
    self._split = host.batch_split(strategy)
    # The static (padded) batch, and the most real rows a batch may have.
    self._size = self._full = batch_size
    if batch_size is not None and self._pad:
      self._size = host.padded_size(batch_size, self._split[0])
    self._done = False
    self._steps = steps
    self.position = 0  # items handed out so far
    self._head = _NONE  # an item read for element_spec, not yet handed out
    self._failure = None  # an error reading ahead, raised at its batch
    self._spec = None
    # Processes must agree on how many steps there are, or one waits forever.
    self._agreement = None
    if placement.spans_processes(strategy.mesh):
      runtime = strategy.runtime
      key = f"{identity}/{runtime.next_sequence('input/' + identity)}"
      self._agreement = agreement.StepAgreement(
          self._next_host_batch, runtime=runtime, key=key,
          per_process=mode is Mode.PER_REPLICA,
          timeout=strategy.communication_options.timeout_seconds)
    # The multi-process agreement talks to the other processes: it stays in
    # the loop's thread.
    self._in_thread = (options.experimental_prefetch_in_thread and
                       self._agreement is None)

  @property
  def source(self) -> Iterator:
    """The host iterator the batches come from."""
    return self._source

  @property
  def started(self) -> bool:
    """Whether it has read from its source."""
    return (self.position > 0 or bool(self._buffer) or self._done or
            self._background is not None or self._head is not _NONE)

  @property
  def element_spec(self) -> Any:
    """What one replica's step receives of each batch (TensorFlow's name).

    `jax.ShapeDtypeStruct` values of one replica's rows; it reads (and keeps)
    the first batch, so in a multi-process run every process must ask.

    Raises:
      ValueError: the data has no batches.
    """
    if self._spec is None:
      if self._head is _NONE:
        self._head = self._read()
      if self._head is None:
        raise ValueError(
            "This distributed dataset has no batches, so its element_spec is "
            "unknown.")
      self._spec = per_replica_spec(self._head)
    return self._spec

  def get_next_as_optional(self) -> Optional:
    """The next batch as a `jdist.Optional`, empty at the end of the data.

    Across processes all see an empty optional at the same step.

    Example:
      >>> import jdist, numpy as np
      >>> strategy = jdist.get_strategy()
      >>> it = iter(strategy.experimental_distribute_dataset(
      ...     [np.ones((4, 2), np.float32)] * 2))
      >>> steps = 0
      >>> while (optional := it.get_next_as_optional()).has_value():
      ...   batch = optional.get_value()
      ...   steps += 1
      >>> steps, optional.element_spec
      (2, ShapeDtypeStruct(shape=(4, 2), dtype=float32))
    """
    item = self._next_item()
    if item is None:
      return Optional.empty(self._spec)
    return Optional.from_value(item, self._spec)

  def __iter__(self):
    return self

  def __next__(self) -> PerReplica | BatchGroup:
    item = self._next_item()
    if item is None:
      raise StopIteration
    return item

  def _next_item(self) -> PerReplica | BatchGroup | None:
    """The next batch (or group), counted as handed out; None at the end."""
    if self._head is not _NONE:
      item, self._head = self._head, _NONE
    else:
      item = self._read()
    if item is not None:
      self.position += 1
      if self._spec is None:
        self._spec = per_replica_spec(item)
    return item

  def _read(self) -> PerReplica | BatchGroup | None:
    """The next placed item, or None at the end; an error reading a batch is
    raised at that batch, after those read before it."""
    if self._in_thread:
      return self._read_in_thread()
    # Lazily: the item handed out plus at most one more ahead per call, so
    # the first batch comes at once and the buffer grows to its size.
    for _ in range(2):
      if self._done or self._failure or len(self._buffer) > self._ahead:
        break
      try:
        item = self._produce()
      except Exception as e:  # raised when the loop reaches it
        self._failure = e
        break
      if item is None:
        break
      self._buffer.append(item)
    if self._buffer:
      return self._buffer.popleft()
    if self._failure is not None:
      failure, self._failure = self._failure, None
      self._done = True
      raise failure
    return None

  def _read_in_thread(self) -> PerReplica | BatchGroup | None:
    if self._drained:
      return None
    if self._background is None:
      self._background = BackgroundPrefetch(self._produce, self._ahead)
    # _done is the reading thread's: items may still wait in the queue. The
    # thread stops at an error, so after it the pass has ended.
    self._drained = True
    item = self._background.next()
    self._drained = item is None
    return item

  def _produce(self) -> PerReplica | BatchGroup | None:
    """The next batch (or group), placed; None at the end of the data."""
    if self._steps is None:
      item = self._next_agreed()
      if item is None:
        return None
      values, validity = self._placer.place(item)
      return PerReplica(values, validity=validity)
    items = []
    while len(items) < self._steps:
      item = self._next_agreed()
      if item is None:
        break
      items.append(item)
    if not items:
      return None
    return BatchGroup(*self._placer.put(self._placer.host_group(items),
                                        batch_axis=2))

  # --- reading and padding on the host --------------------------------------

  def _next_agreed(self):
    """The next host batch (agreed on across processes), or None at the end."""
    item = (self._next_host_batch() if self._agreement is None
            else self._agreement.next())
    if item is None:
      self._done = True
    return item

  def _next_host_batch(self):
    if self._mode is Mode.GLOBAL:
      return self._next_global()
    return self._next_per_replica()

  def _next_global(self):
    n = self._strategy.num_replicas_in_sync
    try:
      batch = next(self._source)
    except StopIteration:
      return None
    leaves, treedef = jax.tree.flatten(batch)
    leaves = [np.asarray(x) for x in leaves]
    size = host.batch_size_of(leaves if leaves else batch, "batch")
    if self._size is None:
      # Only a batch that is all of the data may be short, unless asked:
      # then it is a short last batch, padded like one.
      parts = self._split[0]
      if (size % parts and not self._pad and
          next(self._source, _END) is not _END):
        raise indivisible_error(size, *self._split)
      self._size, self._full = host.padded_size(size, parts), size
    elif size > self._full:
      raise ValueError(
          f"A batch of {size} examples follows batches of {self._full}. Batches "
          "may shrink at the end of the data but not grow: keep the global "
          "batch size fixed.")
    b = self._size // n
    local = self._placer.local_rows  # None: this process holds every row
    # Views, no copies, unless the batch is short.
    rows = [(x if size == self._size else host.pad(x, self._size)).reshape(
        (n, b) + x.shape[1:]) for x in leaves]
    if local is not None:
      rows = [x[local] for x in rows]
    if size == self._size:
      valid = self._placer.full_mask(len(self._placer.local_ids), b)
    else:
      valid = (np.arange(self._size) < size).reshape(n, b)
      valid = valid if local is None else valid[local]
    # Across processes, each keeps its rows of the same global batch: the
    # agreement compares the batches they read.
    fingerprint = (None if self._agreement is None
                   else agreement.fingerprint(leaves))
    return host.HostStep(jax.tree.unflatten(treedef, rows), valid, size,
                         fingerprint)

  def _next_per_replica(self):
    ids = self._placer.local_ids
    parts = list(itertools.islice(self._source, len(ids)))
    if not parts:
      return None
    parts = [jax.tree.map(np.asarray, p) for p in parts]
    sizes = [host.batch_size_of(p, "per-replica batch") for p in parts]
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
    stacked = jax.tree.map(
        lambda *xs: np.stack([host.pad(x, self._size) for x in xs]), *parts)
    valid = np.arange(self._size)[None, :] < np.asarray(sizes)[:, None]
    count = sum(sizes)  # across processes, the input agreement adds them up
    return host.HostStep(stacked, valid, count)


_END = object()
_NONE = object()  # no item read ahead (None is the end of the data)


def per_replica_spec(item: PerReplica | BatchGroup) -> Any:
  """`jax.ShapeDtypeStruct` values of one replica's batch."""
  return kinds.kind_of(item).batch_spec(item)


def _name(obj: Any) -> str:
  return getattr(obj, "__qualname__", None) or type(obj).__name__


def from_values(strategy, value_fn: Callable) -> PerReplica:
  """See `Strategy.experimental_distribute_values_from_function`."""
  n = strategy.num_replicas_in_sync
  ids = placement.local_replica_ids(strategy.mesh, strategy.axis_name)
  values = [value_fn(ValueContext(i, n)) for i in ids]
  stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                         *values)
  return PerReplica(host.Placer(strategy).put(stacked))


def indivisible_error(size: int, n: int, parts: str = "replicas"
                      ) -> ValueError:
  """The error for a global batch `n` parts cannot share, naming the fix."""
  return ValueError(
      f"{host.split_error(size, n, parts)} Or pass options=jdist.InputOptions("
      "pad_to_replicas=True) to pad every such batch with masked rows (an "
      "elastic job restarted on another number of processes keeps its "
      "global batch so).")


def global_batches(strategy, dataset: Iterable, *,
                   options: InputOptions | None = None,
                   global_batch_size: int | None = None) -> DistributedDataset:
  """See `Strategy.experimental_distribute_dataset`."""
  n, parts = host.batch_split(strategy)
  if global_batch_size is not None and global_batch_size <= 0:
    raise host.split_error(global_batch_size, n, parts)
  if (global_batch_size is not None and global_batch_size % n and
      not InputOptions.of(options).pad_to_replicas):
    raise indivisible_error(global_batch_size, n, parts)
  return DistributedDataset(
      strategy, dataset, Mode.GLOBAL, options=options,
      batch_size=global_batch_size,
      identity=f"global/{global_batch_size or 'auto'}/{_name(dataset)}")


def per_replica_batches(strategy, dataset_fn: Callable, *,
                        options: InputOptions | None = None
                        ) -> DistributedDataset:
  """See `Strategy.distribute_datasets_from_function`."""
  ctx = InputContext(jax.process_count(), jax.process_index(),
                     strategy.num_replicas_in_sync)
  # Once per input pipeline (this process), as TensorFlow does: each pass
  # iterates what it returned again, so a dataset that reshuffles on each
  # iteration gives every epoch its own order.
  dataset = dataset_fn(ctx)
  if not (hasattr(dataset, "__iter__") or hasattr(dataset, "__getitem__")):
    raise TypeError(
        f"dataset_fn must return an iterable of per-replica batches (a list, "
        f"a tf.data.Dataset, a grain DataLoader, a generator), got "
        f"{type(dataset).__name__}.")
  # Across processes, StepAgreement turns each process's count into the
  # global one, so steps never need an all-reduce to count examples.
  return DistributedDataset(strategy, dataset, Mode.PER_REPLICA,
                            options=options,
                            identity=f"per_replica/auto/{_name(dataset_fn)}")
