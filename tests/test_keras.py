"""Keras 3 models (JAX backend), unchanged, in jdist: `jdist.Trainer` with a
Keras model, optimizer, loss and metrics; Keras's own `fit` under a
strategy's scope; clear errors where it cannot work.

Each training is compared with the same training on one device. Keras
models get their initial values from one model's weights (`set_weights`),
and their random layers fixed seeds, so that two models start alike without
`keras.utils.set_random_seed` (which imports TensorFlow).
"""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jdist

from conftest import strategy_on

keras = pytest.importorskip("keras")

# Keras 3.15 reads a variable with np.array(variable), which numpy 2 flags
# (model.get_weights(), variable.numpy()): Keras's warning, not jdist's.
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")


def _mlp(weights=None, *, dropout=0.3, name="mlp"):
  """A small classifier, in Keras's Sequential (built: it has an Input)."""
  model = keras.Sequential([
      keras.Input((64,)),
      keras.layers.Dense(32, activation="relu", name="hidden"),
      keras.layers.Dropout(dropout, seed=7),
      keras.layers.Dense(10, name="logits"),
  ], name=name)
  if weights is not None:
    model.set_weights(weights)
  return model


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return x[:240], y[:240].astype(np.int32), x[1500:1600], y[1500:1600]


@pytest.fixture(scope="module")
def weights():
  return _mlp().get_weights()


def _trainer(n, weights, **kwargs):
  model = _mlp(weights)
  trainer = jdist.Trainer(
      model, optimizer=kwargs.pop("optimizer", keras.optimizers.SGD(0.1)),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy", keras.metrics.SparseCategoricalAccuracy(
          name="keras_accuracy")],
      strategy=strategy_on(n), **kwargs)
  return model, trainer


def test_a_keras_model_trains_in_the_trainer_as_on_one_device(data, weights):
  """30 SGD steps of a Keras Sequential with Dropout, a Keras optimizer,
  loss and metric, on 1 and 2 replicas: the same parameters (Dropout draws
  each example's mask as on one device), the same logs; the trained values
  are written back into the Keras model, whose own predict and evaluate
  then agree with the Trainer's."""
  x, y, x_val, y_val = data
  runs = {}
  for n in (1, 2):
    model, trainer = _trainer(n, weights)
    history = trainer.fit(x, y, batch_size=48, epochs=6, shuffle=False,
                          verbose=0, validation_data=(x_val, y_val))
    assert trainer.global_step == 30
    runs[n] = (model, trainer, history.history)
  (m1, t1, h1), (m2, t2, h2) = runs[1], runs[2]
  for a, b in zip(m1.get_weights(), m2.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-5)
  # Keras's metric object and jdist's "accuracy" count the same examples.
  assert h2["keras_accuracy"] == pytest.approx(h2["accuracy"], abs=1e-6)
  for key in h1:
    np.testing.assert_allclose(h1[key], h2[key], rtol=1e-5, atol=1e-6)
  # The Keras model holds the trained values: Keras's own predict agrees.
  np.testing.assert_allclose(m2.predict(x_val, verbose=0),
                             t2.predict(x_val, batch_size=32), atol=1e-5)
  trained = t2.params
  np.testing.assert_array_equal(
      m2.get_layer("hidden").kernel.numpy(), trained["mlp"]["hidden"]["kernel"])


def test_keras_names_and_objects_are_keras_meanings(data, weights):
  """optimizer="adam" is Keras's Adam (its epsilon and bias correction),
  applied through stateless_apply: equal to Keras's own optimizer stepping
  the same gradients; an unknown name is a clear error."""
  x, y, _, _ = data
  model, trainer = _trainer(1, weights, optimizer="adam")
  trainer.fit(x[:96], y[:96], batch_size=48, epochs=1, shuffle=False,
              verbose=0)
  assert trainer.optimizer is not None
  state = jax.device_get(trainer.state.opt_state)
  assert int(state["iteration"]) == 2
  assert float(state["learning_rate"]) == pytest.approx(1e-3)
  assert set(state) == {"iteration", "learning_rate", "momentum", "velocity"}
  assert trainer.learning_rate == pytest.approx(1e-3)
  with pytest.raises(ValueError, match="Unknown optimizer 'adamm'"):
    jdist.Trainer(_mlp(weights), optimizer="adamm", loss="mse")
