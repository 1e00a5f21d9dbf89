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
import warnings

import jax
import numpy as np
import pytest

import jdist

from conftest import Interrupt, strategy_on

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


@pytest.fixture(autouse=True)
def no_keras_distribution_left():
  """A strategy's scope may leave Keras's distribution set (a model made in
  it keeps it, as in TensorFlow): none leaks into the next test."""
  yield
  keras.distribution.set_distribution(None)


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
      metrics=["accuracy"], strategy=strategy_on(n), **kwargs)
  return model, trainer


def _fit_keras(strategy, weights, data, *, optimizer=None, callbacks=(),
               validate=False, **kwargs):
  """30 batches of 24 (3 epochs) of `_mlp` (Dropout on), by default with
  Keras's SGD with momentum; Keras's accuracy object beside jdist's."""
  x, y, x_val, y_val = data
  model = _mlp(weights)
  trainer = jdist.Trainer(
      model, optimizer=optimizer or keras.optimizers.SGD(0.05, momentum=0.9),
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy", keras.metrics.SparseCategoricalAccuracy(
          name="keras_accuracy")], strategy=strategy, **kwargs)
  history = trainer.fit(x, y, batch_size=24, epochs=3, shuffle=False,
                        verbose=0, callbacks=list(callbacks),
                        validation_data=(x_val, y_val) if validate else None)
  return model, trainer, history.history


@pytest.fixture(scope="module")
def one_device_runs(data, weights):
  """The one-device runs the N-device ones compare with, by accumulation
  (what changes the trajectory): each trained once, without accumulation
  validated too."""
  runs = {}

  def run(accumulation):
    if accumulation not in runs:
      model, trainer, history = _fit_keras(
          strategy_on(1), weights, data, validate=accumulation == 1,
          gradient_accumulation_steps=accumulation)
      runs[accumulation] = (model.get_weights(), trainer.global_step, history)
    return runs[accumulation]
  return run


@pytest.fixture(scope="module")
def two_replicas(data, weights):
  """Data parallel on 2 replicas, validated: `(model, trainer, history)`."""
  return _fit_keras(strategy_on(2), weights, data, validate=True)


def test_a_keras_model_trains_in_the_trainer_as_on_one_device(
    data, one_device_runs, two_replicas):
  """30 steps of Keras's SGD with momentum of a Keras Sequential with
  Dropout, a Keras loss and metric, on 1 and 2 replicas: the same
  parameters (Dropout draws each example's mask as on one device), the
  same logs, validation's included; the trained values are written back
  into the Keras model, whose own predict then agrees with the Trainer's."""
  _, _, x_val, _ = data
  weights1, steps1, h1 = one_device_runs(1)
  m2, t2, h2 = two_replicas
  assert steps1 == t2.global_step == 30
  for a, b in zip(weights1, m2.get_weights(), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5)
  # Keras's metric object and jdist's "accuracy" count the same examples.
  assert h2["keras_accuracy"] == pytest.approx(h2["accuracy"], abs=1e-6)
  assert sorted(h1) == sorted(h2) and "val_keras_accuracy" in h2
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


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _same_weights(a, b, atol=1e-5):
  for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
    np.testing.assert_allclose(x, y, atol=atol)


def _same_history(keras_history, ours, rtol=1e-5):
  assert sorted(ours) == sorted(keras_history)
  for key, values in keras_history.items():
    np.testing.assert_allclose(ours[key], values, rtol=rtol, atol=1e-6,
                               err_msg=key)


def _two_headed(weights=None, *, as_list=False):
  """Two inputs, two outputs, L2 regularizers (the model's own losses)."""
  l2 = keras.regularizers.L2(1e-2)
  left = keras.Input((32,), name="left")
  right = keras.Input((32,), name="right")
  h = keras.layers.Concatenate()([
      keras.layers.Dense(16, activation="relu", kernel_regularizer=l2)(left),
      keras.layers.Dense(16, activation="relu")(right)])
  digit = keras.layers.Dense(10, name="digit", kernel_regularizer=l2)(h)
  ink = keras.layers.Dense(1, name="ink")(h)
  model = keras.Model([left, right], [digit, ink] if as_list else
                      {"digit": digit, "ink": ink})
  if weights is not None:
    model.set_weights(weights)
  return model


def _compile_two_headed(model):
  model.compile(
      optimizer=keras.optimizers.SGD(0.05),
      loss={"digit": keras.losses.SparseCategoricalCrossentropy(
          from_logits=True), "ink": "mse"},
      loss_weights={"digit": 1.0, "ink": 0.5},
      metrics={"digit": ["accuracy"], "ink": ["mae"]})
  return model


def test_a_compiled_two_output_model_trains_as_keras_fit_does(data):
  """A functional model with two inputs, two outputs and L2 regularizers,
  compiled with a dict of losses, loss_weights and per-output metrics:
  jdist.Trainer(model) takes its compile and trains it on 2 replicas as
  Keras's fit does on one device (the weights; the History with Keras's
  names digit_loss, ink_loss, digit_accuracy, ink_mae, the model's losses
  in "loss"); evaluate (a padded last batch) and predict agree with
  Keras's. The same arguments given to the Trainer for list outputs train
  the same; an argument given both to compile and to the Trainer, a model
  with no loss, or a loss naming no output is a clear error."""
  x, y, x_val, y_val = data
  inputs = {"left": x[:, :32], "right": x[:, 32:]}
  targets = {"digit": y, "ink": x.mean(1, keepdims=True)}
  test_x = {"left": x_val[:, :32], "right": x_val[:, 32:]}
  test_y = {"digit": y_val.astype(np.int32),
            "ink": x_val.mean(1, keepdims=True)}
  reference = _compile_two_headed(_two_headed())
  weights = reference.get_weights()
  expected = reference.fit(inputs, targets, batch_size=48, epochs=2,
                           shuffle=False, verbose=0).history

  model = _compile_two_headed(_two_headed(weights))
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


# --- the Trainer's features with a Keras model, each equal to one device


def _model_parallel():
  layout_map = jdist.LayoutMap(jdist.DeviceMesh((2, 2), ("data", "model")))
  layout_map["hidden/kernel"] = (None, "model")   # Keras's variable path
  layout_map["hidden/bias"] = ("model",)
  return jdist.ModelParallelStrategy(layout_map=layout_map)


CONFIGURATIONS = {
    # Keras's SGD with momentum; 4 batches per call, 2 per optimizer step.
    "steps_per_execution_and_accumulation": (
        lambda: strategy_on(4),
        dict(steps_per_execution=4, gradient_accumulation_steps=2)),
    # The Keras optimizer's moments split over the replicas (ZeRO).
    "zero": (lambda: strategy_on(2), dict(shard_optimizer_state=True)),
    # The hidden layer split over "model" by its Keras path, and ZeRO.
    "model_parallel": (_model_parallel, dict(shard_optimizer_state=True)),
}


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_trainer_features_with_a_keras_model_equal_one_device(
    name, data, weights, one_device_runs):
  """30 batches (SGD with momentum, Dropout on): N devices as one."""
  make_strategy, kwargs = CONFIGURATIONS[name]
  accumulation = kwargs.get("gradient_accumulation_steps", 1)
  weights1, steps1, history1 = one_device_runs(accumulation)
  many, trainer, history = _fit_keras(make_strategy(), weights, data,
                                      **kwargs)
  assert steps1 == trainer.global_step == 30 // accumulation
  for a, b in zip(weights1, many.get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-5)
  np.testing.assert_allclose(history1["loss"], history["loss"], rtol=1e-5)
  if name == "model_parallel":
    kernel = trainer.params["mlp"]["hidden"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_a_keras_models_training_resumes_exactly(data, weights, tmp_path,
                                                 two_replicas):
  """BackupAndRestore over a Keras model: the seed generators' states (its
  Dropout's) and the Keras optimizer's moments are in the train state, so
  a run killed after step 13 and resumed equals one never interrupted."""
  strategy = strategy_on(2)
  whole, _, h_whole = two_replicas
  with pytest.raises(KeyboardInterrupt):
    _fit_keras(strategy, weights, data, callbacks=[
        Interrupt(13), jdist.BackupAndRestore(tmp_path, save_freq=4)])
  backup = jdist.BackupAndRestore(tmp_path, save_freq=4)
  resumed, trainer, h_resumed = _fit_keras(strategy, weights, data,
                                           callbacks=[backup])
  assert backup.restored_step == 12
  for a, b in zip(whole.get_weights(), resumed.get_weights()):
    np.testing.assert_array_equal(a, b)
  # The epoch that spans the resume adds its restored sums in another order.
  np.testing.assert_allclose(h_resumed["loss"], h_whole["loss"], rtol=1e-6)


def test_callbacks_reach_a_keras_optimizer_and_model(data, weights, tmp_path):
  """LearningRateScheduler sets a Keras optimizer's learning rate (its
  variable, in the train state); EarlyStopping's restored best weights and
  a ModelCheckpoint's loaded ones land in the Keras model."""
  x, y, x_val, y_val = data
  model, trainer, _ = _fit_keras(
      strategy_on(1), weights, data, optimizer=keras.optimizers.SGD(0.1),
      callbacks=[jdist.LearningRateScheduler(
          lambda epoch, lr: 0.1 if epoch < 2 else 0.0),
          jdist.ModelCheckpoint(tmp_path, save_weights_only=True)])
  assert trainer.learning_rate == 0.0
  after_two = model.get_weights()
  trainer.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
  for a, b in zip(after_two, model.get_weights()):
    np.testing.assert_array_equal(a, b)  # a rate of 0 leaves them
  trainer.learning_rate = -0.5  # gradient ascent: the loss rises
  stopper = jdist.EarlyStopping(monitor="loss", patience=0,
                                restore_best_weights=True)
  history = trainer.fit(x, y, batch_size=24, epochs=4, shuffle=False,
                        verbose=0, callbacks=[stopper])
  assert trainer.stop_training, history.history
  best = jax.device_get(stopper.best_state.params)
  np.testing.assert_array_equal(model.get_layer("hidden").kernel.numpy(),
                                best["mlp"]["hidden"]["kernel"])
  trainer.load_checkpoint(tmp_path)
  for a, b in zip(after_two, model.get_weights()):
    np.testing.assert_array_equal(a, b)


def test_a_keras_model_computes_in_its_own_dtype_policy(data, weights):
  """A model built under Keras's mixed_bfloat16 policy trains in bfloat16
  by itself (the Trainer takes its policy); 2 replicas equal one device
  (to bfloat16's precision); another policy for it is a clear error."""
  keras.config.set_dtype_policy("mixed_bfloat16")
  try:
    models = [_mlp(weights) for _ in range(2)]
  finally:
    keras.config.set_dtype_policy("float32")
  x, y, _, _ = data
  trained = []
  for n, model in zip((1, 2), models):
    trainer = jdist.Trainer(model, optimizer="sgd", loss=keras.losses.
                            SparseCategoricalCrossentropy(from_logits=True),
                            strategy=strategy_on(n))
    assert trainer.predict(x[:4]).dtype == np.float32
    trainer.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
    trained.append(model.get_weights())
  for a, b in zip(*trained):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(a, b, atol=2e-3)
  with pytest.raises(ValueError, match="computes under the dtype policy "
                     "'float32'.*set_dtype_policy"):
    jdist.Trainer(_mlp(weights), optimizer="sgd", loss="mse",
                  dtype_policy="mixed_bfloat16")


# --- a text model: Embedding, LSTM and GRU ----------------------------------


def _text_model(weights=None):
  model = keras.Sequential([
      keras.Input((12,), dtype="int32"),
      keras.layers.Embedding(50, 8, mask_zero=True),
      keras.layers.LSTM(8, return_sequences=True, dropout=0.2,
                        recurrent_dropout=0.2, seed=3),
      keras.layers.GRU(8, seed=4),
      keras.layers.Dropout(0.2, seed=5),
      keras.layers.Dense(1)])
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
  reference = _text_model()
  weights = reference.get_weights()
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


# --- fit's arguments and callbacks, as in Keras's fit -----------------------


def test_class_weight_and_a_plateau_schedule_as_in_keras(data, tmp_path):
  """class_weight with validation_split weighs the training batches only
  (Keras's val_loss is unweighted), and jdist.ReduceLROnPlateau lowers a
  Keras optimizer's rate as keras.callbacks.ReduceLROnPlateau does: the
  weights, History and rates of Keras's fit. Keras's own callback objects
  are refused, naming jdist's."""
  x, y, _, _ = data
  class_weight = {c: 1.0 + 0.3 * c for c in range(10)}
  run = dict(batch_size=48, epochs=3, shuffle=False, verbose=0,
             class_weight=class_weight, validation_split=0.2)
  plateau = dict(monitor="val_loss", factor=0.5, patience=0, min_delta=10.0)
  reference = _mlp(dropout=0.0)
  weights = reference.get_weights()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS,
                    metrics=["accuracy"], weighted_metrics=["accuracy"])
  expected = reference.fit(x, y, callbacks=[
      keras.callbacks.ReduceLROnPlateau(**plateau)], **run).history
  model = _mlp(weights, dropout=0.0)
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
  fresh = jdist.Trainer(_mlp(weights, dropout=0.0), optimizer="sgd",
                        loss=LOSS, strategy=strategy_on(1))
  with pytest.raises(TypeError, match="Use jdist.EarlyStopping"):
    fresh.fit(x, y, batch_size=48, verbose=0,
              callbacks=[keras.callbacks.EarlyStopping()])
  assert fresh.state is None  # refused before anything was built or compiled


# --- custom loops: TensorFlow's "Custom training with tf.distribute.Strategy"


def _create_model():
  """The tutorial's model (its regularised CNN), for 16 x 16 digits."""
  regularizer = keras.regularizers.L2(1e-5)
  return keras.Sequential([
      keras.Input((16, 16, 1)),
      keras.layers.Conv2D(8, 3, activation="relu",
                          kernel_regularizer=regularizer),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(16, 3, activation="relu",
                          kernel_regularizer=regularizer),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(32, activation="relu", kernel_regularizer=regularizer),
      keras.layers.Dense(10, kernel_regularizer=regularizer),
  ])


def _custom_training(strategy, weights, images, labels, steps):
  """The tutorial's program, its TensorFlow lines replaced by their JAX
  equivalents: the step is a pure function of the model's variables
  (`jdist.keras_functions`), jdist's loss averaging and value metrics."""
  GLOBAL_BATCH_SIZE = 32

  with strategy.scope():
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")

    def compute_loss(labels, predictions, model_losses):
      per_example_loss = loss_object(labels, predictions)
      loss = jdist.compute_average_loss(per_example_loss)
      if model_losses:
        loss += jdist.scale_regularization_loss(model_losses)
      return loss

    train_accuracy = jdist.metrics.SparseCategoricalAccuracy(
        name="train_accuracy")

  with strategy.scope():
    model = _create_model()
    model.set_weights(weights)
    optimizer = keras.optimizers.Adam(learning_rate=0.001)
    variables, model_fns = jdist.keras_functions(model, optimizer)

  def train_step(variables, train_accuracy, inputs):
    images, labels = inputs

    def loss_fn(trainable):
      predictions, non_trainable, model_losses = model_fns.call(
          trainable, variables.non_trainable, images, training=True)
      loss = compute_loss(labels, predictions, model_losses)
      return loss, (predictions, non_trainable)

    (loss, (predictions, non_trainable)), gradients = jax.value_and_grad(
        loss_fn, has_aux=True)(variables.trainable)
    variables = model_fns.apply_gradients(
        variables.replace(non_trainable=non_trainable), gradients)
    train_accuracy = train_accuracy.update(labels, predictions)
    return variables, train_accuracy, loss

  @jax.jit
  def distributed_train_step(variables, train_accuracy, dataset_inputs):
    variables, train_accuracy, per_replica_losses = strategy.run(
        train_step, args=(variables, train_accuracy, dataset_inputs))
    return variables, train_accuracy, strategy.reduce(
        jdist.ReduceOp.SUM, per_replica_losses, axis=None)

  dataset = [(images[i:i + GLOBAL_BATCH_SIZE], labels[i:i + GLOBAL_BATCH_SIZE])
             for i in range(0, steps * GLOBAL_BATCH_SIZE, GLOBAL_BATCH_SIZE)]
  train_dist_dataset = strategy.experimental_distribute_dataset(dataset)
  variables = strategy.replicate(variables)
  train_accuracy = strategy.replicate(train_accuracy)
  total_loss = 0.0
  for x in train_dist_dataset:
    variables, train_accuracy, loss = distributed_train_step(
        variables, train_accuracy, x)
    total_loss += float(loss)
  model_fns.assign(variables)
  return model, total_loss / steps, float(train_accuracy.result())


def test_tensorflows_custom_training_tutorial_ports_with_its_keras_model(
    digits):
  """The tutorial's loop (its Adam, its regularised Keras CNN, the model's
  losses scaled by the replicas) on 2 replicas equals one device, and the
  trained values land in the Keras model."""
  x, y = digits
  images = np.repeat(np.repeat(x[:192], 2, axis=1), 2, axis=2)  # 16 x 16
  weights = _create_model().get_weights()
  one = _custom_training(strategy_on(1), weights, images, y[:192], steps=6)
  two = _custom_training(strategy_on(2), weights, images, y[:192], steps=6)
  for a, b in zip(one[0].get_weights(), two[0].get_weights()):
    np.testing.assert_allclose(a, b, atol=2e-5)
  assert two[1] == pytest.approx(one[1], rel=1e-5)
  assert two[2] == pytest.approx(one[2], abs=1e-6)
  assert not np.allclose(one[0].get_weights()[0], weights[0])  # it trained


# --- Keras's own fit under a strategy's scope ------------------------------


def _compiled(weights, optimizer="sgd"):
  model = _mlp(weights, dropout=0.0)
  model.compile(optimizer=optimizer, metrics=["accuracy"],
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def test_keras_fit_under_a_scope_distributes_or_fails_loudly(data, weights):
  """TensorFlow's literal program: model and compile in the scope, fit
  after it. The scope sets Keras's distribution (DataParallel over the
  strategy's devices), whose fit then runs data-parallel; a
  ModelParallelStrategy's LayoutMap splits the variables Keras makes; a
  strategy Keras's fit cannot run fails at fit, naming jdist.Trainer.
  (That Keras's fit in these scopes trains as one device does is
  test_keras_programs.py's: TensorFlow's tutorial and Keras's guide.)"""
  x, y, _, _ = data
  strategy = strategy_on(2)
  with strategy.scope():
    model = _compiled(weights)
  distribution = keras.distribution.distribution()
  assert isinstance(distribution, keras.distribution.DataParallel)
  assert list(distribution.device_mesh.devices) == list(strategy.devices)
  kernel = model.get_layer("hidden").kernel.value
  assert set(kernel.sharding.device_set) == set(strategy.devices)

  mesh = jdist.DeviceMesh((2, 2), ("data", "model"))
  layout_map = jdist.LayoutMap(mesh)
  layout_map["hidden/kernel"] = (None, "model")
  with jdist.ModelParallelStrategy(layout_map=layout_map).scope():
    split = _compiled(weights)
  assert split.get_layer("hidden").kernel.value.sharding.spec == \
      jax.sharding.PartitionSpec(None, "model")

  with jdist.CentralStorageStrategy(jax.devices()[:2]).scope():
    central = _compiled(weights)
  with pytest.raises(RuntimeError, match=r"Keras's own fit cannot run on "
                     r"CentralStorageStrategy.*jdist\.Trainer"):
    central.fit(x, y, batch_size=48, epochs=1, verbose=0)

  # A scope that made no Keras variables leaves Keras as it found it.
  keras.distribution.set_distribution(None)
  with strategy_on(2).scope():
    assert keras.distribution.distribution() is not None
  assert keras.distribution.distribution() is None


# --- other kinds of Keras models, Keras's names, clear errors --------------


class _Subclassed(keras.Model):
  """A subclassed model, unbuilt until it sees data."""

  def __init__(self):
    super().__init__(name="sub")
    self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
    self.norm = keras.layers.BatchNormalization(name="norm")
    self.out = keras.layers.Dense(1, activation="sigmoid", name="out")

  def call(self, x, training=False):
    return self.out(self.norm(self.hidden(x), training=training))


def test_unbuilt_and_functional_models_with_batch_statistics(data):
  """A subclassed model unbuilt until the first batch, and a functional one
  with BatchNormalization: their moving statistics are model state,
  averaged over replicas after each step (with a warning, once, that each
  replica normalises with its own batch's statistics); Keras metric names
  ("auc") and objects (keras.metrics.AUC) count every example once. On
  whole batches the functional one trains as Keras's fit; on a padded short
  batch it differs, and says so once."""
  x, y, x_val, y_val = data
  binary, binary_val = (y % 2).astype(np.float32), (y_val % 2).astype(
      np.float32)
  model = _Subclassed()
  assert not model.built
  trainer = jdist.Trainer(
      model, optimizer="adam", loss="binary_crossentropy", strategy=strategy_on(2),
      metrics=["auc", keras.metrics.AUC(name="keras_auc")])
  with pytest.warns(UserWarning, match="each replica normalises with its "
                    "own batch's statistics") as record:
    trainer.fit(x, binary, batch_size=48, epochs=1, verbose=0)
  assert len([w for w in record if "normalises" in str(w.message)]) == 1
  assert model.built
  state = trainer.state.model_state
  assert set(state["sub"]["norm"]) == {"moving_mean", "moving_variance"}
  moving = np.asarray(state["sub"]["norm"]["moving_mean"])
  assert np.abs(moving).max() > 0  # the statistics moved
  np.testing.assert_allclose(model.get_layer("norm").moving_mean.numpy(), moving)
  # Evaluated on 100 examples, batches of 32 over 2 replicas (the last one
  # padded): Keras's AUC on the same predictions, computed by Keras.
  logs = trainer.evaluate(x_val, binary_val, batch_size=32)
  reference = keras.metrics.AUC()
  reference.update_state(binary_val, model.predict(x_val, verbose=0))
  assert logs["auc"] == pytest.approx(float(reference.result()), abs=1e-6)
  assert logs["keras_auc"] == pytest.approx(logs["auc"], abs=1e-6)

  # A functional one: whole batches train as Keras's fit, without a word; a
  # short last batch, padded, enters the batch statistics (Keras's fit uses
  # the short batch alone): its first step says so, once.
  def functional(weights=None):
    inputs = keras.Input((64,))
    hidden = keras.layers.BatchNormalization()(
        keras.layers.Dense(16, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    if weights is not None:
      model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    return model

  reference = functional()
  ours = functional(reference.get_weights())
  trainer = jdist.Trainer(ours, strategy=strategy_on(1))
  for n, warns in ((240, False), (72, True)):
    reference.fit(x[:n], y[:n], batch_size=48, epochs=2, shuffle=False,
                  verbose=0)
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      trainer.fit(x[:n], y[:n], batch_size=48, epochs=2, shuffle=False,
                  verbose=0)
    said = [w for w in record if "padding rows too" in str(w.message)]
    assert len(said) == int(warns), [str(w.message) for w in record]
    if not warns:
      for a, b in zip(reference.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
  assert trainer.global_step == 14
  assert not np.allclose(reference.get_weights()[0], ours.get_weights()[0],
                         atol=1e-4)


def test_clear_errors_for_keras_objects_jdist_cannot_honour(weights):
  model = _mlp(weights)
  with pytest.raises(ValueError, match="reduction='sum'.*sum_over_batch_size"):
    jdist.Trainer(model, optimizer="sgd",
                  loss=keras.losses.MeanSquaredError(reduction="sum"))
  with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
    jdist.Trainer(model, loss="mse", optimizer=keras.optimizers.SGD(
        gradient_accumulation_steps=2))
  with pytest.raises(ValueError, match="LossScaleOptimizer.*mixed_float16"):
    jdist.Trainer(model, loss="mse", optimizer=keras.optimizers.
                  LossScaleOptimizer(keras.optimizers.SGD()))
  with pytest.raises(ValueError, match="holds its own variables"):
    jdist.Trainer(model, loss="mse", optimizer="sgd", params={})


def _run(code: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
      text=True, timeout=300, env={**os.environ, **env})


def test_keras_on_another_backend_is_a_clear_error():
  """A Keras model whose keras runs on another backend (numpy here, the
  same for TensorFlow) cannot run through its JAX stateless API: the Trainer says how to fix it. A Keras optimizer's
  name without keras installed says what to install; importing jdist and
  using the Trainer with optax never needs keras."""
  other = _run("""
      import keras, jdist
      model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      try:
        jdist.Trainer(model, optimizer="sgd", loss="mse")
      except RuntimeError as e:
        print("ERROR", e)
      """, KERAS_BACKEND="numpy")
  assert "ERROR" in other.stdout, other.stderr[-2000:]
  assert "'numpy' backend" in other.stdout
  assert "KERAS_BACKEND=jax" in other.stdout



def test_a_keras_name_without_keras_installed_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "keras", None)  # as if not installed
  with pytest.raises(ImportError, match=r"needs Keras 3, which is not "
                     r"installed: pip install 'jdist\[keras\]'"):
    jdist.Trainer(lambda p, x: x @ p, params={}, optimizer="adam", loss="mse")
