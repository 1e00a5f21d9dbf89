"""The seed tutorials' models, in flax linen.

`MLP`: Dense 16 then Dense 10 (the toy model of the seed tutorial).
`CNN`: Conv 32, Conv 64, Dense 64, Dense 10, with optional batch norm and
dropout. Both compute in the dtype of their inputs and parameters unless
`dtype` says otherwise (flax's rule), so a mixed precision policy that casts
them (`jdist.Trainer(..., dtype_policy="mixed_bfloat16")`) runs them in
bfloat16. Dropout uses `jdist.dropout`, keyed by global example position, so
the model trains the same on any number of replicas.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import jdist


class MLP(nn.Module):
  hidden: int = 16
  classes: int = 10
  param_dtype: Any = jnp.float32
  dtype: Any = None  # None: the inputs' and parameters' dtype

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    dense = functools.partial(nn.Dense, param_dtype=self.param_dtype,
                              dtype=self.dtype)
    x = nn.relu(dense(self.hidden)(x))
    return dense(self.classes)(x)


class CNN(nn.Module):
  """Conv 32, Conv 64, Dense 64, Dense 10.

  Attributes:
    batch_norm: add BatchNorm after the first convolution.
    bn_axis_name: mesh axis to average batch statistics over (the strategy's
      `axis_name`), or None for per-replica statistics.
    dropout_rate: dropout before the last layer (0 to disable).
    param_dtype: the parameters' dtype.
    dtype: the computation's dtype; None (default): that of the inputs and
      parameters.
  """

  classes: int = 10
  batch_norm: bool = False
  bn_axis_name: str | None = None
  dropout_rate: float = 0.0
  param_dtype: Any = jnp.float32
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool = False):
    kw = dict(param_dtype=self.param_dtype, dtype=self.dtype)
    # A bias right before BatchNorm has no effect but noise for the optimiser.
    x = nn.Conv(32, (3, 3), use_bias=not self.batch_norm, **kw)(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                       axis_name=self.bn_axis_name if train else None, **kw)(x)
    x = nn.relu(x)
    x = nn.relu(nn.Conv(64, (3, 3), **kw)(x))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(64, **kw)(x))
    if self.dropout_rate and train:
      x = jdist.dropout(self.make_rng("dropout"), self.dropout_rate, x)
    return nn.Dense(self.classes, **kw)(x)

