"""Random draws over the global batch, for Keras layers inside a replica.

Each `random_bits` draw whose first dimension is the replica's batch is
made for the global batch, the replica keeping its rows (found in the traced
function, Keras unpatched), so Dropout masks match one device's
(docs/keras.md).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax

from jdist._src import jax_compat
from jdist._src.core import context


def _rule(rows: int, replicas: int, replica: jax.Array):
  """The rewrite of one `random_bits` binding (see the module docstring)."""
  random_bits = jax_compat.random_bits_primitive()

  def draw(keys, *, bit_width, shape):
    if keys.shape or not shape or shape[0] != rows:
      return random_bits.bind(keys, bit_width=bit_width, shape=shape)
    whole = random_bits.bind(keys, bit_width=bit_width,
                             shape=(rows * replicas,) + tuple(shape[1:]))
    return lax.dynamic_slice_in_dim(whole, replica * rows, rows, axis=0)
  return draw


def call(fn: Callable, *args, rows: int) -> Any:
  """`fn(*args)`, its random draws of `rows` rows (the replica's batch)
  made over the global batch; as written outside a step or on one replica.

  Example:
    >>> import jax, jdist
    >>> from jdist._src.keras import global_draws
    >>> key = jax.random.key(0)
    >>> draw = lambda k: jax.random.uniform(k, (4,))
    >>> bool((global_draws.call(draw, key, rows=4) == draw(key)).all())
    True
  """
  ctx = context.current_replica_context()
  if ctx is None or ctx.num_replicas_in_sync == 1:
    return fn(*args)
  rules = {jax_compat.random_bits_primitive():
           _rule(rows, ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group)}
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  if not jax_compat.uses_primitives(closed.jaxpr, rules):
    return fn(*args)  # draws nothing: traced as written
  out = jax_compat.eval_jaxpr_rewriting(closed, jax.tree.leaves(args), rules,
                                       retype=True)
  return jax.tree.unflatten(jax.tree.structure(out_shape), out)
