"""Keras programs as Keras users write them, through `jdist.Trainer`: a
functional model with two inputs and two outputs compiled with a loss per
output, `loss_weights` and per-output metrics; a text model of Embedding,
LSTM and GRU; `class_weight` with `validation_split`; Keras's callbacks and
their jdist equivalents; BatchNormalization on a short last batch.

Each is compared with Keras's own `fit` on one device (the same initial
weights, the same batches): the weights, the History's names and values.
"""

import warnings

import numpy as np
import pytest

import jdist

from conftest import strategy_on

keras = pytest.importorskip("keras")
from keras import layers  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")


@pytest.fixture(autouse=True)
def no_keras_distribution_left():
  yield
  keras.distribution.set_distribution(None)


def _same_weights(a, b, atol=1e-5):
  for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
    np.testing.assert_allclose(x, y, atol=atol)


def _same_history(keras_history, ours, rtol=1e-5):
  assert sorted(ours) == sorted(keras_history)
  for key, values in keras_history.items():
    np.testing.assert_allclose(ours[key], values, rtol=rtol, atol=1e-6,
                               err_msg=key)


# --- two inputs, two outputs: Keras's compile, per output -------------------


def _two_headed(weights=None, *, as_list=False):
  left = keras.Input((32,), name="left")
  right = keras.Input((32,), name="right")
  h = layers.Concatenate()([layers.Dense(16, activation="relu")(left),
                            layers.Dense(16, activation="relu")(right)])
  digit = layers.Dense(10, name="digit")(h)
  ink = layers.Dense(1, name="ink")(h)
  model = keras.Model([left, right], [digit, ink] if as_list else
                      {"digit": digit, "ink": ink})
  if weights is not None:
    model.set_weights(weights)
  return model


def _compile(model):
  model.compile(
      optimizer=keras.optimizers.SGD(0.05),
      loss={"digit": keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), "ink": "mse"},
      loss_weights={"digit": 1.0, "ink": 0.5},
      metrics={"digit": ["accuracy"], "ink": ["mae"]})
  return model


def test_a_two_output_model_trains_as_keras_compiled_it(digits_flat):
  """A functional model with two inputs and two outputs, compiled with a
  dict of losses, loss_weights and per-output metrics: jdist.Trainer(model)
  takes its compile and trains it on 2 replicas as Keras's fit does on one
  device (the weights; the History with Keras's names digit_loss, ink_loss,
  digit_accuracy, ink_mae); evaluate and predict agree with Keras's. The
  same arguments given to the Trainer for list outputs and dict targets
  train the same; an argument given both to compile and to the Trainer, or
  a model with no loss, is a clear error."""
  x, y = digits_flat
  inputs = {"left": x[:240, :32], "right": x[:240, 32:]}
  targets = {"digit": y[:240].astype(np.int32),
             "ink": x[:240].mean(1, keepdims=True)}
  test_x = {"left": x[1500:1600, :32], "right": x[1500:1600, 32:]}
  test_y = {"digit": y[1500:1600].astype(np.int32),
            "ink": x[1500:1600].mean(1, keepdims=True)}
  weights = _two_headed().get_weights()
  reference = _compile(_two_headed(weights))
  expected = reference.fit(inputs, targets, batch_size=48, epochs=2,
                           shuffle=False, verbose=0).history

  model = _compile(_two_headed(weights))
  trainer = jdist.Trainer(model, strategy=strategy_on(2))
  history = trainer.fit(inputs, targets, batch_size=48, epochs=2,
                        shuffle=False, verbose=0).history
  _same_weights(reference, model)
  _same_history(expected, history)
  assert trainer.metrics_names == ["loss", "digit_loss", "ink_loss",
                                   "digit_accuracy", "ink_mae"]
  logs = trainer.evaluate(test_x, test_y, batch_size=32)  # a padded batch
  keras_logs = reference.evaluate(test_x, test_y, batch_size=32, verbose=0,
                                  return_dict=True)
  assert logs == pytest.approx(keras_logs, rel=1e-5)
  predicted = trainer.predict(test_x, batch_size=32)
  for name, value in reference.predict(test_x, verbose=0).items():
    np.testing.assert_allclose(predicted[name], value, atol=1e-5)

  listed = _two_headed(weights, as_list=True)
  jdist.Trainer(
      listed, optimizer=keras.optimizers.SGD(0.05),
      loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "mse"], loss_weights=[1.0, 0.5], strategy=strategy_on(2),
  ).fit([inputs["left"], inputs["right"]], targets, batch_size=48, epochs=2,
        shuffle=False, verbose=0)
  _same_weights(reference, listed)

  with pytest.raises(ValueError, match=r"compiled with optimizer=.*SGD.*"
                     r"given optimizer='adam'.*one of them"):
    jdist.Trainer(model, optimizer="adam")
  with pytest.raises(TypeError, match=r"needs loss=.*or compile the Keras "
                     r"model"):
    jdist.Trainer(_two_headed(), optimizer="sgd")
  with pytest.raises(ValueError, match=r"names \['pixels'\], which are not "
                     r"outputs of the model: its outputs are \['digit', "
                     r"'ink'\]"):
    jdist.Trainer(_two_headed(), optimizer="sgd",
                  loss={"digit": "mse", "pixels": "mse"}).fit(
        inputs, targets, batch_size=48, verbose=0)


# --- a text model: Embedding, LSTM and GRU ----------------------------------


def _text_model(weights=None):
  model = keras.Sequential([
      keras.Input((12,), dtype="int32"),
      layers.Embedding(50, 8, mask_zero=True),
      layers.LSTM(8, return_sequences=True, dropout=0.2,
                  recurrent_dropout=0.2, seed=3),
      layers.GRU(8, seed=4),
      layers.Dropout(0.2, seed=5),
      layers.Dense(1)])
  if weights is not None:
    model.set_weights(weights)
  return model


def test_an_lstm_and_gru_text_model_trains_as_keras_fit_does():
  """Embedding (masking padded tokens), LSTM with dropout and recurrent
  dropout, GRU, Dropout: on 2 replicas jdist.Trainer gives the weights and
  History of Keras's fit on one device (the recurrent layers' loops start
  from zeros and carry each replica's batch; their dropout masks are drawn
  over the global batch)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 50, size=(128, 12)).astype(np.int32)
  tokens[rng.random(tokens.shape) < 0.2] = 0
  labels = (tokens[:, :6].sum(1) > tokens[:, 6:].sum(1)).astype(np.float32)
  loss = keras.losses.BinaryCrossentropy(from_logits=True)
  weights = _text_model().get_weights()
  reference = _text_model(weights)
  reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
  expected = reference.fit(tokens, labels, batch_size=32, epochs=2,
                           shuffle=False, verbose=0).history
  model = _text_model(weights)
  history = jdist.Trainer(
      model, optimizer=keras.optimizers.Adam(1e-2), loss=loss,
      strategy=strategy_on(2)).fit(tokens, labels, batch_size=32, epochs=2,
                                   shuffle=False, verbose=0).history
  _same_weights(reference, model)
  _same_history(expected, history)


# --- fit's arguments and callbacks -------------------------------------------


def _mlp(weights=None, *, norm=False):
  model = keras.Sequential(
      [keras.Input((64,)), layers.Dense(16)] +
      ([layers.BatchNormalization()] if norm else []) +
      [layers.Activation("relu"), layers.Dense(10)])
  if weights is not None:
    model.set_weights(weights)
  return model


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_class_weight_and_a_plateau_schedule_as_in_keras(digits_flat,
                                                         tmp_path):
  """class_weight with validation_split weighs the training batches only
  (Keras's val_loss is unweighted), and jdist.ReduceLROnPlateau lowers a
  Keras optimizer's rate as keras.callbacks.ReduceLROnPlateau does: the
  weights, History and rates of Keras's fit. Keras's own callback objects
  are refused, naming jdist's."""
  x, y = digits_flat
  x, y = x[:300], y[:300].astype(np.int32)
  class_weight = {c: 1.0 + 0.3 * c for c in range(10)}
  weights = _mlp().get_weights()
  run = dict(batch_size=48, epochs=3, shuffle=False, verbose=0,
             class_weight=class_weight, validation_split=0.2)
  plateau = dict(monitor="val_loss", factor=0.5, patience=0, min_delta=10.0)
  reference = _mlp(weights)
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                    metrics=["accuracy"], weighted_metrics=["accuracy"])
  expected = reference.fit(x, y, callbacks=[
      keras.callbacks.ReduceLROnPlateau(**plateau)], **run).history
  model = _mlp(weights)
  trainer = jdist.Trainer(model, optimizer=keras.optimizers.SGD(0.1),
                          loss=LOSS, metrics=["accuracy"],
                          weighted_metrics=["accuracy"],
                          strategy=strategy_on(1))
  history = trainer.fit(x, y, callbacks=[jdist.ReduceLROnPlateau(**plateau)],
                        **run).history
  _same_weights(reference, model)
  _same_history(expected, history)
  # Logged before each epoch's change, as Keras logs it.
  assert history["learning_rate"] == pytest.approx([0.1, 0.1, 0.05])
  assert trainer.learning_rate == pytest.approx(0.025)

  for callback, ours in [
      (keras.callbacks.EarlyStopping(patience=1), "jdist.EarlyStopping"),
      (keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
       "jdist.ModelCheckpoint"),
      (keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
       "jdist.CSVLogger")]:
    with pytest.raises(TypeError, match=f"Keras's own fit.*Use {ours}, "
                       "which takes the same arguments"):
      trainer.fit(x, y, batch_size=48, verbose=0, callbacks=[callback])
  with pytest.raises(TypeError, match="Subclass jdist.Callback instead"):
    trainer.fit(x, y, batch_size=48, verbose=0,
                callbacks=[keras.callbacks.LambdaCallback()])


def test_batch_normalization_on_a_short_last_batch_says_it_differs(
    digits_flat):
  """A BatchNormalization model whose data ends in a short batch: the
  padded batch's statistics include the padding rows, so training differs
  from Keras's fit, and the first such step says so, once; data that
  splits into whole batches trains as Keras's fit, without a word."""
  x, y = digits_flat
  weights = _mlp(norm=True).get_weights()
  for n, warns in ((96, False), (120, True)):
    reference = _mlp(weights, norm=True)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    reference.fit(x[:n], y[:n], batch_size=48, epochs=2, shuffle=False,
                  verbose=0)
    model = _mlp(weights, norm=True)
    trainer = jdist.Trainer(model, optimizer=keras.optimizers.SGD(0.1),
                            loss=LOSS, strategy=strategy_on(1))
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      trainer.fit(x[:n], y[:n], batch_size=48, epochs=2, shuffle=False,
                  verbose=0)
    said = [w for w in record if "padding rows too" in str(w.message)]
    assert len(said) == int(warns), [str(w.message) for w in record]
    if not warns:
      _same_weights(reference, model)
    else:
      assert not np.allclose(reference.get_weights()[0], model.get_weights()[0],
                             atol=1e-4)
