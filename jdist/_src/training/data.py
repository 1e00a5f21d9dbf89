"""Where `fit`, `evaluate` and `predict` get global batches, and how to resume.

Every kind of input is a `Source` (the protocol below, in the manner of
Keras' `DataAdapter`) of host batches `{"x": ..., "y": ...}`; the Trainer
reads all of them the same way. Three kinds:

* `ArraySource`: arrays (or pytrees of arrays) with a batch size. Pass `p`
  over them is shuffled by a permutation drawn from `(seed, p)`
  (`shuffle_order.py`), so any position can be recomputed exactly on resume.
* `IterableSource`: a re-iterable of batches (a list, a tf.data `Dataset`, a
  grain dataset): every pass is a new iteration; resuming starts the pass the
  saving run read for that epoch (its order, if the passes are seeded) and
  skips the batches already trained on.
* `IteratorSource`: a one-shot iterator (a generator, a grain
  `DatasetIterator`, a tf.data `Dataset` that repeats forever): epochs
  continue it. Resuming restores its `get_state()`/`set_state()` state if it
  has them, and otherwise skips the batches already trained on from the start
  of a fresh iterator.

An epoch is one pass, unless `steps_per_epoch` is shorter than a pass: then,
as in Keras, the next epoch continues the pass where the last one stopped, an
epoch that reaches the pass's end stops there (shorter), and the epoch after
it starts the next pass (`epoch_span`; a re-iterable of unknown length tells
its length when its first pass runs out). Epoch `e`'s batches are a function
of `e` (and that length) alone, so a resume finds them again.

A tf.data `Dataset` is recognised by its methods (jdist never imports
TensorFlow) and read through `as_numpy_iterator()`, one call per pass, so a
`shuffle(..., reshuffle_each_iteration=True)` gives every epoch its order.

Batches are `(x, y)` or `(x, y, sample_weight)` tuples, `{"x": x, "y": y}`
dicts (with an optional "sample_weight"), or `x` alone (predict). Keras'
`class_weight` becomes per-example weights on the host. Every array is checked
to be numeric here, before it reaches a step. How a short batch is padded is
the input layer's (`input/`): this module only asks it the size.
"""

from __future__ import annotations

import collections
import math
import warnings
from typing import Any, Callable, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.input import host
from jdist._src.training import shuffle_order


def _check_numeric(tree, what: str) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      dtype = np.asarray(leaf).dtype
    if not (jnp.issubdtype(dtype, jnp.number) or
            jnp.issubdtype(dtype, jnp.bool_)):
      raise TypeError(
          f"{what}{jax.tree_util.keystr(path)} holds {dtype} values, not "
          "numbers: a model trains on numeric arrays. Encode strings as "
          "integers first (for class names, e.g. "
          "sklearn.preprocessing.LabelEncoder).")


def class_weights(class_weight: dict, y) -> np.ndarray:
  """Keras' `class_weight`: each example's weight from its class.

  Classes missing from the dict weigh 1, as in Keras. Integer labels are
  read as they are, one-hot targets by their argmax.
  """
  y = np.asarray(y)
  labels = np.argmax(y, -1) if y.ndim > 1 and y.shape[-1] > 1 else \
      y.reshape(y.shape[0])
  out = np.ones(labels.shape[0], np.float32)
  for cls, w in class_weight.items():
    out[labels == int(cls)] = float(w)
  return out


def _check_class_weight(class_weight) -> None:
  if class_weight is None:
    return
  if not isinstance(class_weight, dict) or not all(
      isinstance(k, (int, np.integer)) and not isinstance(k, bool)
      for k in class_weight):
    raise TypeError(
        f"class_weight must be a dict {{class index: weight}}, got "
        f"{class_weight!r}.")


def to_xy(batch: Any, *, need_y: bool, class_weight=None) -> dict:
  """Brings one batch into the `{"x", "y"[, "sample_weight"]}` form."""
  if isinstance(batch, dict) and "x" in batch:
    extra = set(batch) - {"x", "y", "sample_weight"}
    if extra:
      raise ValueError(
          f"A batch dict has keys {sorted(extra)} besides 'x', 'y' and "
          "'sample_weight'. Put every model input under 'x' (it may be a dict "
          "itself) and targets under 'y'.")
    out = {"x": batch["x"], "y": batch.get("y"),
           "sample_weight": batch.get("sample_weight")}
  elif isinstance(batch, (tuple, list)):
    if not 1 <= len(batch) <= 3:
      raise ValueError(
          f"A batch tuple has {len(batch)} parts; give (x, y), "
          "(x, y, sample_weight) or (x,).")
    parts = tuple(batch) + (None,) * (3 - len(batch))
    out = {"x": parts[0], "y": parts[1], "sample_weight": parts[2]}
  elif isinstance(batch, dict):
    raise ValueError(
        f"A batch dict needs an 'x' key (and 'y' for training); got keys "
        f"{sorted(batch)}.")
  else:
    out = {"x": batch, "y": None, "sample_weight": None}
  if out["y"] is None:
    if need_y:
      raise ValueError(
          "The data has no targets: training and evaluation need batches of "
          "(x, y), {'x': x, 'y': y}, or arrays passed as x= and y=.")
    return {"x": out["x"]}
  if class_weight is not None:
    w = class_weights(class_weight, out["y"])
    if out["sample_weight"] is not None:
      w = w * np.asarray(out["sample_weight"], np.float32).reshape(w.shape[0])
    out["sample_weight"] = w
  if out["sample_weight"] is None:
    del out["sample_weight"]
  return out


def epoch_span(epoch: int, steps_per_epoch: int | None,
               pass_length: int | None) -> tuple[int, int, int | None]:
  """Which batches epoch `epoch` trains on, as Keras's epochs read them:
  `(pass, first batch of it, number of batches)`.

  Epochs of `steps_per_epoch` batches run through passes of `pass_length`
  batches: the next epoch continues the pass, an epoch that reaches the
  pass's end stops there, and the one after starts the next pass. An epoch
  is a whole pass when either length is unknown or the epoch is not shorter.

  Example:
    >>> from jdist._src.training.data import epoch_span
    >>> [epoch_span(e, 3, 7) for e in range(4)]
    [(0, 0, 3), (0, 3, 3), (0, 6, 1), (1, 0, 3)]
  """
  if (steps_per_epoch is None or pass_length is None or
      steps_per_epoch >= pass_length):
    return epoch, 0, steps_per_epoch
  per_pass = -(-pass_length // steps_per_epoch)
  pass_index, j = divmod(epoch, per_pass)
  first = j * steps_per_epoch
  return pass_index, first, min(steps_per_epoch, pass_length - first)


def epoch_lengths(steps_per_epoch: int | None, pass_length: int | None,
                  epochs: range) -> set:
  """The lengths of epochs `epochs` (`epoch_span`), the short one included
  if one of them reaches the end of a pass: what a check on an epoch's
  length must see."""
  if (steps_per_epoch is None or pass_length is None or
      steps_per_epoch >= pass_length):
    return {steps_per_epoch} if len(epochs) else set()
  per_pass = -(-pass_length // steps_per_epoch)
  return {epoch_span(e, steps_per_epoch, pass_length)[2]
          for e in epochs[:per_pass]}


def _warn_short(steps_per_epoch: int, pass_length: int, count: int) -> None:
  warnings.warn(
      f"steps_per_epoch={steps_per_epoch} does not divide the data's "
      f"{pass_length} batches: as in Keras, each epoch continues where the "
      f"last stopped, and the epoch that reaches the end of the data stops "
      f"there, after {count} batch(es); the next starts a new pass. Pass a "
      f"steps_per_epoch that divides {pass_length} for epochs of one length.",
      UserWarning, stacklevel=3)


def warn_mid_pass_start(source, initial_epoch: int) -> None:
  """Says so when `fit(initial_epoch=...)` starts inside a pass: epoch `e`'s
  batches are those of an uninterrupted fit's epoch `e`, where Keras starts
  every `fit` call at the data's first batch."""
  _, first, _ = epoch_span(initial_epoch, source.steps_per_epoch,
                           source.pass_length)
  if initial_epoch and first:
    warnings.warn(
        f"fit(initial_epoch={initial_epoch}) starts at batch {first} of the "
        f"data: with steps_per_epoch={source.steps_per_epoch} over "
        f"{source.pass_length} batches, epoch {initial_epoch + 1} trains on "
        "what it would in one fit from epoch 1 (jdist's epochs are a "
        "function of their number, so a second fit continues the first). "
        "Keras starts every fit call at the data's first batch.",
        UserWarning, stacklevel=3)


class Source(Protocol):
  """What `fit`, `evaluate` and `predict` read data through.

  Attributes:
    steps_per_epoch: batches per epoch, or None (until the data ends).
    pass_length: batches in a pass over the data, or None (not known, or
      the data cannot start again). Epochs shorter than a pass continue it
      (`epoch_span`).
    one_shot: the batches come from an iterator that cannot start again:
      an epoch continues where the last one ended, and how many batches
      follow the first is known only by reading them.
  """

  steps_per_epoch: int | None
  pass_length: int | None
  one_shot: bool

  def peek(self) -> dict:
    """The first batch, checked, without using it up."""

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    """Epoch `epoch`'s batches from batch `start` on."""

  def check_targets(self, check: Callable) -> None:
    """Has every target checked by `check(y, where)`: arrays at once, batches
    as they are read (the first one at once)."""

  def state(self, consumed: int) -> dict:
    """What a checkpoint stores to continue after `consumed` batches."""

  def resume(self, state: dict, consumed: int) -> None:
    """Continues after `consumed` batches, from `state(consumed)`."""


class ArraySource:
  """Batches of in-memory arrays; pass `p` over them shuffled from
  `(seed, p)`."""

  one_shot = False

  def __init__(self, x, y, *, batch_size: int | None, shuffle: bool,
               seed: int, need_y: bool, sample_weight=None,
               class_weight=None):
    if y is None and need_y:
      raise ValueError("Arrays passed as x= need targets y= for training and "
                       "evaluation.")
    data = {"x": jax.tree.map(np.asarray, x)}
    _check_numeric(data["x"], "x")
    n = host.batch_size_of(data["x"], "x")
    if y is not None:
      data["y"] = jax.tree.map(np.asarray, y)
      _check_numeric(data["y"], "y")
      ny = host.batch_size_of(data["y"], "y")
      if ny != n:
        raise ValueError(
            f"x has {n} examples but y has {ny}; give one target per example.")
    if n == 0:
      raise ValueError("x has no examples.")
    weights = _sample_weights(sample_weight, class_weight, data.get("y"), n)
    if weights is not None:
      data["sample_weight"] = weights
    self.batch_size = _check_batch_size(batch_size)
    self.num_examples = n
    self.steps_per_epoch = math.ceil(n / self.batch_size)
    self.pass_length = self.steps_per_epoch
    self._data = data
    self._shuffle = shuffle
    self._seed = seed
    # Pass p's order: permutation(seed, p, n), the next pass's drawn ahead.
    self._orders = shuffle_order.PassOrders(seed, n) if shuffle else None

  def split(self, fraction: float, batch_size: int | None = None
            ) -> tuple["ArraySource", "ArraySource"]:
    """Keras' validation_split: the last `fraction` of examples, unshuffled
    (in batches of `batch_size`, default the training batch size)."""
    if not 0.0 < fraction < 1.0:
      raise ValueError(f"validation_split must be in (0, 1), got {fraction}.")
    cut = self.num_examples - int(self.num_examples * fraction)
    if cut in (0, self.num_examples):
      raise ValueError(f"validation_split={fraction} leaves no examples on one "
                       f"side of {self.num_examples}.")
    head = jax.tree.map(lambda a: a[:cut], self._data)
    tail = jax.tree.map(lambda a: a[cut:], self._data)
    make = lambda d, shuffle, size: ArraySource(
        d["x"], d["y"], batch_size=size, shuffle=shuffle,
        seed=self._seed, need_y=True, sample_weight=d.get("sample_weight"))
    train = make(head, self._shuffle, self.batch_size)
    train.steps_per_epoch = min(train.steps_per_epoch, self.steps_per_epoch)
    return train, make(tail, False, batch_size or self.batch_size)

  def _order(self, pass_index: int):
    return None if self._orders is None else self._orders(pass_index)

  def peek(self) -> dict:
    return jax.tree.map(lambda a: a[:self.batch_size], self._data)

  def check_targets(self, check) -> None:
    """Runs `check(y, where)` once over every target, before training."""
    if "y" in self._data:
      check(self._data["y"], lambda i: f"example {i} of y")

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    pass_index, first, count = epoch_span(epoch, self.steps_per_epoch,
                                          self.pass_length)
    if count < self.steps_per_epoch and start == 0:
      _warn_short(self.steps_per_epoch, self.pass_length, count)
    order, bs = self._order(pass_index), self.batch_size
    # fit pays this per step: the leaves are flattened once per epoch.
    leaves, treedef = jax.tree.flatten(self._data)
    if order is not None:
      # A shuffled batch's rows, taken from the whole arrays where the loop
      # needs them: a worker thread taking chunks of batches ahead made the
      # seed MLP's fit slower on 2 cores (its takes compete with the step
      # for the cores and the caches; benchmarks/RESULTS.md, "Trainer.fit vs a
      # hand-written loop").
      for i in range(first + start, first + count):
        idx = order[i * bs:(i + 1) * bs]
        yield treedef.unflatten([a.take(idx, axis=0) for a in leaves])
      return
    for i in range(first + start, first + count):
      yield treedef.unflatten([a[i * bs:(i + 1) * bs] for a in leaves])

  def state(self, consumed: int) -> dict:
    del consumed
    return {}

  def resume(self, state: dict, consumed: int) -> None:
    del state, consumed  # positions are recomputed from (epoch, batch)


class _Batches:
  """What the two sources of batches share: targets checked per batch."""

  _target_check = None  # check(y, where) for each batch, once set

  def check_targets(self, check: Callable) -> None:
    """Checks the first batch's targets now, and each batch's as read."""
    check(self.peek()["y"], lambda row: f"row {row} of batch 0")
    self._target_check = check


class IterableSource(_Batches):
  """A re-iterable of batches: each epoch is a new pass over it."""

  one_shot = False

  def __init__(self, iterable, *, steps_per_epoch: int | None, need_y: bool,
               class_weight=None, pass_length: int | None = None):
    self._iterable = iterable
    self._need_y = need_y
    self._class_weight = class_weight
    self._first = None  # the first batch, once peeked
    self._peek_unread = False  # whether no epoch has read `_first` yet
    # The pass being read: (its number, its iterator, batches read from it).
    # peek starts it and the first epoch continues it, so a dataset that
    # reshuffles on each pass is not asked for a pass nobody trains on; an
    # epoch shorter than a pass leaves it to the next epoch.
    self._open = None
    self._passes = 0  # passes started, peek's included
    # Epoch e reads pass `_epoch_0_pass + epoch_span(e, ...)[0]`; a
    # checkpoint stores it, so a resumed run reads the pass the saving run
    # read (the same order, for a dataset that reshuffles on each pass from
    # a seed).
    self._epoch_0_pass = None
    self._resume_epoch_0_pass = None
    if pass_length is None and hasattr(iterable, "__len__"):
      pass_length = len(iterable)
    self.pass_length = pass_length
    if steps_per_epoch is None:
      steps_per_epoch = pass_length
    self.steps_per_epoch = steps_per_epoch

  def _xy(self, batch, index: int) -> dict:
    return host_batch(batch, index, self._need_y, self._class_weight,
                       self._target_check)

  def peek(self) -> dict:
    if self._first is None:
      it = self._new_pass()
      for batch in it:
        self._first = self._xy(batch, 0)
        self._open = [self._passes - 1, it, 1]
        self._peek_unread = True
        break
      else:
        raise ValueError("The data is empty: it gave no batches.")
    return self._first

  def _new_pass(self) -> Iterator:
    self._passes += 1
    return iter(self._iterable)

  def _pass_for(self, relative: int, at: int) -> tuple[list, bool]:
    """The open pass for the epoch that reads pass `relative` (counted from
    epoch 0's) from its batch `at` on: the one being read if it is that
    pass and not past `at` (or peek's, whose first batch is kept), else a
    new one; and whether its first batch is peek's, not yet trained on."""
    want = self._resume_epoch_0_pass
    self._resume_epoch_0_pass = None
    if want is None:
      want = self._epoch_0_pass
    want = None if want is None else want + relative
    open_, self._open = self._open, None
    peeked, self._peek_unread = self._peek_unread, False
    if (open_ is None or (want is not None and open_[0] != want) or
        (open_[2] > at and not (peeked and at == 0))):
      peeked = False
      while want is not None and self._passes < want:
        self._new_pass()  # passes the saving run read before this epoch's
      open_ = [self._passes, self._new_pass(), 0]
    self._epoch_0_pass = open_[0] - relative
    return open_, peeked

  def _span(self, epoch: int) -> tuple[int, int, int | None]:
    """`epoch_span`; while a pass's length is unknown, epochs of
    `steps_per_epoch` batches continue the first pass."""
    if self.pass_length is None and self.steps_per_epoch is not None:
      return 0, epoch * self.steps_per_epoch, self.steps_per_epoch
    return epoch_span(epoch, self.steps_per_epoch, self.pass_length)

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    relative, first, count = self._span(epoch)
    if (count is not None and count < self.steps_per_epoch and start == 0 and
        self.pass_length is not None):
      _warn_short(self.steps_per_epoch, self.pass_length, count)
    at, end = first + start, None if count is None else first + count
    open_, peeked = self._pass_for(relative, at)
    self._open = open_
    if peeked and at == 0:
      yield self._first  # peek's, read from this pass already
      at = 1
    it = open_[1]
    while open_[2] < at or end is None or open_[2] < end:
      batch = next(it, _END)
      if batch is _END:
        break
      open_[2] += 1
      if open_[2] > at:
        yield self._xy(batch, open_[2] - 1)
    else:
      return
    if self.pass_length is None and self.steps_per_epoch is not None:
      # The pass ran out: now its length is known (as Keras learns it), and
      # the epochs from here on follow `epoch_span`.
      self.pass_length = open_[2]
      if open_[2] <= first and start == 0:  # before this epoch's first batch
        yield from self.batches(epoch)
      elif start == 0:
        _warn_short(self.steps_per_epoch, self.pass_length, open_[2] - first)

  def state(self, consumed: int) -> dict:
    del consumed
    out = {}
    if self._epoch_0_pass is not None:
      out["epoch_0_pass"] = self._epoch_0_pass
    if self.pass_length is not None:  # (a resume needs it when learned)
      out["pass_length"] = self.pass_length
    return out

  def resume(self, state: dict, consumed: int) -> None:
    del consumed  # batches() skips them
    self._resume_epoch_0_pass = state.get("epoch_0_pass")
    if state.get("pass_length") is not None and self.pass_length is None:
      self.pass_length = state["pass_length"]


class IteratorSource(_Batches):
  """A one-shot iterator, continued from epoch to epoch."""

  one_shot = True
  pass_length = None  # (it cannot start again)

  def __init__(self, iterator, *, steps_per_epoch: int | None, need_y: bool,
               class_weight=None):
    self._it = iterator
    self._need_y = need_y
    self._class_weight = class_weight
    self.steps_per_epoch = steps_per_epoch
    self._stateful = (callable(getattr(iterator, "get_state", None)) and
                      callable(getattr(iterator, "set_state", None)))
    self._buffer = collections.deque()  # peeked (state_before, batch) pairs
    self._pulled = 0
    self._states = collections.deque(maxlen=64)  # (index, state before it)

  def _pull(self):
    if self._buffer:
      return self._buffer.popleft()
    before = self._it.get_state() if self._stateful else None
    batch = next(self._it)
    return before, batch

  def peek(self) -> dict:
    if not self._buffer:
      try:
        before = self._it.get_state() if self._stateful else None
        self._buffer.append((before, next(self._it)))
      except StopIteration:
        raise ValueError("The data iterator is exhausted: it gave no batches.")
    return host_batch(self._buffer[0][1], self._pulled, self._need_y,
                       self._class_weight, self._target_check)

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    del epoch
    n = 0
    limit = None if self.steps_per_epoch is None else self.steps_per_epoch - start
    while limit is None or n < limit:
      try:
        before, batch = self._pull()
      except StopIteration:
        return
      self._states.append((self._pulled, before))
      self._pulled += 1
      n += 1
      yield host_batch(batch, self._pulled - 1, self._need_y,
                        self._class_weight, self._target_check)

  def state(self, consumed: int) -> dict:
    """What to store so that a fresh run can continue at batch `consumed`."""
    for index, before in self._states:
      if index == consumed and before is not None:
        return {"iterator_state": before}
    return {}

  def resume(self, state: dict, consumed: int) -> None:
    if state.get("iterator_state") is not None and self._stateful:
      self._buffer.clear()
      self._it.set_state(state["iterator_state"])
    else:
      for _ in range(consumed):
        try:
          self._pull()
        except StopIteration:
          raise ValueError(
              f"Cannot resume: the data iterator ended before the {consumed} "
              "batches the checkpoint had trained on. Pass the same data as "
              "the run that saved it.") from None
    self._pulled = consumed


def host_batch(batch, index: int, need_y: bool, class_weight, check) -> dict:
  """One batch of an iterable in the `{"x", "y"[, "sample_weight"]}` form,
  checked: numeric, and its targets by `check(y, where)` if given."""
  out = to_xy(batch, need_y=need_y, class_weight=class_weight)
  _check_numeric(out, f"batch {index}: ")
  if check is not None and "y" in out:
    check(out["y"], lambda row: f"row {row} of batch {index}")
  return out


def _check_batch_size(batch_size) -> int:
  if batch_size is None:
    return 32
  if isinstance(batch_size, bool) or not isinstance(batch_size,
                                                    (int, np.integer)):
    raise TypeError(f"batch_size must be a whole number, got {batch_size!r}.")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}.")
  return int(batch_size)


def _sample_weights(sample_weight, class_weight, y, n: int):
  """Per-example weights from `sample_weight` and `class_weight`, or None."""
  _check_class_weight(class_weight)
  weights = None
  if sample_weight is not None:
    weights = np.asarray(sample_weight, np.float32)
    if weights.ndim == 2 and weights.shape[1] == 1:
      weights = weights[:, 0]
    if weights.shape != (n,):
      raise ValueError(
          f"sample_weight has shape {weights.shape}; give one weight per "
          f"example, shape ({n},).")
  if class_weight is not None:
    if y is None:
      raise ValueError("class_weight needs targets y.")
    cw = class_weights(class_weight, y)
    weights = cw if weights is None else weights * cw
  return weights


_INFINITE = -1  # tf.data.INFINITE_CARDINALITY (UNKNOWN is -2)
_END = object()  # what `next(it, _END)` gives at the end of a pass


def _is_tf_dataset(x) -> bool:
  """Whether `x` is a tf.data `Dataset`, told by its methods (jdist never
  imports TensorFlow)."""
  return (callable(getattr(x, "as_numpy_iterator", None)) and
          callable(getattr(x, "cardinality", None)) and
          hasattr(x, "element_spec"))


class _NumpyPasses:
  """A tf.data `Dataset` read as numpy: each pass a new `as_numpy_iterator()`
  (tf.data's tensors are not arrays jax or numpy can take as they are)."""

  def __init__(self, dataset):
    self._dataset = dataset

  def __iter__(self):
    return self._dataset.as_numpy_iterator()


def _tf_dataset_source(dataset, *, steps_per_epoch: int | None, need_y: bool,
                       class_weight) -> IterableSource | IteratorSource:
  """A tf.data `Dataset` as Keras reads it: a finite one anew each epoch
  (its cardinality, when known, is the epoch's length); one that repeats
  forever continued from epoch to epoch, `steps_per_epoch` batches each."""
  cardinality = int(dataset.cardinality())
  if cardinality == _INFINITE:
    if steps_per_epoch is None:
      raise ValueError(
          "The tf.data.Dataset repeats forever (dataset.repeat()), so an "
          "epoch would never end: pass steps_per_epoch= to fit "
          "(validation_steps= for validation_data, steps= to evaluate and "
          "predict), as Keras requires.")
    return IteratorSource(dataset.as_numpy_iterator(),
                          steps_per_epoch=steps_per_epoch, need_y=need_y,
                          class_weight=class_weight)
  return IterableSource(_NumpyPasses(dataset), steps_per_epoch=steps_per_epoch,
                        need_y=need_y, class_weight=class_weight,
                        pass_length=cardinality if cardinality >= 0 else None)


def make_source(x, y=None, *, batch_size=None, steps_per_epoch=None,
                shuffle=False, seed=0, need_y=True, sample_weight=None,
                class_weight=None):
  """Picks the source for what was passed as `x` (and `y`)."""
  if x is None:
    raise ValueError("No data: pass arrays (x=, y=) or an iterable of batches.")
  if steps_per_epoch is not None and (
      isinstance(steps_per_epoch, bool) or int(steps_per_epoch) <= 0):
    raise ValueError(f"steps_per_epoch (or steps) must be a positive number "
                     f"of batches, got {steps_per_epoch!r}.")
  if y is not None or isinstance(x, (np.ndarray, jax.Array, dict)):
    source = ArraySource(x, y, batch_size=batch_size, shuffle=shuffle,
                         seed=seed, need_y=need_y, sample_weight=sample_weight,
                         class_weight=class_weight)
    if steps_per_epoch is not None:
      source.steps_per_epoch = min(source.steps_per_epoch, int(steps_per_epoch))
    return source
  if batch_size is not None and _is_tf_dataset(x):
    raise ValueError(
        f"batch_size={batch_size} was given with a tf.data.Dataset, which "
        "makes its own batches: leave batch_size=None (as Keras requires) and "
        "batch the dataset with the global batch size, dataset.batch(N), N a "
        "multiple of the number of replicas.")
  if batch_size is not None:
    raise ValueError(
        "batch_size= applies to arrays; the data is already in batches. Batch "
        "it with the global batch size (a multiple of the number of replicas).")
  if sample_weight is not None:
    raise ValueError(
        "sample_weight= applies to arrays; batches carry their own weights: "
        "(x, y, sample_weight) or {'x', 'y', 'sample_weight'}.")
  _check_class_weight(class_weight)
  if _is_tf_dataset(x):
    return _tf_dataset_source(x, steps_per_epoch=steps_per_epoch,
                              need_y=need_y, class_weight=class_weight)
  try:
    it = iter(x)
  except TypeError:
    raise TypeError(
        f"Cannot read data from {type(x).__name__} {x!r}: pass arrays "
        "(x=, y=), or an iterable of (x, y) batches (a list, a tf.data or "
        "grain dataset, a generator).") from None
  if it is x:
    return IteratorSource(x, steps_per_epoch=steps_per_epoch, need_y=need_y,
                          class_weight=class_weight)
  return IterableSource(x, steps_per_epoch=steps_per_epoch, need_y=need_y,
                        class_weight=class_weight)


def static_batch_size(source: Source, sample: dict, strategy, what: str, *,
                      micro_batches: int = 1, pad: bool = False) -> int | None:
  """The global batch size steps compile for: the first batch's.

  Data that fits in one batch (fewer examples than `batch_size`, fewer
  than the replicas) is one short batch, padded as the input layer pads a
  short last batch (`input/host.py: padded_size`). None for a one-shot
  iterator whose first batch does not split: the distributed dataset
  decides when it sees whether another batch follows.

  Args:
    strategy: the strategy whose replicas (and, under FSDP, the devices
      of each replica: `host.batch_split`) share every batch.
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
  rows = host.batch_size_of(sample["x"], f"{what}'s first batch")
  num_replicas = strategy.num_replicas_in_sync
  split, split_what = host.batch_split(strategy)
  parts = num_replicas * math.lcm(micro_batches, split // num_replicas)
  if rows % parts == 0:
    return rows
  if pad or source.steps_per_epoch == 1:
    return host.padded_size(rows, parts)
  or_pad = (" Or pass pad_to_replicas=True to jdist.Trainer to pad every such "
            "batch with masked rows, which losses and metrics leave out.")
  if rows % split:
    if source.one_shot and source.steps_per_epoch is None:
      return None
    raise ValueError(f"In the {what}: "
                     f"{host.split_error(rows, split, split_what)}{or_pad}")
  fsdp = ("" if split == num_replicas else f" and of the {split // num_replicas}"
          " devices that split it (FSDP)")
  raise ValueError(
      f"micro_batches={micro_batches} splits each replica's "
      f"batch into {micro_batches} micro-batches, but the global batch of "
      f"{rows} gives {rows // num_replicas} rows to each of {num_replicas} "
      f"replicas, not a multiple of {micro_batches}{fsdp}. Use a batch size "
      f"that is a multiple of {parts}.{or_pad}")


def validation_source(source, validation_data, *, validation_split: float,
                      steps: int | None, batch_size: int | None):
  """`(training source, validation source or None)` from fit's arguments."""
  val = None
  if validation_split:
    if not isinstance(source, ArraySource):
      raise ValueError("validation_split needs arrays; pass validation_data "
                       "for other kinds of data.")
    source, val = source.split(validation_split, batch_size)
  if validation_data is not None:
    vsw = None
    if isinstance(validation_data, tuple):
      if not 1 <= len(validation_data) <= 3:
        raise ValueError(
            f"validation_data has {len(validation_data)} parts; give (x, y), "
            "(x, y, sample_weight) or a dataset of batches.")
      vx, vy, vsw = (validation_data + (None, None))[:3]
    else:
      vx, vy = validation_data, None
    if vy is not None:
      batch_size = batch_size or getattr(source, "batch_size", None)
    else:
      batch_size = None
    val = make_source(vx, vy, batch_size=batch_size, steps_per_epoch=steps,
                      sample_weight=vsw)
  return source, val
