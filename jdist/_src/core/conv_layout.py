"""Convolutions in the one layout XLA's CPU backend runs fast everywhere.

XLA:CPU fixes other orders than (batch, spatial..., features) and
(spatial..., in, out) only at the top level: in a loop body they compile to
slow loop nests. For the loops jdist builds, on CPU.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdist._src import jax_compat


def runs_on_cpu(strategy=None) -> bool:
  """Whether a strategy's devices are all CPUs (without one: whether JAX's
  default backend is the CPU), read when a step is traced."""
  if strategy is None:
    return jax.default_backend() == "cpu"
  devices = np.asarray(strategy.mesh.devices).flat
  return all(d.platform == "cpu" for d in devices)


def canonical_convolution(lhs, rhs, *, dimension_numbers, **params):
  """`lax.conv_general_dilated_p` in that order, between transposes."""
  lhs_spec, rhs_spec, out_spec = dimension_numbers
  n = len(lhs_spec) - 2
  spatial = tuple(range(1, n + 1))
  lhs = jnp.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
  rhs = jnp.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
  canonical = lax.ConvDimensionNumbers(
      lhs_spec=(0, n + 1, *spatial), rhs_spec=(n + 1, n, *range(n)),
      out_spec=(0, n + 1, *spatial))
  out = lax.conv_general_dilated_p.bind(
      lhs, rhs, dimension_numbers=canonical, **params)
  # `out_spec` names the result's axis of batch, features, then each spatial
  # dimension; in `out` they sit at 0, n + 1, then 1..n.
  perm = [0] * (n + 2)
  for position, axis in zip((0, n + 1, *spatial), out_spec):
    perm[axis] = position
  return jnp.transpose(out, perm)


def canonical_convolutions(fn: Callable) -> Callable:
  """`fn` with each of its convolutions in XLA:CPU's fast layout.

  Not inside scan, cond or custom-derivative bodies (jit and remat: yes).

  Example:
    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> from jdist._src.core.conv_layout import canonical_convolutions
    >>> def f(x, w):  # NCHW images, OIHW kernels
    ...   return lax.conv_general_dilated(
    ...       x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    >>> x, w = jnp.ones((2, 3, 5, 5)), jnp.ones((4, 3, 3, 3))
    >>> bool(jnp.allclose(canonical_convolutions(f)(x, w), f(x, w)))
    True
  """
  rules = {lax.conv_general_dilated_p: canonical_convolution}

  def rewritten(*args):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    if not jax_compat.uses_primitives(closed.jaxpr, rules):
      return fn(*args)  # nothing to rewrite: traced as written
    out = jax_compat.eval_jaxpr_rewriting(closed, jax.tree.leaves(args), rules)
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)

  return rewritten
