"""Keras and tf.distribute habits that must either work as there or fail
clearly: the calls a TF tutorial or a Keras program makes, as it makes them."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

from conftest import strategy_on


def test_scale_regularization_loss_of_a_list_is_tfs_scalar():
  """TF: sum of the list, reduced to a scalar, over the replica count."""
  strategy = strategy_on(4)
  out = strategy.run(lambda: jdist.scale_regularization_loss([2.5, 6.2, 5.0]))
  assert out.shape == ()  # the same on every replica: one mirrored scalar
  assert float(out) == pytest.approx(13.7 / 4)
  per_replica = strategy.run(lambda: jdist.scale_regularization_loss(
      jnp.float32(jdist.get_replica_context().replica_id_in_sync_group)))
  assert float(strategy.reduce("sum", per_replica)) == pytest.approx(1.5)
  assert float(jdist.scale_regularization_loss(jnp.array([1.0, 2.0]))) == 3.0


@pytest.mark.parametrize("make", [jdist.BackupAndRestore, jdist.ModelCheckpoint])
def test_checkpoint_callbacks_refuse_an_empty_directory(make):
  with pytest.raises(ValueError, match="needs a directory"):
    make("")


# --- losses in Keras' order and meaning (issue 9.4) -------------------------

import optax  # noqa: E402
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

from jdist.examples.models import CNN, MLP  # noqa: E402


class SoftmaxMLP(nn.Module):
  """The seed MLP ending in a softmax, as many Keras models do."""

  @nn.compact
  def __call__(self, x):
    return nn.softmax(MLP()(x))


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return x[:256], y[:256], x[1500:1600], y[1500:1600]


def _fit(model, loss, data, n=2, **kwargs):
  x, y, _, _ = data
  trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), loss=loss,
                          strategy=strategy_on(n), **kwargs)
  return trainer, trainer.fit(x, y, batch_size=64, epochs=2, verbose=0)


def test_string_losses_take_probabilities_and_objects_take_from_logits(data):
  """A softmax model with Keras' string loss trains as the logits model with
  from_logits=True does; a function loss is called as loss(y_true, y_pred)."""
  init = MLP().init(jax.random.key(0), data[0][:1])
  _, probs = _fit(SoftmaxMLP(), "sparse_categorical_crossentropy", data,
                  params={"params": {"MLP_0": init["params"]}})
  _, logits = _fit(MLP(), jdist.losses.SparseCategoricalCrossentropy(
      from_logits=True), data, params=init)

  def keras_order(y_true, y_pred):
    return optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true)

  _, function = _fit(MLP(), keras_order, data, params=init)
  np.testing.assert_allclose(probs.history["loss"], logits.history["loss"],
                             rtol=1e-4)
  np.testing.assert_allclose(function.history["loss"], logits.history["loss"],
                             rtol=1e-6)


@pytest.mark.parametrize("model,loss,match", [
    (MLP(), "sparse_categorical_crossentropy",
     r"expects probabilities.*range from -.*look like logits.*"
     r"SparseCategoricalCrossentropy\(from_logits=True\)"),
    (SoftmaxMLP(), jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
     r"from_logits=True.*are probabilities.*softmax already ran.*"
     r"from_logits=False"),
], ids=["logits_under_probabilities", "probabilities_under_logits"])
def test_the_from_logits_mix_up_fails_before_any_step(model, loss, match, data):
  x, y, _, _ = data
  trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), loss=loss,
                          strategy=strategy_on(2))
  with pytest.raises(ValueError, match=match):
    trainer.fit(x, y, batch_size=64, verbose=0)
  assert int(trainer.state.step) == 0


def test_a_loss_in_the_old_order_is_named(data):
  x, y, _, _ = data

  def old_order(y_pred, y_true):
    return optax.softmax_cross_entropy_with_integer_labels(y_pred, y_true)

  trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), loss=old_order,
                          strategy=strategy_on(2))
  with pytest.raises(ValueError, match=r"loss\(y_true, y_pred\).*swap"):
    trainer.fit(x, y, batch_size=64, verbose=0)


def test_keras_default_reduction_is_refused_inside_a_step():
  strategy = strategy_on(2)
  loss = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)
  batch, = strategy.experimental_distribute_dataset(
      [(np.zeros(4, np.int32), np.zeros((4, 3), np.float32))])
  with pytest.raises(ValueError, match=r"reduction='none'.*compute_average_loss"):
    strategy.run(lambda b: loss(b[0], b[1]), args=(batch,))
  per_example = jdist.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none")
  out = strategy.run(lambda b: jdist.compute_average_loss(
      per_example(b[0], b[1])), args=(batch,))
  assert float(strategy.reduce("sum", out)) == pytest.approx(np.log(3))


# --- BatchNorm under the trainer (issue 9.5) --------------------------------


def test_linen_batch_norm_without_axis_name_evaluates_as_on_one_device(digits):
  x, y = digits
  results = []
  for n in (1, 4):
    trainer = jdist.Trainer(
        CNN(batch_norm=True), optimizer=optax.sgd(0.05), strategy=strategy_on(n),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    trainer.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0)
    results.append(trainer.evaluate(x[1500:1600], y[1500:1600], batch_size=64))
  assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-4)
  assert results[1]["accuracy"] == results[0]["accuracy"]


class LocalStats(nnx.Module):
  """A layer keeping its own running mean of the batch (not flax's BatchNorm)."""

  def __init__(self, rngs):
    self.dense = nnx.Linear(64, 10, rngs=rngs)
    self.seen = nnx.BatchStat(jnp.zeros(64))

  def __call__(self, x):
    self.seen[...] = jnp.mean(x, axis=0)
    return self.dense(x)


def test_other_varying_model_state_is_averaged_over_replicas(data):
  """TF's sync-on-read MEAN: a custom statistic gets the replicas' mean."""
  x, y, _, _ = data
  model = LocalStats(nnx.Rngs(0))
  trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), strategy=strategy_on(4),
                          loss=jdist.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
  trainer.fit(x[:64], y[:64], batch_size=64, shuffle=False, verbose=0)
  np.testing.assert_allclose(model.seen[...], x[:64].mean(0), rtol=1e-5,
                             atol=1e-6)


# --- flax's nnx conventions in the trainer (issue 9.7) ----------------------

from test_loss_scaling import CNN as MnistCNN  # noqa: E402


def test_flax_mnist_model_with_rngs_trains_under_the_trainer(digits):
  """flax's MNIST model (`__call__(self, x, rngs)`, BatchNorm, nnx Dropout)
  on 2 replicas: it learns, its dropout draws from the trainer's seed, and
  evaluation runs it without dropout. (nnx's Dropout draws the same mask on
  every replica, so its training depends on the device count: each fit
  warns so, once, naming jdist.dropout; docs/limitations.md. That is why
  this is not compared with one device.)"""
  x, y = digits
  runs = {}
  for seed in (0, 0, 1):
    model = MnistCNN(nnx.Rngs(0))  # the same initial weights each time
    trainer = jdist.Trainer(
        model, optimizer=optax.sgd(0.05, 0.9), strategy=strategy_on(2),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], seed=seed)
    with pytest.warns(UserWarning, match="same on every replica") as warned:
      history = trainer.fit(x[:256], y[:256], batch_size=64, epochs=2,
                            verbose=0)
    assert len(warned) == 1 and "jdist.dropout" in str(warned[0].message)
    runs.setdefault(seed, []).append((history.history, trainer.params,
                                      trainer.evaluate(x[1500:1600],
                                                       y[1500:1600])))
  (h0, p0, e0), (h0_again, p0_again, e0_again) = runs[0]
  _, p1, _ = runs[1][0]
  assert h0["loss"][1] < h0["loss"][0]
  assert h0 == h0_again and e0 == e0_again  # the seed decides the masks
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p0_again)):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))  # dropout was on


class NeedsLabels(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x, labels):
    return self.dense(x)


def test_a_call_signature_the_trainer_cannot_fill_is_not_called_a_shape(data):
  x, y, _, _ = data
  trainer = jdist.Trainer(NeedsLabels(nnx.Rngs(0)), optimizer=optax.sgd(0.1),
                          loss=jdist.losses.SparseCategoricalCrossentropy(
                              from_logits=True), strategy=strategy_on(2))
  with pytest.raises(TypeError, match=r"calls the model's __call__ as \(x\).*"
                     r"labels.*rngs") as info:
    trainer.fit(x, y, batch_size=64, verbose=0)
  assert "shape" not in str(info.value)


# --- Keras callbacks, devices and strategy options (issue 9.8) --------------


def test_model_checkpoint_fills_keras_templates_and_saves_weights_only(
    data, tmp_path):
  x, y, vx, vy = data
  trainer = jdist.Trainer(
      MLP(), optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], strategy=strategy_on(2))
  template = str(tmp_path / "ckpt_{epoch:02d}_{val_loss:.2f}")
  trainer.fit(x, y, batch_size=64, epochs=2, validation_data=(vx, vy),
              callbacks=[jdist.ModelCheckpoint(template, save_weights_only=True)],
              verbose=0)
  made = sorted(p.name for p in tmp_path.iterdir())
  assert [m[:8] for m in made] == ["ckpt_01_", "ckpt_02_"] and "{" not in made[0]
  fresh = jdist.Trainer(
      MLP(), optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      strategy=strategy_on(2))
  fresh.build(x[:1])
  fresh.load_checkpoint(tmp_path / made[-1])
  for a, b in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(a, b)
  assert fresh.global_step == 0  # weights only: the optimizer did not move
  with pytest.raises(ValueError, match=r"names \['val_acc'\].*accuracy"):
    trainer.fit(x, y, batch_size=64, verbose=0, callbacks=[
        jdist.ModelCheckpoint(str(tmp_path / "c_{val_acc:.2f}"))])


def test_the_tutorials_learning_rate_callback(data, capsys):
  """TF's tutorial prints model.optimizer.learning_rate.numpy() per epoch."""
  x, y, _, _ = data

  class PrintLR(jdist.Callback):
    def on_epoch_end(self, epoch, logs=None):
      print(f"Learning rate for epoch {epoch + 1} is "
            f"{self.model.optimizer.learning_rate.numpy()}")

  trainer = jdist.Trainer(
      MLP(), optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      strategy=strategy_on(2))
  trainer.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[
      PrintLR(), jdist.LearningRateScheduler(lambda epoch: 1e-3 / (epoch + 1))])
  out = capsys.readouterr().out
  printed = re.findall(r"Learning rate for epoch (\d) is (\S+)\n", out)
  assert [(e, round(float(v), 9)) for e, v in printed] == [("1", 1e-3),
                                                           ("2", 5e-4)]
  trainer.optimizer.learning_rate.assign(0.25)
  assert float(trainer.optimizer.learning_rate) == 0.25
  assert trainer.optimizer.iterations == 8


def test_cross_device_ops_are_tfs_classes_or_an_error():
  for ops in (jdist.NcclAllReduce(), jdist.HierarchicalCopyAllReduce(num_packs=2),
              jdist.ReductionToOneDevice()):
    strategy = jdist.MirroredStrategy(cross_device_ops=ops)
    assert strategy.cross_device_ops == ops
  with pytest.raises(TypeError, match=r"'anything' is not one of TensorFlow's.*"
                     r"NcclAllReduce"):
    jdist.MirroredStrategy(cross_device_ops="anything")


def test_tensorflow_device_names():
  full = jdist.MirroredStrategy(["/job:localhost/replica:0/task:0/device:CPU:0",
                                 "/job:localhost/replica:0/task:0/device:CPU:1"])
  assert full == jdist.MirroredStrategy(["cpu:0", "cpu:1"])
  assert jdist.OneDeviceStrategy("/device:CPU:2") == jdist.OneDeviceStrategy(
      "cpu:2")
  with pytest.raises(ValueError, match=r"task 1, but this is process 0"):
    jdist.MirroredStrategy(["/job:worker/replica:0/task:1/device:CPU:0"])


# --- sample and class weights (issue 9.9) -----------------------------------


def _identity_model():
  """Keras' Dense(1, kernel_initializer="ones"): y_pred = x."""
  return dict(model=lambda p, x: x @ p["w"] + p["b"],
              params={"w": jnp.ones((1, 1)), "b": jnp.zeros((1,))})


def test_tfs_sample_weight_evaluation_under_a_strategy():
  x = np.array([[0], [1], [2], [3]], np.float32)
  y = np.array([[2], [4], [6], [8]], np.float32)
  w = np.array([0.25, 0.5, 0.75, 1], np.float32)
  for n in (1, 2):
    spec = _identity_model()
    trainer = jdist.Trainer(spec["model"], params=spec["params"], loss="mse",
                            optimizer=optax.sgd(0.0), strategy=strategy_on(n))
    assert trainer.evaluate(x, y, batch_size=2, sample_weight=w)["loss"] == \
        pytest.approx(10.625)
    assert trainer.evaluate(x, y, batch_size=2)["loss"] == pytest.approx(13.5)
    batches = [(x[:2], y[:2], w[:2]), (x[2:], y[2:], w[2:])]
    assert trainer.evaluate(batches)["loss"] == pytest.approx(10.625)


def test_class_weight_trains_the_same_on_padded_batches(data):
  x, y, _, _ = data
  x, y = x[:200], y[:200]  # 3 batches of 64 and one of 8, padded on 4 devices
  weights = {0: 4.0, 1: 0.5}
  histories = []
  for n in (1, 4):
    trainer = jdist.Trainer(
        MLP(), optimizer=optax.sgd(0.1), strategy=strategy_on(n),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], weighted_metrics={"weighted_acc": "accuracy"})
    histories.append(trainer.fit(x, y, batch_size=64, epochs=2,
                                 class_weight=weights, verbose=0).history)
  for key in ("loss", "accuracy", "weighted_acc"):
    np.testing.assert_allclose(histories[0][key], histories[1][key], rtol=1e-5)
  assert histories[0]["weighted_acc"] != histories[0]["accuracy"]


# --- bad input to the trainer (issue 10, items 8, 9, 10) --------------------


def _trainer(n=4, **kwargs):
  kwargs.setdefault("loss", jdist.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  return jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), strategy=strategy_on(n),
                       metrics=["accuracy"], **kwargs)


def test_data_shorter_than_one_global_batch_is_padded(data):
  x, y, _, _ = data
  trainer = _trainer(4)
  trainer.fit(x[:10], y[:10], batch_size=32, verbose=0)  # one batch of 10
  logits = MLP().apply(trainer.export(), x[:3])
  got = trainer.evaluate(x[:3], y[:3])  # 3 examples over 4 replicas
  want = float(np.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, y[:3])))
  assert got["loss"] == pytest.approx(want, rel=1e-5)
  np.testing.assert_allclose(trainer.predict(x[:2]), logits[:2], rtol=1e-5,
                             atol=1e-6)


def test_a_validation_split_that_cannot_be_evaluated_fails_before_training(data):
  x, y, _, _ = data
  trainer = _trainer(4)
  with pytest.raises(ValueError, match=r"validation data.*cannot split evenly"):
    trainer.fit(x, y, batch_size=64, validation_split=0.5,
                validation_batch_size=30, verbose=0)
  assert trainer.state is None or int(trainer.state.step) == 0


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(batch_size=0), ValueError, "batch_size must be positive, got 0"),
    (dict(batch_size=-8), ValueError, "batch_size must be positive, got -8"),
    (dict(batch_size=64, epochs=-3), ValueError, "epochs must be at least 0"),
    (dict(batch_size=64, steps_per_epoch=0), ValueError, "positive number"),
])
def test_bad_fit_arguments(kwargs, error, match, data):
  x, y, _, _ = data
  with pytest.raises(error, match=match):
    _trainer(2).fit(x, y, verbose=0, **kwargs)


def test_metrics_given_as_one_string(data):
  x, y, _, _ = data
  trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), metrics="accuracy",
                          loss=jdist.losses.SparseCategoricalCrossentropy(
                              from_logits=True), strategy=strategy_on(2))
  assert sorted(trainer.evaluate(x, y)) == ["accuracy", "loss"]


def test_labels_are_checked_on_the_host_naming_the_example(data):
  x, y, _, _ = data
  floats = y.astype(np.float32)
  floats[7] = 2.5
  with pytest.raises(ValueError, match=r"integer class labels.*example 7 of y.*"
                     r"2\.5.*truncated"):
    _trainer(2).fit(x, floats, batch_size=64, verbose=0)
  _trainer(2).fit(x, y.astype(np.float32), batch_size=64, verbose=0)  # 3.0 is 3
  wrong = y.copy()
  wrong[100] = 10
  with pytest.raises(ValueError, match=r"labels in \[0, 10\).*example 100 of y.*"
                     r"10.*NaN"):
    _trainer(2).fit(x, wrong, batch_size=64, verbose=0)
  batches = [(x[i:i + 64], wrong[i:i + 64]) for i in range(0, 256, 64)]
  with pytest.raises(ValueError, match=r"row 36 of batch 1"):
    _trainer(2).fit(batches, verbose=0)


def test_a_model_without_parameters(data):
  x, y, _, _ = data
  with pytest.raises(ValueError, match="no trainable parameters"):
    jdist.Trainer(lambda p, x: x[:, :10], params={}, optimizer=optax.sgd(0.1),
                  loss="mse", strategy=strategy_on(2)).fit(
                      x, np.zeros((256, 10), np.float32), verbose=0)


def test_data_jdist_cannot_read_is_its_own_error(data):
  x, y, _, _ = data
  with pytest.raises(TypeError, match=r"y\b.*holds <U\d+ values, not numbers.*"
                     r"LabelEncoder"):
    _trainer(2).fit(x[:4], np.array(["cat", "dog", "cat", "dog"]), verbose=0)
  with pytest.raises(TypeError, match=r"Cannot read data from int 42"):
    _trainer(2).fit(42, verbose=0)


def test_reduce_of_another_strategys_value():
  two, four = strategy_on(2), strategy_on(4)
  batch, = two.experimental_distribute_dataset([np.ones((4, 2))])
  out = two.run(lambda x: x * 2, args=(batch,))
  for call in (lambda: four.reduce("sum", out, axis=0), lambda: four.gather(out),
               lambda: jdist.MirroredStrategy(["cpu:2", "cpu:3"]).reduce(
                   "sum", out)):
    with pytest.raises(jdist.StrategyMismatchError,
                       match=r"replicas live on \[cpu:0, cpu:1\]"):
      call()
