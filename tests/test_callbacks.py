"""Callbacks with Keras' names and hooks, driven by jdist.Trainer.fit."""

import csv
import glob
import os
import struct

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return (x[:256], y[:256]), (x[1500:1600], y[1500:1600])


def make_trainer(n=2, optimizer=None):
  return jdist.Trainer(MLP(), optimizer=optimizer or optax.adam(1e-2),
                       loss=LOSS, metrics=["accuracy"], strategy=strategy_on(n))


class Recorder(jdist.Callback):
  def __init__(self):
    super().__init__()
    self.calls = []

  def _record(name):
    def hook(self, *args):
      self.calls.append((name,) + tuple(a for a in args if isinstance(a, int)))
    return hook

  for _name in [n for n in vars(jdist.Callback) if n.startswith("on_")]:
    locals()[_name] = _record(_name)
  del _name


def test_hooks_are_called_in_keras_order(data):
  (x, y), val = data
  rec = Recorder()
  losses = []

  class BatchLoss(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      losses.append(logs["loss"])  # read from the devices on access

  trainer = make_trainer()
  trainer.fit(x[:128], y[:128], batch_size=64, epochs=2, validation_data=val,
              callbacks=[rec, BatchLoss()], verbose=0)
  epoch = [("on_epoch_begin", 0), ("on_train_batch_begin", 0),
           ("on_train_batch_end", 0), ("on_train_batch_begin", 1),
           ("on_train_batch_end", 1), ("on_test_begin",),
           ("on_test_batch_begin", 0), ("on_test_batch_end", 0),
           ("on_test_batch_begin", 1), ("on_test_batch_end", 1),
           ("on_test_end",), ("on_epoch_end", 0)]
  second = [(c[0], 1) if c[0].startswith("on_epoch") else c for c in epoch]
  assert rec.calls == [("on_train_begin",)] + epoch + second + [("on_train_end",)]
  assert rec.params == {"epochs": 2, "steps": 2, "verbose": 0}
  assert rec.model is trainer and rec.trainer is trainer
  assert len(losses) == 4 and all(np.isfinite(losses))

  rec.calls.clear()
  trainer.evaluate(*val, batch_size=64, callbacks=[rec])
  trainer.predict(val[0], batch_size=64, callbacks=[rec])
  assert [c[0] for c in rec.calls] == [
      "on_test_begin", "on_test_batch_begin", "on_test_batch_end",
      "on_test_batch_begin", "on_test_batch_end", "on_test_end",
      "on_predict_begin", "on_predict_batch_begin", "on_predict_batch_end",
      "on_predict_batch_begin", "on_predict_batch_end", "on_predict_end"]


def test_a_callback_can_stop_training(data):
  (x, y), _ = data

  class StopAt(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if self.model.global_step == 3:
        self.model.stop_training = True

  trainer = make_trainer()
  history = trainer.fit(x, y, batch_size=64, epochs=5, callbacks=[StopAt()],
                        verbose=0)
  assert trainer.global_step == 3 and history.epoch == [0]


def test_a_state_a_callback_sets_is_the_one_the_next_step_trains(data):
  # fit carries the state from step to step flat: a state a callback sets
  # in between must be what the next step takes, and what fit ends with.
  (x, y), _ = data

  class Reset(jdist.Callback):
    def on_train_begin(self, logs=None):
      self.first = jax.tree.map(np.asarray, self.model.state)

    def on_train_batch_end(self, batch, logs=None):
      self.steps.append(int(self.model.state.step))  # 1: from the reset
      self.model.state = jax.tree.map(jax.numpy.asarray, self.first)

  trainer, reset = make_trainer(), Reset()
  reset.steps = []
  trainer.fit(x, y, batch_size=64, epochs=2, callbacks=[reset], verbose=0)
  assert reset.steps == [1] * 8 and trainer.global_step == 0
  for a, b in zip(jax.tree.leaves(trainer.state), jax.tree.leaves(reset.first)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_not_a_callback_is_a_clear_error(data):
  (x, y), _ = data
  with pytest.raises(TypeError, match="not a jdist.Callback"):
    make_trainer().fit(x, y, batch_size=64, callbacks=[print], verbose=0)


def test_learning_rate_scheduler(data):
  (x, y), _ = data
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  trainer = make_trainer(optimizer=tx)
  history = trainer.fit(
      x, y, batch_size=64, epochs=3, verbose=0,
      callbacks=[jdist.LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5 ** epoch)])
  np.testing.assert_allclose(history.history["learning_rate"], [0.1, 0.05, 0.025])
  assert trainer.learning_rate == pytest.approx(0.025)

  # The rate really drives the updates: lr 0 leaves the parameters alone.
  before = jax.tree.map(np.asarray, trainer.params)
  trainer.fit(x, y, batch_size=64, epochs=1, verbose=0,
              callbacks=[jdist.LearningRateScheduler(lambda epoch: 0.0)])
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(a, b)


def test_learning_rate_scheduler_needs_an_injectable_optimizer(data):
  (x, y), _ = data
  trainer = make_trainer(optimizer=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"optax.inject_hyperparams"):
    trainer.fit(x, y, batch_size=64, verbose=0,
                callbacks=[jdist.LearningRateScheduler(lambda e, lr: lr)])
  assert trainer.global_step == 0


class Scripted(jdist.Callback):
  """Puts a scripted 'score' into the epoch logs and records the parameters."""

  def __init__(self, scores):
    super().__init__()
    self.scores, self.params_at = scores, []

  def on_epoch_end(self, epoch, logs=None):
    logs["score"] = self.scores[epoch]
    self.params_at.append(jax.tree.map(np.asarray, self.model.params))


def test_early_stopping_with_best_weights(data):
  (x, y), _ = data
  script = Scripted([1.0, 0.5, 0.6, 0.7, 0.8, 0.9])
  stop = jdist.EarlyStopping(monitor="score", patience=2,
                             restore_best_weights=True)
  trainer = make_trainer()
  history = trainer.fit(x, y, batch_size=64, epochs=6, verbose=0,
                        callbacks=[script, stop])
  assert history.epoch == [0, 1, 2, 3]  # best at 1, two epochs without gain
  assert stop.stopped_epoch == 3 and stop.best == 0.5
  for a, b in zip(jax.tree.leaves(script.params_at[1]),
                  jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(a, b)


def test_early_stopping_mode_and_missing_monitor(data):
  (x, y), _ = data
  script = Scripted([0.1, 0.2, 0.3, 0.3])
  stop = jdist.EarlyStopping(monitor="score", mode="max", patience=1)
  history = make_trainer().fit(x, y, batch_size=64, epochs=4, verbose=0,
                               callbacks=[script, stop])
  assert history.epoch == [0, 1, 2, 3]  # kept improving until the last epoch
  with pytest.warns(UserWarning, match="'val_auc', which is not in the logs"):
    make_trainer().fit(x, y, batch_size=64, verbose=0,
                       callbacks=[jdist.EarlyStopping(monitor="val_auc")])


def test_csv_logger(data, tmp_path):
  (x, y), val = data
  path = tmp_path / "log.csv"
  trainer = make_trainer()
  history = trainer.fit(x, y, batch_size=64, epochs=2, validation_data=val,
                        verbose=0, callbacks=[jdist.CSVLogger(path)])
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  assert list(rows[0]) == ["epoch", "accuracy", "loss", "val_accuracy",
                           "val_loss"]
  assert [int(r["epoch"]) for r in rows] == [0, 1]
  for key, values in history.history.items():
    np.testing.assert_allclose([float(r[key]) for r in rows], values)
  trainer.fit(x, y, batch_size=64, epochs=3, initial_epoch=2,
              validation_data=val, verbose=0,
              callbacks=[jdist.CSVLogger(path, append=True)])
  with open(path, newline="") as f:
    assert [int(r["epoch"]) for r in csv.DictReader(f)] == [0, 1, 2]


def read_scalars(directory):
  """{tag: [(step, value)]} from TensorBoard event files (TFRecord framing)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      raw, pos = f.read(), 0
    while pos < len(raw):
      (length,) = struct.unpack("<Q", raw[pos:pos + 8])
      event = event_pb2.Event.FromString(raw[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_tensorboard_scalars_and_profile(data, tmp_path):
  (x, y), val = data
  trainer = make_trainer()
  history = trainer.fit(
      x, y, batch_size=64, epochs=2, validation_data=val, verbose=0,
      callbacks=[jdist.TensorBoard(tmp_path, update_freq=2,
                                   profile_batch=(2, 3))])
  train = read_scalars(tmp_path / "train")
  validation = read_scalars(tmp_path / "validation")
  np.testing.assert_allclose([v for _, v in train["epoch_loss"]],
                             history.history["loss"], rtol=1e-6)
  assert [s for s, _ in train["epoch_accuracy"]] == [0, 1]
  np.testing.assert_allclose([v for _, v in validation["epoch_loss"]],
                             history.history["val_loss"], rtol=1e-6)
  assert [s for s, _ in train["batch_loss"]] == [2, 4, 6, 8]  # global steps
  traces = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


def test_model_checkpoint_best_only_and_load(data, tmp_path):
  (x, y), _ = data
  script = Scripted([0.9, 0.5, 0.7, 0.4])
  ckpt = jdist.ModelCheckpoint(tmp_path, monitor="score", save_best_only=True)
  trainer = make_trainer()
  trainer.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[script, ckpt])
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [4, 8, 16]

  fresh = make_trainer(n=4)
  fresh.build(x[:1])
  assert fresh.load_checkpoint(tmp_path, step=8) == 8
  for a, b in zip(jax.tree.leaves(script.params_at[1]),
                  jax.tree.leaves(fresh.params)):
    np.testing.assert_array_equal(a, b)
  assert fresh.load_checkpoint(tmp_path) == 16  # the newest by default
  np.testing.assert_array_equal(fresh.predict(x, batch_size=64),
                                trainer.predict(x, batch_size=64))


def test_model_checkpoint_takes_keras_arguments(data, tmp_path):
  """Keras 3's call, word for word: filepath=, verbose=, mode=,
  initial_value_threshold= (a score must beat it before any save)."""
  (x, y), _ = data
  script = Scripted([0.9, 0.5, 0.7, 0.4])
  ckpt = jdist.ModelCheckpoint(filepath=str(tmp_path), monitor="score",
                               verbose=0, save_best_only=True,
                               save_weights_only=False, mode="min",
                               save_freq="epoch", initial_value_threshold=0.6)
  make_trainer().fit(x, y, batch_size=64, epochs=4, verbose=0,
                     callbacks=[script, ckpt])
  # 0.9 does not beat 0.6; 0.5 and 0.4 do (epochs 2 and 4: steps 8, 16).
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [8, 16]
  with pytest.raises(TypeError):  # another order's third argument
    jdist.ModelCheckpoint(str(tmp_path), "val_loss", True)
  with pytest.raises(ValueError, match=r"orbax directory.*without the "
                     "extension"):
    jdist.ModelCheckpoint(str(tmp_path / "model_{epoch}.keras"))


def test_model_checkpoint_every_n_steps(data, tmp_path):
  (x, y), _ = data
  trainer = make_trainer()
  trainer.fit(x, y, batch_size=64, epochs=2, verbose=0,
              callbacks=[jdist.ModelCheckpoint(tmp_path, save_freq=3,
                                               max_to_keep=2)])
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [3, 6]


# --- NaN: stop training, and never let a NaN state replace a good checkpoint ---


def poisoned(data, batch=5, batch_size=32):
  """The data with a NaN input in batch `batch` (not shuffled): the loss, the
  gradients and then the parameters become NaN at global step `batch + 1`."""
  (x, y), _ = data
  x = x.copy()
  x[batch * batch_size, 0] = np.nan
  return x, y


def steps_in(directory):
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def test_terminate_on_nan_keeps_the_last_finite_checkpoints(data, tmp_path,
                                                            capsys):
  x, y = poisoned(data)
  ckpt = jdist.ModelCheckpoint(tmp_path, save_freq=2, max_to_keep=2)
  trainer = make_trainer()
  with pytest.warns(UserWarning, match=r"Not saving step 6 to .*: the train state "
                    r"has NaN or infinite values \(in params/.*The newest "
                    r"checkpoint there, step 4, is kept"):
    history = trainer.fit(x, y, batch_size=32, epochs=3, shuffle=False,
                          verbose=0, callbacks=[jdist.TerminateOnNaN(), ckpt])
  # Batch 5 (step 6) made the loss NaN; it is seen at the end of the next one.
  assert "Batch 5: Invalid loss, terminating training" in capsys.readouterr().out
  assert trainer.global_step == 7 and history.epoch == [0]
  assert np.isnan(history.history["loss"][0])
  assert steps_in(tmp_path) == [2, 4]

  clean = make_trainer()  # the same first 4 steps, without the NaN
  clean.fit(x[:128], y[:128], batch_size=32, shuffle=False, verbose=0)
  fresh = make_trainer()
  fresh.build(x[:1])
  assert fresh.load_checkpoint(tmp_path) == 4
  for a, b in zip(jax.tree.leaves(clean.params), jax.tree.leaves(fresh.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_without_terminate_on_nan_rotation_keeps_the_finite_checkpoints(
    data, tmp_path):
  """Once, max_to_keep=2 rotated the last good checkpoints away for NaN ones."""
  x, y = poisoned(data)
  trainer = make_trainer()
  with pytest.warns(UserWarning) as record:
    trainer.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                callbacks=[jdist.ModelCheckpoint(tmp_path, save_freq=2,
                                                 max_to_keep=2)])
  messages = [str(w.message) for w in record]
  assert sum("Not saving step" in m for m in messages) == 6  # 6, 8, ..., 16
  assert any(m.startswith("The training loss of epoch 1 is nan; fit does not "
                          "stop for it. Add jdist.TerminateOnNaN()")
             for m in messages)
  assert trainer.global_step == 16 and steps_in(tmp_path) == [2, 4]


def test_backups_are_kept_when_training_ends_with_nan(data, tmp_path, capsys):
  x, y = poisoned(data)
  with pytest.warns(UserWarning, match="Not saving step 6"):
    make_trainer().fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                       callbacks=[jdist.TerminateOnNaN(),
                                  jdist.BackupAndRestore(tmp_path, save_freq=2)])
  assert steps_in(tmp_path) == [2, 4]  # not deleted: training did not succeed
  assert "the backups in" in capsys.readouterr().err


def test_terminate_on_nan_at_the_last_batch_of_an_epoch(data, capsys):
  x, y = poisoned(data, batch=7)
  trainer = make_trainer()
  history = trainer.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                        callbacks=[jdist.TerminateOnNaN()])
  assert "Epoch 1: Invalid loss, terminating training" in capsys.readouterr().out
  assert trainer.global_step == 8 and history.epoch == [0]
