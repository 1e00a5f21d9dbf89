"""The order `fit` reads shuffled arrays in: one permutation per epoch.

Epoch `e` of `n` examples shuffled with seed `s` reads them in the order
`numpy.random.default_rng([s, e]).permutation(n)`: any epoch's order, and
so any position in it, is recomputed exactly on resume.

Drawing a permutation costs a few hundred microseconds for 32,768
examples, at each epoch's start: in a small model's `fit`, about 2% of the
loop's thread's time. numpy draws it without holding the GIL, so the next
epoch's is drawn in a worker thread while this epoch trains (the first
epoch's while fit prepares its step). The loop waits only for a draw
under way: one the worker has not started (a resumed epoch's, or any on a
busy machine that leaves the worker no core) is drawn where it is needed. At most two permutations are
held: the epoch's and the next.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

_pool = None
_pool_lock = threading.Lock()


def worker() -> concurrent.futures.ThreadPoolExecutor:
  """The one thread permutations are drawn ahead in, and shuffled batches'
  rows taken (`gather.py`); made on first use."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix="jdist-epoch-order")
    return _pool


def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  """Epoch `epoch`'s order of `n` examples shuffled with `seed`.

  Example:
    >>> from jdist._src.training.epoch_order import permutation
    >>> sorted(permutation(0, 3, 5).tolist())
    [0, 1, 2, 3, 4]
  """
  return np.random.default_rng([seed, epoch]).permutation(n)


class EpochOrders:
  """Each epoch's `permutation(seed, epoch, n)`, the next drawn ahead.

  Args:
    seed: the shuffling seed.
    n: the number of examples.

  Example:
    >>> from jdist._src.training.epoch_order import EpochOrders, permutation
    >>> orders = EpochOrders(seed=0, n=6)
    >>> [bool((orders(e) == permutation(0, e, 6)).all()) for e in (0, 1, 5)]
    [True, True, True]
  """

  def __init__(self, seed: int, n: int):
    self._seed = seed
    self._n = n
    self._ahead = None  # (epoch, future of its permutation)
    self._draw_ahead(0)  # while fit prepares (compiles) its step

  def _draw_ahead(self, epoch: int) -> None:
    self._ahead = (epoch, worker().submit(permutation, self._seed, epoch,
                                           self._n))

  def __call__(self, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation; starts drawing epoch `epoch + 1`'s."""
    ahead, self._ahead = self._ahead, None
    # Drawn ahead; or, if the worker has not started it (a busy machine),
    # drawn here rather than waited for.
    if ahead is not None and ahead[0] == epoch and (
        ahead[1].done() or not ahead[1].cancel()):
      order = ahead[1].result()
    else:
      if ahead is not None:
        ahead[1].cancel()
      order = permutation(self._seed, epoch, self._n)
    self._draw_ahead(epoch + 1)
    return order
