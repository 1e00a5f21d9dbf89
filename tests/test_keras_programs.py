"""Two public Keras programs, ported to jdist by changing their strategy lines
only, each equal to the same program on one device.

1. TensorFlow's tutorial "Distributed training with Keras"
   (`tf.distribute.MirroredStrategy`, its CNN, `compile`/`fit` with its
   callbacks but TensorBoard, `evaluate`, `save` and reload), on Keras 3
   with the JAX
   backend: scikit-learn's digits instead of MNIST, the Keras 3 spellings of
   its checkpoint and save paths.
2. Keras's guide "Distributed training with Keras 3": its DataParallel and
   ModelParallel parts (the LayoutMap's `d1/kernel`, `d1/bias` and
   `d2/output` keys).

Each program is written once, as its original, taking the strategy; the
original's own run is the same function with `ONE_DEVICE`, what it computes
with no distribution at all. Small data and few steps; the optimizers are
plain SGD, so that the comparison is of the training and not of an
optimizer's sensitivity to rounding.
"""

import contextlib
import os

import jax
import numpy as np
import pytest

import jdist

keras = pytest.importorskip("keras")
from keras import layers  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy:DeprecationWarning")


class _NoDistribution:
  """The programs' original, undistributed run: one replica, no scope."""

  num_replicas_in_sync = 1

  def scope(self):
    return contextlib.nullcontext()


ONE_DEVICE = _NoDistribution()


@pytest.fixture(autouse=True)
def fresh_keras():
  """Each run starts from the program's own seed, with no distribution."""
  keras.distribution.set_distribution(None)
  yield
  keras.distribution.set_distribution(None)


# --- 1. TensorFlow's "Distributed training with Keras" ---------------------


def distributed_training_with_keras(strategy, workdir, digits,
                                    BATCH_SIZE_PER_REPLICA):
  """The tutorial, top to bottom (its strategy line is the argument)."""
  keras.utils.set_random_seed(0)
  print(f"Number of devices: {strategy.num_replicas_in_sync}")

  images, labels = digits
  mnist_train = (images[:960], labels[:960])
  mnist_test = (images[1600:1792], labels[1600:1792])

  BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

  with strategy.scope():
    model = keras.Sequential([
        layers.Input(shape=(8, 8, 1)),  # Keras 3's spelling of input_shape=
        layers.Conv2D(32, 3, activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(10),
    ])
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(),
        metrics=["accuracy"])

  checkpoint_dir = os.path.join(workdir, "training_checkpoints")
  checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")

  def decay(epoch):
    if epoch < 3:
      return 1e-1
    elif epoch >= 3 and epoch < 7:
      return 1e-2
    else:
      return 1e-3

  class PrintLR(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
      print(f"\nLearning rate for epoch {epoch + 1} is "
            f"{model.optimizer.learning_rate.numpy()}")

  # The tutorial's first callback, keras.callbacks.TensorBoard, writes
  # through the tensorboard package, which jdist's test environment does
  # not install; the others are the tutorial's.
  callbacks = [
      keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix,
                                      save_weights_only=True),
      keras.callbacks.LearningRateScheduler(decay),
      PrintLR(),
  ]
  EPOCHS = 2
  history = model.fit(*mnist_train, batch_size=BATCH_SIZE, epochs=EPOCHS,
                      shuffle=False, callbacks=callbacks)

  model.load_weights(checkpoint_prefix.format(epoch=EPOCHS))
  eval_loss, eval_acc = model.evaluate(*mnist_test, batch_size=BATCH_SIZE)
  print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")

  path = os.path.join(workdir, "my_model.keras")
  model.save(path)
  unreplicated_model = keras.models.load_model(path)
  unreplicated_model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=keras.optimizers.SGD(), metrics=["accuracy"])
  unreplicated = unreplicated_model.evaluate(*mnist_test,
                                             batch_size=BATCH_SIZE)
  with strategy.scope():
    replicated_model = keras.models.load_model(path)
    replicated_model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(), metrics=["accuracy"])
    replicated = replicated_model.evaluate(*mnist_test, batch_size=BATCH_SIZE)
  return (model, history.history, (eval_loss, eval_acc), unreplicated,
          replicated)


def test_tensorflows_keras_tutorial_on_two_replicas_equals_one_device(
    digits, tmp_path, capsys):
  """30 SGD steps (2 epochs of 15 batches of 64), its callbacks included:
  the same weights, history and evaluations as one device; the trained
  model saved and reloaded evaluates the same, in the scope or out."""
  one = distributed_training_with_keras(ONE_DEVICE, str(tmp_path / "one"),
                                        digits, BATCH_SIZE_PER_REPLICA=64)
  strategy = jdist.MirroredStrategy(jax.devices()[:2])
  two = distributed_training_with_keras(strategy, str(tmp_path / "two"),
                                        digits, BATCH_SIZE_PER_REPLICA=32)
  assert "Number of devices: 2" in capsys.readouterr().out
  for a, b in zip(one[0].get_weights(), two[0].get_weights()):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for key in one[1]:
    np.testing.assert_allclose(one[1][key], two[1][key], rtol=1e-5)
  np.testing.assert_allclose(one[2:], two[2:], rtol=1e-5)
  assert two[2] == pytest.approx(two[3], rel=1e-6) == two[4]
  assert sorted(os.listdir(tmp_path / "two" / "training_checkpoints")) == [
      "ckpt_1.weights.h5", "ckpt_2.weights.h5"]
  # The 2 replicas' program ran data-parallel on them.
  kernel = two[0].layers[0].kernel.value
  assert set(kernel.sharding.device_set) == set(strategy.devices)


# --- 2. Keras's "Distributed training with Keras 3" ------------------------


def keras_distribution_guide(data_parallel, model_parallel):
  """The guide's DataParallel and ModelParallel parts (their distribution
  lines are the arguments; each is a scope around the code it governs)."""
  keras.utils.set_random_seed(0)
  inputs = np.random.normal(size=(160, 28, 28, 1))
  labels = np.random.normal(size=(160, 10))

  with data_parallel.scope():
    inputs_ = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs_)
    y = layers.Dense(units=200, use_bias=False, activation="relu")(y)
    y = layers.Dropout(0.4)(y)
    y = layers.Dense(units=10, activation="softmax")(y)
    model = keras.Model(inputs=inputs_, outputs=y)

    model.compile(loss="mse", optimizer="sgd")
    model.fit(inputs, labels, batch_size=16, epochs=3, shuffle=False)
    dp = (model.get_weights(), model.evaluate(inputs, labels, batch_size=16))

  with model_parallel.scope():
    inputs_ = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs_)
    y = layers.Dense(units=200, use_bias=False, activation="relu",
                     name="d1")(y)
    y = layers.Dropout(0.4)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    model = keras.Model(inputs=inputs_, outputs=y)

    # The data will be sharded across the "data" dimension of the mesh.
    model.compile(loss="mse", optimizer="sgd")
    model.fit(inputs, labels, batch_size=16, epochs=3, shuffle=False)
    mp = (model.get_weights(), model.evaluate(inputs, labels, batch_size=16),
          getattr(model.get_layer("d1").kernel.value.sharding, "spec", None))
  return dp, mp


def test_keras_distribution_guide_with_jdist_strategies_equals_one_device():
  """30 SGD steps each (Dropout on): jdist's MirroredStrategy in place of
  DataParallel and a ModelParallelStrategy with the guide's LayoutMap in
  place of ModelParallel train as one device; d1's kernel is split."""
  one = keras_distribution_guide(ONE_DEVICE, ONE_DEVICE)

  devices = jax.devices()[:4]
  data_parallel = jdist.MirroredStrategy(devices)
  mesh_2d = jdist.DeviceMesh((2, 2), ("data", "model"), devices=devices)
  layout_map = jdist.LayoutMap(mesh_2d)
  layout_map["d1/kernel"] = (None, "model")
  layout_map["d1/bias"] = ("model",)
  layout_map["d2/output"] = ("data", None)
  model_parallel = jdist.ModelParallelStrategy(layout_map=layout_map,
                                               batch_dim_name="data")
  ported = keras_distribution_guide(data_parallel, model_parallel)

  for (w1, loss1), (w2, loss2) in zip((one[0], one[1][:2]),
                                      (ported[0], ported[1][:2])):
    for a, b in zip(w1, w2):
      np.testing.assert_allclose(a, b, atol=1e-5)
    assert loss2 == pytest.approx(loss1, rel=1e-5)
  assert ported[1][2] == jax.sharding.PartitionSpec(None, "model")
