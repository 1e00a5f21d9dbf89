"""What a `ServerVariables` handle forwards to the object it holds, with the
meaning each method has on a variable.

What only reads runs on a copy read from the servers; what changes its
object in place runs on the copy, written back; what returns a new object
is refused with the assignment to write (a handle replaced by a plain value
would stop reaching the servers).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jdist._src.ops.metrics import Metric

_PLAIN = (tuple, list, dict, np.ndarray, np.generic, jax.Array, int, float,
          complex, bool)
_KERAS_RESETS = ("reset_state", "reset_states")


def attributes(value: Any) -> dict:
  """The public attributes a handle of `value` forwards: name -> whether it is
  a method (looked up on the class, so no property runs)."""
  if isinstance(value, _PLAIN):
    return {}
  cls = type(value)
  return {n: callable(getattr(cls, n, None)) for n in dir(value)
          if not n.startswith("_")}


def attribute(handle, value_type: type, name: str, is_method: bool) -> Any:
  """`handle.<name>` for a name of the held object (see the module)."""
  if issubclass(value_type, Metric) and name in _KERAS_RESETS:
    return lambda: _reset_metric(handle)
  if issubclass(value_type, Metric) and name == "update_state":
    raise TypeError(
        f"A {value_type.__name__} held on the parameter servers is updated "
        "inside a step: pass the handle to the step and return the new "
        "metric as the step's new state, e.g. `return metric.update(labels, "
        "predictions), outputs`.")
  if not is_method:
    return getattr(handle.read(), name)

  def method(*args, **kwargs):
    value = handle.read()
    before = _host_leaves(value)
    out = getattr(value, name)(*args, **kwargs)
    if isinstance(out, value_type):
      raise TypeError(
          f"{name}() returns a new {value_type.__name__} and leaves the one "
          f"on the parameter servers as it is. To change it there write "
          f"`handle.assign(handle.read().{name}(...))`" + (
              " (or `handle.reset_state()`, as in Keras)"
              if issubclass(value_type, Metric) and name == "reset" else "") +
          "; to use the new value without the servers, `handle.read()."
          f"{name}(...)`.")
    if _changed(before, value):  # an in-place method: keep what it did
      handle.assign(value)
    return out

  method.__name__ = name
  return method


def _reset_metric(handle) -> None:
  handle.assign(handle.read().reset())


def _host_leaves(tree) -> tuple:
  """`(structure, copies of the leaves)`, to see an in-place change."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [np.array(jax.random.key_data(x) if _is_key(x) else x)
                   for x in leaves]


def _is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _changed(before: tuple, tree) -> bool:
  treedef, leaves = _host_leaves(tree)
  return treedef != before[0] or any(
      a.shape != b.shape or
      not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
      for a, b in zip(leaves, before[1]))
