"""`Validity`: which rows of a batch are real examples, and how many globally.

A short last batch is padded to the static shape (no recompile). Mask and
count travel as one int32 array (one extra buffer per step), a layout only
this module knows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _xp(x):
  """numpy for host arrays (no device transfer), jax.numpy otherwise."""
  return np if isinstance(x, (np.ndarray, np.generic, bool, int)) else jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Validity:
  """A batch's validity mask and global count of valid examples.

  Attributes:
    packed: int32 `(..., b + 1)`: each row's mask, then the global count.

  Example:
    >>> import numpy as np
    >>> from jdist._src.core.validity import Validity
    >>> v = Validity.pack(np.array([[True, True], [True, False]]))
    >>> v.mask.tolist(), int(v.num_valid)
    ([[True, True], [True, False]], 3)
  """

  packed: Any

  @classmethod
  def pack(cls, mask, num_valid=None) -> "Validity":
    """Packs a boolean `mask` `(..., b)` and the global count (default: its
    sum); host inputs give a host array."""
    xp = _xp(mask)
    mask = xp.asarray(mask)
    if num_valid is None:
      num_valid = mask.sum()
    count = xp.broadcast_to(xp.asarray(num_valid, xp.int32),
                            mask.shape[:-1] + (1,))
    return cls(xp.concatenate([mask.astype(xp.int32), count], axis=-1))

  @property
  def mask(self):
    """`(..., b)` booleans: True where the row is a real example."""
    return self.packed[..., :-1] > 0

  @property
  def num_valid(self):
    """The global number of valid examples (a scalar)."""
    return self.packed[(0,) * (np.ndim(self.packed) - 1) + (-1,)]

  @property
  def batch_size(self) -> int:
    """`b`: the static per-replica batch size the mask covers."""
    return int(np.shape(self.packed)[-1]) - 1

  def replica(self, index: int = 0) -> "Validity":
    """The validity of one replica's rows (inside a step: its only row)."""
    return Validity(self.packed[index])
