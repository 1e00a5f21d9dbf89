"""The `keras.distribution` a jdist strategy's scope sets, so that
`with strategy.scope(): ...; model.fit()` distributes Keras's own `fit`
(`DataParallel`, or `ModelParallel` by the `LayoutMap`; one Keras cannot
run raises, naming `jdist.Trainer`). It stays set after the scope, as a
TensorFlow model keeps its strategy (docs/keras.md).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import numpy as np

from jdist._src.keras import loading
from jdist._src.strategies.layout_map import LayoutMap

# Values of a strategy's `keras_distribution` attribute.
DATA_PARALLEL = "data_parallel"
MODEL_PARALLEL = "model_parallel"
UNSUPPORTED = "unsupported"


def _unsupported_message(strategy) -> str:
  return (
      f"Keras's own fit cannot run on {type(strategy).__name__}: its "
      "keras.distribution has no equivalent of it (Keras on JAX distributes "
      "as DataParallel or ModelParallel only). Train the Keras model with "
      "jdist.Trainer(model, optimizer=..., loss=..., strategy=strategy)."
      "fit(...), which runs it on this strategy, or use MirroredStrategy "
      "or ModelParallelStrategy with Keras's fit.")


@functools.cache
def _classes(keras) -> dict:
  """The Keras distribution classes jdist sets (made once keras is loaded)."""

  class Counting:
    """Counts the variables Keras lays out while this distribution is set."""

    variables_made = 0

    def get_variable_layout(self, variable):
      self.variables_made += 1
      return super().get_variable_layout(variable)

  class JdistDataParallel(Counting, keras.distribution.DataParallel):
    """`DataParallel` over a jdist strategy's replicas."""

  class JdistModelParallel(Counting, keras.distribution.ModelParallel):
    """`ModelParallel` laid out by a jdist `LayoutMap` (jdist's matching)."""

    def __init__(self, layout_map, jdist_map, batch_dim_name):
      super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name)
      self.jdist_map = jdist_map

    def _layout(self, path):
      spec = self.jdist_map.layout_of(path)
      if spec is None:
        return None
      return keras.distribution.TensorLayout(tuple(spec), self.device_mesh)

    def get_variable_layout(self, variable):
      # Keras asks only for variables made without a layout of their own
      # (an optimizer's slot takes its parameter's).
      self.variables_made += 1
      layout = self._layout(variable.path)
      if layout is not None:
        return layout
      return keras.distribution.TensorLayout([None] * len(variable.shape),
                                             self.device_mesh)

    def get_tensor_layout(self, path):
      return self._layout(path)

  class JdistUnsupported(Counting, keras.distribution.DataParallel):
    """Lays variables out as without a distribution; refuses Keras's fit."""

    def __init__(self, device_mesh, message):
      super().__init__(device_mesh=device_mesh)
      self.message = message

    def get_data_layout(self, data_shape):
      raise RuntimeError(self.message)

    def distribute_dataset(self, dataset):
      raise RuntimeError(self.message)

    def get_variable_layout(self, variable):
      self.variables_made += 1
      return None

    def get_tensor_layout(self, path):
      return None

  return {DATA_PARALLEL: JdistDataParallel, MODEL_PARALLEL: JdistModelParallel,
          UNSUPPORTED: JdistUnsupported}


def _keras_mesh(keras, mesh, axis_names=None):
  """A `keras.distribution.DeviceMesh` of a jax mesh's devices."""
  names = list(axis_names or mesh.axis_names)
  return keras.distribution.DeviceMesh(
      tuple(mesh.devices.shape), names, devices=np.asarray(mesh.devices))


def make(strategy):
  """The Keras distribution `strategy`'s scope sets (see the module
  docstring); None for a strategy that leaves Keras alone (the default)."""
  kind = getattr(strategy, "keras_distribution", UNSUPPORTED)
  if kind is None:
    return None
  keras = loading.keras_module("A strategy's scope")
  classes = _classes(keras)
  if kind == DATA_PARALLEL:
    return classes[kind](device_mesh=_keras_mesh(keras, strategy.mesh))
  if kind == MODEL_PARALLEL:
    mesh = _keras_mesh(keras, strategy.mesh)
    keras_map = keras.distribution.LayoutMap(mesh)
    jdist_map = strategy.layout_map or LayoutMap(strategy.device_mesh)
    return classes[kind](keras_map, jdist_map,
                         batch_dim_name=strategy.axis_name)
  mesh = getattr(strategy, "mesh", None)
  keras_mesh = (_keras_mesh(keras, mesh) if mesh is not None else
                keras.distribution.DeviceMesh((1,), ["batch"]))
  return classes[UNSUPPORTED](keras_mesh, _unsupported_message(strategy))


_warned_backend = False


@contextlib.contextmanager
def scope(strategy, inner: contextlib.AbstractContextManager) -> Iterator:
  """`inner` (the strategy's scope), with Keras's distribution set while it
  is open, when the program uses keras (see the module docstring)."""
  global _warned_backend
  with inner as value:
    if not loading.is_loaded() or getattr(
        strategy, "keras_distribution", UNSUPPORTED) is None:
      yield value
      return
    problem = loading.backend_problem()
    if problem is not None:
      if not _warned_backend:
        _warned_backend = True
        warnings.warn(
            f"jdist's strategy scopes distribute Keras models on JAX only: "
            f"{problem} Keras's own fit in this scope trains on one device.",
            stacklevel=4)
      yield value
      return
    keras = loading.keras_module("A strategy's scope")
    before = keras.distribution.distribution()
    ours = make(strategy)
    keras.distribution.set_distribution(ours)
    try:
      yield value
    finally:
      kept = (keras.distribution.distribution() is ours and
              ours.variables_made > 0)
      if not kept:
        keras.distribution.set_distribution(before)
