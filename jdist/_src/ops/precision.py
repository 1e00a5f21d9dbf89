"""Mixed precision policies, by Keras' names."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# name: (compute dtype, variable dtype), as keras.mixed_precision names them.
_POLICIES = {
    "float32": ("float32", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
    "mixed_float16": ("float16", "float32"),
}


@dataclasses.dataclass(frozen=True)
class DTypePolicy:
  """A mixed precision policy: Keras' `keras.mixed_precision.DTypePolicy`.

  Args:
    name: "float32", "mixed_bfloat16" or "mixed_float16".

  Attributes:
    name: the policy's name.
    compute_dtype: the dtype layers compute in ("bfloat16", ...).
    variable_dtype: the dtype parameters live in ("float32").

  Raises:
    ValueError: an unknown name.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> policy = jdist.DTypePolicy("mixed_bfloat16")
    >>> params = {"w": jnp.ones(2), "step": jnp.int32(3)}
    >>> cast = policy.cast_to_compute(params)
    >>> str(cast["w"].dtype), str(cast["step"].dtype)
    ('bfloat16', 'int32')
  """

  name: str

  def __post_init__(self):
    if not isinstance(self.name, str) or self.name not in _POLICIES:
      raise ValueError(
          f"Unknown dtype policy {self.name!r}. Use one of {list(_POLICIES)} "
          "(Keras' names): 'mixed_bfloat16' for TPUs and recent GPUs, "
          "'mixed_float16' (with loss scaling) for older GPUs.")

  @property
  def compute_dtype(self) -> str:
    return _POLICIES[self.name][0]

  @property
  def variable_dtype(self) -> str:
    return _POLICIES[self.name][1]

  @property
  def is_mixed(self) -> bool:
    """Whether computation runs in another dtype than the variables."""
    return self.compute_dtype != self.variable_dtype

  @property
  def needs_loss_scaling(self) -> bool:
    """Whether gradients can underflow the compute dtype (float16)."""
    return self.compute_dtype == "float16"

  def cast_to_compute(self, tree: Any) -> Any:
    """Floating-point leaves of `tree` in the compute dtype (others as is)."""
    return _cast(tree, self.compute_dtype)

  def cast_to_variable(self, tree: Any) -> Any:
    """Floating-point leaves of `tree` in the variable dtype (float32)."""
    return _cast(tree, self.variable_dtype)


def _cast(tree: Any, dtype: str) -> Any:
  def cast(x):
    if isinstance(x, jax.Array) or hasattr(x, "dtype"):
      if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.asarray(x).astype(dtype)
    return x
  return jax.tree.map(cast, tree)


def policy_of(value) -> DTypePolicy:
  """`value` as a `DTypePolicy` (a name or a policy), or a clear error."""
  if isinstance(value, DTypePolicy):
    return value
  if isinstance(value, str):
    return DTypePolicy(value)
  raise TypeError(
      f"dtype_policy must be a name ({list(_POLICIES)}) or a "
      f"jdist.DTypePolicy, got {value!r}.")
