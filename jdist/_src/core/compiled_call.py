"""One call of a function as one compiled program: `strategy.init`'s engine.

Run eagerly, a model's initialisation dispatches each operation alone, and
XLA compiles a small program per operation and shape; traced once under
`jax.jit` it compiles one. The arrays among
the arguments enter the program as its arguments; every other leaf (a shape
given as an int, a flag, a Python callable) stays a Python value, so
`fn(*args)` sees what it would eagerly: `init(jnp.zeros, 3)` works.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

_ARRAYS = (jax.Array, np.ndarray, np.generic)


def call_compiled(fn: Callable, args: tuple, kwargs: dict) -> Any:
  """`fn(*args, **kwargs)` computed by one compiled program.

  A function that cannot be traced (it reads an array's value in Python,
  returns something that is not an array, or mutates objects created outside
  it, as flax nnx forbids inside a trace) runs eagerly instead, as written;
  its Python code then runs a second time.

  Args:
    fn: the function.
    args, kwargs: its arguments; arrays are traced, other leaves stay Python
      values.

  Returns:
    What `fn` returns, its arrays on the devices the program chose (those of
    the argument arrays, else the default device).
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  traced = [i for i, x in enumerate(leaves) if isinstance(x, _ARRAYS)]
  trees = []  # the result's structure, read in the trace

  def program(*arrays):
    filled = list(leaves)
    for i, x in zip(traced, arrays):
      filled[i] = x
    call_args, call_kwargs = jax.tree.unflatten(treedef, filled)
    out, tree = jax.tree.flatten(fn(*call_args, **call_kwargs))
    trees.append(tree)
    return out

  # jax names the program after it (`jax_log_compiles`, profiles).
  program.__name__ = program.__qualname__ = getattr(fn, "__name__", "init")
  try:
    out = jax.jit(program)(*[leaves[i] for i in traced])
  except Exception:  # pylint: disable=broad-except
    # Not traceable: what fn does eagerly (its own error, if it fails) is
    # the answer, exactly as without compiling.
    return fn(*args, **kwargs)
  return jax.tree.unflatten(trees[-1], out)
