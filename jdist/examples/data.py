"""scikit-learn's digits (ships with scikit-learn) as numpy batches."""

from __future__ import annotations

import gzip
import importlib.util
import pathlib
from typing import Iterator

import numpy as np


def load_digits(*, image: bool = True, dtype=np.float32):
  """Returns `(x, y)`: 1,797 digits scaled to [0, 1], labels 0-9.

  The digits are the file scikit-learn ships (what its `load_digits`
  reads), read without importing scikit-learn, which costs each process
  that trains on them (launched ranks, relaunches) a second of CPU.

  Args:
    image: shape `(n, 8, 8, 1)` if True, `(n, 64)` otherwise.

  Example:
    >>> from jdist.examples.data import load_digits
    >>> x, y = load_digits(image=False)
    >>> x.shape, y.shape, float(x.max()), int(y.max())
    ((1797, 64), (1797,), 1.0, 9)
  """
  path = _digits_file()
  if path is not None:
    with gzip.open(path, "rt") as f:
      data = np.loadtxt(f, delimiter=",")
    pixels, target = data[:, :-1], data[:, -1]
  else:  # a scikit-learn that keeps its data elsewhere: ask it
    try:
      from sklearn.datasets import load_digits as _load
    except ImportError as e:  # pragma: no cover - depends on the environment
      raise ImportError(
          "The digits data comes with scikit-learn: pip install scikit-learn "
          "(or pip install 'jdist[examples]').") from e
    d = _load()
    pixels, target = d.data, d.target
  x = (pixels / 16.0).astype(dtype)
  x = x.reshape(-1, 8, 8, 1) if image else x
  return x, target.astype(np.int32)


def _digits_file() -> pathlib.Path | None:
  """scikit-learn's `datasets/data/digits.csv.gz`, found without importing
  scikit-learn (None if it is not installed or not there)."""
  spec = importlib.util.find_spec("sklearn")
  if spec is None or not spec.submodule_search_locations:
    return None
  root = pathlib.Path(next(iter(spec.submodule_search_locations)))
  path = root / "datasets" / "data" / "digits.csv.gz"
  return path if path.is_file() else None


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
