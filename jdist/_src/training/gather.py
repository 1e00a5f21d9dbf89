"""Shuffled batches of in-memory arrays, their rows taken ahead in a thread.

A shuffled batch is its rows taken from the arrays in the epoch's order
(`a.take(idx, axis=0)`). Those rows are scattered over the data, so taking
them waits on memory, not on arithmetic: in a small model's `fit` it costs
about a tenth of the step, on the thread that runs the steps. numpy takes
rows without holding the GIL, so a worker thread (`shuffle_order`'s) takes
the next batches' rows, a chunk of batches at a time (one call per array
and chunk), while the loop's thread runs the steps; the loop then only
slices rows already taken.

The loop never waits for the worker: a batch whose chunk is not taken yet
(the first batches of an epoch, or a busy machine that leaves the worker no
core) is taken by the loop itself, as it was without the worker. The
batches are the same either way. The memory this holds is at most four
chunks of about `CHUNK_BYTES` or one batch (the one read, and the next
`AHEAD` being taken): bounded whatever the data's size.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from jdist._src.training import shuffle_order

# About this many bytes of rows per chunk (at least a batch): enough
# batches that the GIL changes hands for a chunk rarely (the seed MLP's fit
# ran its loop faster with 2 MiB chunks than with 1 MiB ones), few enough
# that the chunks held stay small.
CHUNK_BYTES = 2 << 20
# Chunks submitted ahead of the one the loop reads: the worker needs the
# GIL to start and end each take, which a busy loop gives up only now and
# then (in the seed MLP's fit, with two ahead the loop still took up to a
# quarter of the batches itself; with three, two or three an epoch).
AHEAD = 3


def _take(leaves: list, idx: np.ndarray) -> list:
  return [a.take(idx, axis=0) for a in leaves]


def batches_per_chunk(leaves: list, batch_size: int) -> int:
  """How many batches' rows one chunk holds (at least one)."""
  row_bytes = sum(a.nbytes // max(a.shape[0], 1) for a in leaves)
  return max(1, CHUNK_BYTES // max(row_bytes * batch_size, 1))


def shuffled_rows(leaves: list, order: np.ndarray, batch_size: int,
                  start: int, stop: int) -> Iterator[list]:
  """Each batch's rows `[a[order[i*bs:(i+1)*bs]] for a in leaves]`, for
  batch `i` from `start` to `stop`, taken ahead in the worker thread.

  Args:
    leaves: numpy arrays with the examples on axis 0.
    order: the epoch's permutation of the examples.
    batch_size: examples per batch (the epoch's last may hold fewer).
    start: the first batch.
    stop: the batch to end before.

  Example:
    >>> import numpy as np
    >>> from jdist._src.training.gather import shuffled_rows
    >>> x = np.arange(10) * 10
    >>> order = np.array([3, 1, 4, 0, 2, 9, 5, 8, 6, 7])
    >>> [rows[0].tolist() for rows in shuffled_rows([x], order, 4, 1, 3)]
    [[20, 90, 50, 80], [60, 70]]
  """
  bs, per = batch_size, batches_per_chunk(leaves, batch_size)

  def submit(lo: int):
    box = []  # the chunk's rows, once taken (a worker's error, or a
    # shutdown that cancelled it, leaves it empty: the loop then takes each
    # batch itself, and meets the error)
    idx = order[lo * bs:min(lo + per, stop) * bs]
    return box, shuffle_order.submit(lambda: box.append(_take(leaves, idx)))

  ahead = [submit(lo) for lo in range(start, stop, per)[:AHEAD]]
  try:
    for lo in range(start, stop, per):
      box, future = ahead.pop(0)
      if lo + AHEAD * per < stop:
        ahead.append(submit(lo + AHEAD * per))
      for i in range(lo, min(lo + per, stop)):
        if box:  # a list's truth: no lock taken per batch
          j = i - lo
          yield [a[j * bs:(j + 1) * bs] for a in box[0]]
        else:  # not taken yet: take this batch here
          yield _take(leaves, order[i * bs:(i + 1) * bs])
      if future is not None:
        future.cancel()
  finally:
    for _, future in ahead:
      if future is not None:
        future.cancel()
