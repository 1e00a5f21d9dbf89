"""The default strategy: what applies outside every scope (one replica)."""

from __future__ import annotations

import functools

import jax

from jdist._src.strategies.spmd import Strategy


class DefaultStrategy(Strategy):
  """The strategy in effect outside any scope: one replica, the default device."""

  keras_distribution = None  # no scope: Keras is left as the program set it

  def __init__(self):
    super().__init__((jax.local_devices()[0],))


@functools.lru_cache(maxsize=None)
def _default_for(backend_key) -> DefaultStrategy:
  del backend_key
  return DefaultStrategy()


def default_strategy() -> DefaultStrategy:
  return _default_for(jax.local_devices()[0])
