"""Random draws that make a step differ from one device, found in its program.

A draw with the step's mirrored key (flax's `Dropout`) gives every replica
the same mask for different examples. In the trace: a `random_bits` result,
not varying over the replica axis, whose leading axis is the replica's batch.
"""

from __future__ import annotations

from typing import Any

from jdist._src import jax_compat
from jdist._src.core.scaling_check import sub_jaxprs

_DRAWS = {"random_bits"}


def _draws(jaxpr, axis: str, rows: int, found: list) -> None:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _DRAWS:
      aval = eqn.outvars[0].aval
      shape = tuple(aval.shape)
      if (shape and shape[0] == rows and
          axis not in jax_compat.aval_varying_axes(aval)):
        found.append(shape)
    for inner, _ in sub_jaxprs(eqn.params):
      _draws(inner, axis, rows, found)


def same_draws(closed_jaxpr: Any, axis: str, rows: int) -> list[tuple]:
  """The shapes of the draws that every replica makes alike over its `rows`
  rows, in the traced step's `shard_map`."""
  found: list = []
  _draws(closed_jaxpr.jaxpr, axis, rows, found)
  return found


def message(name: str, shape: tuple, num_replicas: int) -> str:
  """The warning for a step that draws alike on every replica."""
  return (
      f"{name} draws random numbers of shape {shape} (its replica's "
      "examples) with a key that is the same on every replica: flax's "
      "Dropout (linen or nnx), or jax.random with the step's key. Each of "
      f"the {num_replicas} replicas then draws the same mask for its own "
      "examples, where one device draws one mask over the global batch, so "
      "training differs from one device. Use jdist.dropout(key, rate, x) "
      "(each example's mask from its position in the global batch: the "
      "same on any number of replicas), or draw per example with "
      "jdist.example_keys(key, batch_size).")
