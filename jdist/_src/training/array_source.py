"""`ArraySource`: in-memory arrays (or pytrees of arrays) with a batch size.

Pass `p` is shuffled from `(seed, p)` (`shuffle_order.py`), so a resume
recomputes any position.
"""

from __future__ import annotations

import math
from typing import Iterator

import jax
import numpy as np

from jdist._src.input import host
from jdist._src.training import batches as batches_lib
from jdist._src.training import epochs
from jdist._src.training import shuffle_order
from jdist._src.training.source import Source


class ArraySource(Source):
  """Batches of in-memory arrays; pass `p` over them shuffled from
  `(seed, p)`."""

  def __init__(self, x, y, *, batch_size: int | None, shuffle: bool,
               seed: int, need_y: bool, sample_weight=None,
               class_weight=None):
    if y is None and need_y:
      raise ValueError("Arrays passed as x= need targets y= for training and "
                       "evaluation.")
    data = {"x": jax.tree.map(np.asarray, x)}
    batches_lib.check_numeric(data["x"], "x")
    n = host.batch_size_of(data["x"], "x")
    if y is not None:
      data["y"] = jax.tree.map(np.asarray, y)
      batches_lib.check_numeric(data["y"], "y")
      ny = host.batch_size_of(data["y"], "y")
      if ny != n:
        raise ValueError(
            f"x has {n} examples but y has {ny}; give one target per example.")
    if n == 0:
      raise ValueError("x has no examples.")
    weights = batches_lib.sample_weights(sample_weight, class_weight, data.get("y"), n)
    if weights is not None:
      data["sample_weight"] = weights
    # Keras's validation_split keeps the split's sample weights, not the
    # class weights (those weigh training only).
    self._sample_weight = (None if sample_weight is None else
                           batches_lib.sample_weights(sample_weight, None,
                                                      None, n))
    self.batch_size = batches_lib.check_batch_size(batch_size)
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
    if self._sample_weight is None:
      tail.pop("sample_weight", None)
    else:
      tail["sample_weight"] = self._sample_weight[cut:]
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
    pass_index, first, count = epochs.epoch_span(epoch, self.steps_per_epoch,
                                          self.pass_length)
    if count < self.steps_per_epoch and start == 0:
      epochs.warn_short(self.steps_per_epoch, self.pass_length, count)
    order, bs = self._order(pass_index), self.batch_size
    # fit pays this per step: the leaves are flattened once per epoch.
    leaves, treedef = jax.tree.flatten(self._data)
    if order is not None:
      # A shuffled batch's rows, taken from the whole arrays where the loop
      # needs them (taken ahead in a thread, they compete with the step for
      # the cores and the caches).
      for i in range(first + start, first + count):
        idx = order[i * bs:(i + 1) * bs]
        yield treedef.unflatten([a.take(idx, axis=0) for a in leaves])
      return
    for i in range(first + start, first + count):
      yield treedef.unflatten([a[i * bs:(i + 1) * bs] for a in leaves])
