"""One batch of the Trainer's data: its form and its checks.

Every source brings its batches into the `{"x", "y"[, "sample_weight"]}`
form here (`to_xy`), checked numeric; Keras' `class_weight` becomes
per-example weights on the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_numeric(tree, what: str) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      dtype = np.asarray(leaf).dtype
    if not (jnp.issubdtype(dtype, jnp.number) or
            jnp.issubdtype(dtype, jnp.bool_)):
      raise TypeError(
          f"{what}{jax.tree_util.keystr(path)} holds {dtype} values, not "
          "numbers: a model trains on numeric arrays. Encode strings as "
          "integers first (for class names, e.g. "
          "sklearn.preprocessing.LabelEncoder).")


def class_weights(class_weight: dict, y) -> np.ndarray:
  """Keras' `class_weight`: each example's weight from its class (1 if
  missing; integer labels as they are, one-hot targets by their argmax)."""
  y = np.asarray(y)
  labels = np.argmax(y, -1) if y.ndim > 1 and y.shape[-1] > 1 else \
      y.reshape(y.shape[0])
  out = np.ones(labels.shape[0], np.float32)
  for cls, w in class_weight.items():
    out[labels == int(cls)] = float(w)
  return out


def check_class_weight(class_weight) -> None:
  if class_weight is None:
    return
  if not isinstance(class_weight, dict) or not all(
      isinstance(k, (int, np.integer)) and not isinstance(k, bool)
      for k in class_weight):
    raise TypeError(
        f"class_weight must be a dict {{class index: weight}}, got "
        f"{class_weight!r}.")


def to_xy(batch: Any, *, need_y: bool, class_weight=None) -> dict:
  """Brings one batch into the `{"x", "y"[, "sample_weight"]}` form."""
  if isinstance(batch, dict) and "x" in batch:
    extra = set(batch) - {"x", "y", "sample_weight"}
    if extra:
      raise ValueError(
          f"A batch dict has keys {sorted(extra)} besides 'x', 'y' and "
          "'sample_weight'. Put every model input under 'x' (it may be a dict "
          "itself) and targets under 'y'.")
    out = {"x": batch["x"], "y": batch.get("y"),
           "sample_weight": batch.get("sample_weight")}
  elif isinstance(batch, (tuple, list)):
    if not 1 <= len(batch) <= 3:
      raise ValueError(
          f"A batch tuple has {len(batch)} parts; give (x, y), "
          "(x, y, sample_weight) or (x,).")
    parts = tuple(batch) + (None,) * (3 - len(batch))
    out = {"x": parts[0], "y": parts[1], "sample_weight": parts[2]}
  elif isinstance(batch, dict):
    raise ValueError(
        f"A batch dict needs an 'x' key (and 'y' for training); got keys "
        f"{sorted(batch)}.")
  else:
    out = {"x": batch, "y": None, "sample_weight": None}
  if out["y"] is None:
    if need_y:
      raise ValueError(
          "The data has no targets: training and evaluation need batches of "
          "(x, y), {'x': x, 'y': y}, or arrays passed as x= and y=.")
    return {"x": out["x"]}
  if class_weight is not None:
    w = class_weights(class_weight, out["y"])
    if out["sample_weight"] is not None:
      w = w * np.asarray(out["sample_weight"], np.float32).reshape(w.shape[0])
    out["sample_weight"] = w
  if out["sample_weight"] is None:
    del out["sample_weight"]
  return out


def host_batch(batch, index: int, need_y: bool, class_weight, check) -> dict:
  """One batch of an iterable in the `{"x", "y"[, "sample_weight"]}` form,
  checked: numeric, and its targets by `check(y, where)` if given."""
  out = to_xy(batch, need_y=need_y, class_weight=class_weight)
  check_numeric(out, f"batch {index}: ")
  if check is not None and "y" in out:
    check(out["y"], lambda row: f"row {row} of batch {index}")
  return out


def check_batch_size(batch_size) -> int:
  if batch_size is None:
    return 32
  if isinstance(batch_size, bool) or not isinstance(batch_size,
                                                    (int, np.integer)):
    raise TypeError(f"batch_size must be a whole number, got {batch_size!r}.")
  if batch_size <= 0:
    raise ValueError(f"batch_size must be positive, got {batch_size}.")
  return int(batch_size)


def sample_weights(sample_weight, class_weight, y, n: int):
  """Per-example weights from `sample_weight` and `class_weight`, or None."""
  check_class_weight(class_weight)
  weights = None
  if sample_weight is not None:
    weights = np.asarray(sample_weight, np.float32)
    if weights.ndim == 2 and weights.shape[1] == 1:
      weights = weights[:, 0]
    if weights.shape != (n,):
      raise ValueError(
          f"sample_weight has shape {weights.shape}; give one weight per "
          f"example, shape ({n},).")
  if class_weight is not None:
    if y is None:
      raise ValueError("class_weight needs targets y.")
    cw = class_weights(class_weight, y)
    weights = cw if weights is None else weights * cw
  return weights
