"""Whether a value is a Keras object, and keras itself, checked to run on JAX.

The tests read `sys.modules` (a Keras object exists only once keras is
imported), so jdist never imports keras itself; keras on another backend
than JAX is a clear error. Every private Keras attribute jdist reads is read
here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

INSTALL = "pip install 'jdist[keras]'"


def _loaded():
  """The keras module if this program imported it, else None."""
  return sys.modules.get("keras")


def is_loaded() -> bool:
  """Whether this program imported keras."""
  return _loaded() is not None


def _is(value: Any, name: str) -> bool:
  keras = _loaded()
  if keras is None:
    return False
  cls = getattr(keras, name, None)
  return isinstance(cls, type) and isinstance(value, cls)


def is_model(value: Any) -> bool:
  """Whether `value` is a Keras model (`keras.Model`, Sequential included)."""
  return _is(value, "Model")


def is_layer(value: Any) -> bool:
  """Whether `value` is a Keras layer (a model is one too)."""
  return _is(value, "Layer")


def is_optimizer(value: Any) -> bool:
  """Whether `value` is a Keras optimizer object."""
  return _is(value, "Optimizer")


def is_loss(value: Any) -> bool:
  """Whether `value` is a Keras loss object (`keras.losses.Loss`)."""
  keras = _loaded()
  return keras is not None and isinstance(value, keras.losses.Loss)


def is_metric(value: Any) -> bool:
  """Whether `value` is a Keras metric object (`keras.metrics.Metric`)."""
  keras = _loaded()
  return keras is not None and isinstance(value, keras.metrics.Metric)


def is_callback(value: Any) -> bool:
  """Whether `value` is a Keras callback (`keras.callbacks.Callback`)."""
  keras = _loaded()
  return keras is not None and isinstance(value, keras.callbacks.Callback)


def backend_problem() -> str | None:
  """Why the imported keras cannot run jdist's Keras support, or None."""
  keras = _loaded()
  if keras is None:
    return None
  backend = keras.backend.backend()
  if backend == "jax":
    return None
  return (
      f"keras was imported with the {backend!r} backend, and jdist runs Keras "
      "models on JAX (through their stateless API). Set KERAS_BACKEND=jax "
      "before keras is first imported (os.environ['KERAS_BACKEND'] = 'jax' "
      "at the top of the program, or in the shell), and build the model "
      "again.")


def keras_module(what: str):
  """keras, imported, on the JAX backend.

  Args:
    what: what needs keras, for the message ("the optimizer 'adam'").

  Raises:
    ImportError: keras is not installed.
    RuntimeError: keras runs on another backend than JAX.
  """
  if _loaded() is None:
    # jdist imports keras only for a program that named a Keras object
    # ("adam") before importing keras itself: on JAX, unless told otherwise.
    os.environ.setdefault("KERAS_BACKEND", "jax")
    try:
      import keras  # noqa: F401  (only a program that uses Keras gets here)
    except ImportError as e:
      raise ImportError(
          f"{what} needs Keras 3, which is not installed: {INSTALL} (and set "
          "KERAS_BACKEND=jax before importing keras).") from e
  problem = backend_problem()
  if problem is not None:
    raise RuntimeError(f"{what}: {problem}")
  return _loaded()


@contextlib.contextmanager
def no_distribution() -> Iterator[None]:
  """No `keras.distribution` while jdist runs Keras code of its own (jdist
  lays out the values there); restored after."""
  keras = _loaded()
  before = keras.distribution.distribution() if keras is not None else None
  if before is None:
    yield
    return
  keras.distribution.set_distribution(None)
  try:
    yield
  finally:
    keras.distribution.set_distribution(before)


def compile_arguments(model) -> dict:
  """The arguments a compiled Keras model's `compile` was given.

  Private `model._compile_config`: the public `get_compile_config()`
  serializes them, and a function loss does not deserialize unregistered.
  """
  return dict(model._compile_config.config)
