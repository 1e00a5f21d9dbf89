"""The order `fit` reads shuffled arrays in: one permutation per pass.

Pass `p` over `n` examples shuffled with seed `s` reads them in the order
`numpy.random.default_rng([s, p]).permutation(n)` (an epoch is a pass, or
part of one when `steps_per_epoch` is shorter: `epochs.epoch_span`): any
pass's order, and so any position in it, is recomputed exactly on resume.

Drawing a permutation costs a few hundred microseconds for 32,768
examples, at each pass's start: in a small model's `fit`, about 2% of the
loop's thread's time. numpy draws it without holding the GIL, so the next
pass's is drawn in a worker thread while this one trains. The loop waits
only for a draw under way: one the worker has not started (the first
pass's, a resumed pass's, or any on a busy machine that leaves the worker no
core, or one a `shutdown` cancelled) is drawn where it is needed. At most
two permutations are held: the pass's and the next.

The worker thread lives while `fit` runs: `fit` ends it (`shutdown`) when it
returns or raises, so no thread of jdist's stays behind an ended fit.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

_pool = None
_pool_lock = threading.Lock()


def worker() -> concurrent.futures.ThreadPoolExecutor:
  """The one thread permutations are drawn ahead in; made on first use
  (again after `shutdown`)."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix="jdist-shuffle")
    return _pool


def submit(fn, *args) -> concurrent.futures.Future | None:
  """`fn(*args)` submitted to the worker, or None if it cannot take it (a
  `shutdown` in another thread got there first: the caller does the work)."""
  try:
    return worker().submit(fn, *args)
  except RuntimeError:  # shut down between worker() and submit
    return None


def shutdown() -> None:
  """Ends the worker thread, its queued work cancelled and the work under
  way (one permutation) waited for; `fit` calls it as it ends. A later
  submit starts a new one."""
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

  Args:
    seed: the shuffling seed.
    n: the number of examples.

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
