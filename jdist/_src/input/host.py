"""Batches on the host: their size, padding, and placing them on the mesh
(every batch check goes through `batch_size_of`, for one message)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jdist._src.core import placement
from jdist._src.core.validity import Validity


class HostStep(NamedTuple):
  """One step's batch on the host: this process's `rows` `(local replicas, b,
  ...)`, which are `valid`, the global `count` (or None), the `fingerprint`."""

  rows: Any
  valid: np.ndarray
  count: int | None
  fingerprint: str | None = None


def batch_size_of(batch: Any, what: str) -> int:
  """The batch size shared by every leaf of `batch`.

  Raises:
    ValueError: `batch` has no arrays, a scalar leaf, or leaves whose leading
      axes differ; the message names them.
  """
  leaves = jax.tree.leaves(batch)
  # A numpy array's own shape: `np.shape` dispatches through numpy's
  # array-function protocol, at every batch.
  sizes = {(shape[0] if shape else None) for shape in
           (leaf.shape if type(leaf) is np.ndarray else np.shape(leaf)
            for leaf in leaves)}
  if len(sizes) == 1 and None not in sizes:
    return sizes.pop()
  return _batch_size_error(batch, what)


def _batch_size_error(batch: Any, what: str):
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
      f"The arrays of the {what} disagree on the batch size ({detail}); "
      "every array must have the same leading axis.")


def split_error(size: int, n: int, parts: str = "replicas") -> ValueError:
  """The error for a global batch of `size` that `n` parts cannot share."""
  examples = sorted({max(n, size - size % n), size + n - size % n})
  return ValueError(
      f"A global batch of {size} examples cannot split evenly over {n} "
      f"{parts}. Use a global batch size that is a multiple of {n} "
      f"(for example {' or '.join(map(str, examples))}); the last, shorter "
      "batch of an epoch may be any size and is padded.")


def padded_size(rows: int, multiple: int) -> int:
  """The size a batch that is all of the data is padded to: `rows` up to a
  multiple of `multiple`.

  Example:
    >>> from jdist._src.input.host import padded_size
    >>> padded_size(10, 4), padded_size(8, 4)
    (12, 8)
  """
  return rows + (-rows) % multiple


def batch_split(strategy) -> tuple[int, str]:
  """How many equal parts a global batch splits into (the replicas, times the
  devices of an FSDP batch axis), and their name in messages.

  Example:
    >>> import jax, jdist
    >>> from jdist._src.input.host import batch_split
    >>> batch_split(jdist.MirroredStrategy(jax.local_devices()[:2]))
    (2, 'replicas')
  """
  n = strategy.num_replicas_in_sync
  inner = strategy.replica_batch_axis
  if inner is None:
    return n, "replicas"
  k = strategy.mesh.shape[inner]
  return n * k, f"parts ({n} replicas x {k} devices of {inner!r})"


def _check_inner_split(local_rows, n: int, axis: str, k: int,
                       batch_axis: int) -> None:
  """Raises unless each replica's batch splits over `k` devices of `axis`."""
  for leaf in jax.tree.leaves(local_rows):
    b = np.shape(leaf)[batch_axis] if np.ndim(leaf) > batch_axis else None
    if b is not None and b % k:
      raise split_error(n * b, n * k,
                        f"parts ({n} replicas x {k} devices of {axis!r})")


def pad(x: np.ndarray, size: int) -> np.ndarray:
  """`x` with zero rows appended up to `size` rows (itself if already full)."""
  if x.shape[0] == size:
    return x
  zeros = np.zeros((size - x.shape[0],) + x.shape[1:], dtype=x.dtype)
  return np.concatenate([x, zeros], axis=0)


class Placer:
  """Places this process's rows `(local replicas, b, ...)` on a strategy's
  mesh as global `(R, b, ...)` arrays with their `Validity`, in one transfer."""

  def __init__(self, strategy):
    self.strategy = strategy
    self.local_ids = placement.local_replica_ids(strategy.mesh,
                                                 strategy.axis_name)
    ids = self.local_ids
    # This process's replicas: a slice (a view of the batch) when contiguous,
    # None when they are all of them (one process: the batch as it is).
    contiguous = ids == tuple(range(ids[0], ids[-1] + 1))
    self.local_rows = slice(ids[0], ids[-1] + 1) if contiguous else list(ids)
    if len(ids) == strategy.num_replicas_in_sync:
      self.local_rows = None
    self._full = {}        # (rows, b) -> host validity of a full batch
    self._full_masks = {}  # (rows, b) -> the host mask of a full batch

  def full_mask(self, rows: int, b: int) -> np.ndarray:
    """The all-valid host mask of shape (rows, b), one object per shape."""
    mask = self._full_masks.get((rows, b))
    if mask is None:
      mask = self._full_masks[(rows, b)] = np.ones((rows, b), bool)
    return mask

  def put(self, local_rows, batch_axis: int = 1):
    """Places a pytree of local rows `(local replicas, b, ...)` (or, with
    `batch_axis=2`, a group of steps) in one transfer."""
    s = self.strategy
    inner = s.replica_batch_axis
    if inner is None:
      return placement.put_per_replica(local_rows, s.mesh, s.axis_name,
                                       s.num_replicas_in_sync)
    # FSDP: the examples split over `inner` too; the validity stays whole.
    flat, treedef = jax.tree.flatten(
        local_rows, is_leaf=lambda x: isinstance(x, Validity))
    data = [i for i, x in enumerate(flat) if not isinstance(x, Validity)]
    _check_inner_split([flat[i] for i in data], s.num_replicas_in_sync, inner,
                       s.mesh.shape[inner], batch_axis)
    placed = placement.put_per_replica(
        [x if i in data else None for i, x in enumerate(flat)], s.mesh,
        s.axis_name, s.num_replicas_in_sync, inner, batch_axis)
    whole = placement.put_per_replica(
        [None if i in data else x for i, x in enumerate(flat)], s.mesh,
        s.axis_name, s.num_replicas_in_sync)
    return jax.tree.unflatten(
        treedef, [p if i in data else w for i, (p, w) in
                  enumerate(zip(placed, whole))])

  def validity(self, local_mask: np.ndarray, num_valid: int | None) -> Validity:
    """The host `Validity` of this process's rows (one shared for full ones)."""
    key = local_mask.shape
    if num_valid is None:
      num_valid = int(local_mask.sum())  # one process holds every row
    capacity = self.strategy.num_replicas_in_sync * local_mask.shape[1]
    full = num_valid == capacity and (
        local_mask is self._full_masks.get(key) or bool(local_mask.all()))
    if full and key in self._full:
      return self._full[key]
    host = Validity.pack(local_mask, num_valid)
    if full:
      self._full[key] = host
    return host

  def place(self, step: HostStep):
    """`(values, validity)` on the mesh from a host step, in one transfer."""
    return self.put((step.rows, self.validity(step.valid, step.count)))

  def host_group(self, items: list):
    """`(values, validity)` of several `HostStep`s stacked on a step axis
    (axis 1), on the host."""
    rows = jax.tree.map(lambda *xs: np.stack(xs, axis=1),
                        *[item.rows for item in items])
    packed = np.stack([self.validity(item.valid, item.count).packed
                       for item in items], axis=1)
    return rows, Validity(packed)
