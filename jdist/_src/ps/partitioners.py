"""How a variable is split over parameter servers: TensorFlow's partitioners.

As in TensorFlow, only the first axis is split, rank-0 variables never are,
and the pieces are "div" partitions (the first `rows % n` take one more row).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def _element_bytes(dtype, bytes_per_string: int) -> int:
  dtype = np.dtype(dtype)
  if dtype.kind in "OSU":
    return bytes_per_string
  return dtype.itemsize


def _positive(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class Partitioner:
  """Base class: `partitioner(shape, dtype, axis=0)` -> pieces per axis (1
  everywhere but `axis`)."""

  def __call__(self, shape: Sequence[int], dtype, axis: int = 0) -> list:
    raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
  """Cuts the first axis into `num_shards` pieces (fewer if it is shorter).

  Example:
    >>> import numpy as np, jdist
    >>> jdist.FixedShardsPartitioner(num_shards=2)((10, 3), np.float32)
    [2, 1]
  """

  def __init__(self, num_shards: int):
    _positive("num_shards", num_shards)
    self._num_shards = num_shards

  def __call__(self, shape, dtype, axis: int = 0) -> list:
    del dtype
    result = [1] * len(shape)
    result[axis] = min(self._num_shards, int(shape[axis]))
    return result


class MinSizePartitioner(Partitioner):
  """As many pieces (at most `max_shards`) of at least `min_shard_bytes`.

  Args:
    min_shard_bytes: the smallest piece, in bytes (256 KiB by default).
    max_shards: the most pieces (1 by default: no split).
    bytes_per_string: the size assumed for one string element.

  Example:
    >>> import numpy as np, jdist
    >>> jdist.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
    [2, 1]
  """

  def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
               bytes_per_string: int = 16):
    _positive("min_shard_bytes", min_shard_bytes)
    _positive("max_shards", max_shards)
    _positive("bytes_per_string", bytes_per_string)
    self._min_shard_bytes = min_shard_bytes
    self._max_shards = max_shards
    self._bytes_per_string = bytes_per_string

  def __call__(self, shape, dtype, axis: int = 0) -> list:
    if axis >= len(shape):
      raise ValueError(f"Cannot partition a variable of shape {tuple(shape)} "
                       f"along axis {axis}.")
    total = math.prod(shape) * _element_bytes(dtype, self._bytes_per_string)
    result = [1] * len(shape)
    result[axis] = max(1, min(int(shape[axis]), self._max_shards,
                              math.ceil(total / self._min_shard_bytes)))
    return result


class MaxSizePartitioner(Partitioner):
  """As few pieces as possible of at most `max_shard_bytes` (larger with
  `max_shards`).

  Args:
    max_shard_bytes: the largest piece, in bytes.
    max_shards: the most pieces (None: no limit).
    bytes_per_string: the size assumed for one string element.

  Example:
    >>> import numpy as np, jdist
    >>> jdist.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32)
    [2, 1]
  """

  def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
               bytes_per_string: int = 16):
    _positive("max_shard_bytes", max_shard_bytes)
    if max_shards is not None:
      _positive("max_shards", max_shards)
    _positive("bytes_per_string", bytes_per_string)
    self._max_shard_bytes = max_shard_bytes
    self._max_shards = max_shards
    self._bytes_per_string = bytes_per_string

  def __call__(self, shape, dtype, axis: int = 0) -> list:
    rows = int(shape[axis])
    row_bytes = (math.prod(shape) / max(rows, 1) *
                 _element_bytes(dtype, self._bytes_per_string))
    rows_per_shard = max(1, math.floor(self._max_shard_bytes / row_bytes))
    shards = math.ceil(rows / rows_per_shard)
    if self._max_shards:
      shards = min(self._max_shards, shards)
    result = [1] * len(shape)
    result[axis] = shards
    return result


def row_splits(shape: Sequence[int], dtype, partitioner) -> tuple | None:
  """The `(start, stop)` rows of each piece of a variable; None: not split.

  Raises:
    ValueError: the answer is not one count per axis, 1 but on the first.
  """
  if partitioner is None or len(shape) == 0:
    return None
  answer = partitioner(tuple(int(d) for d in shape), np.dtype(dtype))
  parts = list(answer) if isinstance(answer, (list, tuple)) else None
  if (parts is None or len(parts) != len(shape) or
      not all(_is_count(p) for p in parts) or parts[0] < 1 or
      any(p != 1 for p in parts[1:])):
    raise ValueError(
        f"The variable_partitioner returned {answer!r} for shape "
        f"{tuple(shape)}; it must return a list of whole numbers, one per axis, "
        "1 everywhere but the first axis (only the first axis is split).")
  n = min(int(parts[0]), int(shape[0]))
  if n <= 1:
    return None
  base, extra = divmod(int(shape[0]), n)
  bounds, start = [], 0
  for i in range(n):  # "div" partitions: the first `extra` get one more row
    stop = start + base + (1 if i < extra else 0)
    bounds.append((start, stop))
    start = stop
  return tuple(bounds)


def _is_count(p) -> bool:
  """A whole number of pieces (an int, not a bool or a fraction)."""
  return isinstance(p, (int, np.integer)) and not isinstance(p, (bool, np.bool_))
