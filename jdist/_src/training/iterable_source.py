"""Sources of batches read on this host: `IterableSource` (a re-iterable,
a new pass per epoch) and `IteratorSource` (a one-shot iterator epochs
continue); how each resumes and reads tf.data is in docs/fit.md.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterator

from jdist._src.training import batches as batches_lib
from jdist._src.training import epochs
from jdist._src.training.source import Source


class _BatchReader(Source):
  """What the two sources of batches share: targets checked per batch."""

  _target_check = None  # check(y, where) for each batch, once set

  def check_targets(self, check: Callable) -> None:
    """Checks the first batch's targets now, and each batch's as read."""
    check(self.peek()["y"], lambda row: f"row {row} of batch 0")
    self._target_check = check


class IterableSource(_BatchReader):
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
    return batches_lib.host_batch(batch, index, self._need_y, self._class_weight,
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
    """The open pass `relative` from its batch `at` on (the one being read
    if it can serve, else a new one), and whether its first batch is
    peek's, not yet trained on."""
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
    return epochs.epoch_span(epoch, self.steps_per_epoch, self.pass_length)

  def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
    relative, first, count = self._span(epoch)
    if (count is not None and count < self.steps_per_epoch and start == 0 and
        self.pass_length is not None):
      epochs.warn_short(self.steps_per_epoch, self.pass_length, count)
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
        epochs.warn_short(self.steps_per_epoch, self.pass_length, open_[2] - first)

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


class IteratorSource(_BatchReader):
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
    return batches_lib.host_batch(self._buffer[0][1], self._pulled, self._need_y,
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
      yield batches_lib.host_batch(batch, self._pulled - 1, self._need_y,
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


_INFINITE = -1  # tf.data.INFINITE_CARDINALITY (UNKNOWN is -2)
_END = object()  # what `next(it, _END)` gives at the end of a pass


def is_tf_dataset(x) -> bool:
  """Whether `x` is a tf.data `Dataset`, told by its methods."""
  return (callable(getattr(x, "as_numpy_iterator", None)) and
          callable(getattr(x, "cardinality", None)) and
          hasattr(x, "element_spec"))


class _NumpyPasses:
  """A tf.data `Dataset` as numpy: each pass a new `as_numpy_iterator()`."""

  def __init__(self, dataset):
    self._dataset = dataset

  def __iter__(self):
    return self._dataset.as_numpy_iterator()


def tf_dataset_source(dataset, *, steps_per_epoch: int | None, need_y: bool,
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
