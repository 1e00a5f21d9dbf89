"""scikit-learn's digits (ships with scikit-learn) as numpy batches."""

from __future__ import annotations

from typing import Iterator

import numpy as np


def load_digits(*, image: bool = True, dtype=np.float32):
  """Returns `(x, y)`: 1,797 digits scaled to [0, 1], labels 0-9.

  Args:
    image: shape `(n, 8, 8, 1)` if True, `(n, 64)` otherwise.
  """
  try:
    from sklearn.datasets import load_digits as _load
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "The digits data comes with scikit-learn: pip install scikit-learn "
        "(or pip install 'jdist[examples]').") from e
  d = _load()
  x = (d.data / 16.0).astype(dtype)
  x = x.reshape(-1, 8, 8, 1) if image else x
  return x, d.target.astype(np.int32)


def batches(x, y, batch_size: int, *, shuffle_seed: int | None = None,
            drop_remainder: bool = False) -> list:
  """Splits arrays into a list of `{"x", "y"}` batches (the last may be short)."""
  order = np.arange(len(x))
  if shuffle_seed is not None:
    order = np.random.default_rng(shuffle_seed).permutation(len(x))
  out = []
  for start in range(0, len(x), batch_size):
    idx = order[start:start + batch_size]
    if drop_remainder and len(idx) < batch_size:
      break
    out.append({"x": x[idx], "y": y[idx]})
  return out


def synthetic(n: int, features: int, classes: int, *, seed: int = 0):
  """Random features and labels, for overhead benchmarks."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, features)).astype(np.float32)
  y = rng.integers(0, classes, n).astype(np.int32)
  return x, y


def iterate(x, y, batch_size: int) -> Iterator[dict]:
  for start in range(0, len(x), batch_size):
    yield {"x": x[start:start + batch_size], "y": y[start:start + batch_size]}
