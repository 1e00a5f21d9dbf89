"""The order `fit` reads shuffled arrays in: one permutation per pass.

Pass `p` with seed `s` reads `numpy.random.default_rng([s, p])
.permutation(n)`, so a resume recomputes it; the next is drawn ahead in a
worker thread.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

_pool = None
_pool_lock = threading.Lock()


def worker() -> concurrent.futures.ThreadPoolExecutor:
  """The one thread permutations are drawn in, made on first use."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix="jdist-shuffle")
    return _pool


def submit(fn, *args) -> concurrent.futures.Future | None:
  """`fn(*args)` on the worker, or None after a concurrent `shutdown`."""
  try:
    return worker().submit(fn, *args)
  except RuntimeError:  # shut down between worker() and submit
    return None


def shutdown() -> None:
  """Ends the worker thread (`fit` calls it as it ends)."""
  global _pool
  with _pool_lock:
    pool, _pool = _pool, None
  if pool is not None:
    pool.shutdown(wait=True, cancel_futures=True)


def permutation(seed: int, pass_index: int, n: int) -> np.ndarray:
  """Pass `pass_index`'s order of `n` examples shuffled with `seed`.

  Example:
    >>> from jdist._src.training.shuffle_order import permutation
    >>> sorted(permutation(0, 3, 5).tolist())
    [0, 1, 2, 3, 4]
  """
  return np.random.default_rng([seed, pass_index]).permutation(n)


class PassOrders:
  """Each pass's `permutation(seed, pass, n)`, the next drawn ahead.

  Example:
    >>> from jdist._src.training.shuffle_order import PassOrders, permutation
    >>> orders = PassOrders(seed=0, n=6)
    >>> [bool((orders(p) == permutation(0, p, 6)).all()) for p in (0, 0, 1, 5)]
    [True, True, True, True]
  """

  def __init__(self, seed: int, n: int):
    self._seed = seed
    self._n = n
    self._current = None  # (pass, its permutation): epochs may share a pass
    self._ahead = None  # (pass, future of its permutation)

  def _draw_ahead(self, pass_index: int) -> None:
    future = submit(permutation, self._seed, pass_index, self._n)
    self._ahead = None if future is None else (pass_index, future)

  def __call__(self, pass_index: int) -> np.ndarray:
    """Pass `pass_index`'s permutation; starts drawing the next pass's."""
    if self._current is not None and self._current[0] == pass_index:
      return self._current[1]
    ahead, self._ahead = self._ahead, None
    # Drawn ahead; or, if the worker has not started it (a busy machine) or
    # a shutdown cancelled it, drawn here rather than waited for.
    if ahead is not None and ahead[0] == pass_index and (
        not ahead[1].cancelled()) and (ahead[1].done() or
                                       not ahead[1].cancel()):
      order = ahead[1].result()
    else:
      if ahead is not None:
        ahead[1].cancel()
      order = permutation(self._seed, pass_index, self._n)
    self._current = (pass_index, order)
    self._draw_ahead(pass_index + 1)
    return order
