"""`Trainer(..., gradient_accumulation_steps=K)` with Keras 3's meaning.

`batch_size` is the micro-batch: K consecutive batches make one optimizer
step on K x batch_size examples. Written as a user writes it and compared
with one device training on the K-times-larger batch (SGD with momentum, which
a wrong gradient scale cannot hide behind).
"""

import os

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import Interrupt, strategy_on
from test_accumulation import _all_reduces

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def data(digits_flat):
  # 312 examples: 20 batches of 16 (the last one of 8, padded) make 5 groups
  # of 4, the same examples as 5 batches of 64 (the last one of 56).
  x, y = digits_flat
  return x[:312], y[:312]


def make(n=1, k=4, **kwargs):
  return jdist.Trainer(MLP(), optimizer=optax.sgd(0.1, momentum=0.9),
                       loss=LOSS, metrics=["accuracy"], strategy=strategy_on(n),
                       gradient_accumulation_steps=k, **kwargs)


def assert_same(a, b, tol=1e-6):
  (ta, ha), (tb, hb) = a, b
  assert ta.global_step == tb.global_step
  for key in ha.history:
    np.testing.assert_allclose(ha.history[key], hb.history[key], rtol=tol,
                               atol=tol, err_msg=key)
  sa = jax.device_get((ta.state.params, ta.state.opt_state))
  sb = jax.device_get((tb.state.params, tb.state.opt_state))
  for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def fit(trainer, data, batch_size=16, **kwargs):
  x, y = data
  history = trainer.fit(x, y, batch_size=batch_size, epochs=2, verbose=0,
                        **kwargs)
  return trainer, history


@pytest.fixture(scope="module")
def big_batch(data):
  """One device, batches of 64, no accumulation: the reference."""
  return fit(make(1, 1), data, batch_size=64)


def test_four_batches_of_16_train_as_one_batch_of_64(data, big_batch):
  run = fit(make(1, 4), data)
  assert_same(run, big_batch)
  trainer, history = run
  assert trainer.global_step == 10  # 20 batches an epoch: 5 optimizer steps
  assert trainer.optimizer.iterations == 10
  assert history.history["loss"][1] < history.history["loss"][0]


@pytest.mark.parametrize("kwargs", [{}, {"shard_optimizer_state": True},
                                    {"micro_batches": 2}])
def test_four_devices_equal_one_device(data, big_batch, kwargs):
  assert_same(fit(make(4, 4, **kwargs), data), big_batch)


def test_callbacks_count_batches_and_calls_hold_whole_groups(data, big_batch):
  ends, params = [], []

  class Spy(jdist.Callback):
    def on_train_begin(self, logs=None):
      params.append(self.params["steps"])

    def on_train_batch_end(self, batch, logs=None):
      ends.append((batch, self.model.global_step))

  run = fit(make(2, 4, steps_per_execution=8), data, callbacks=[Spy()])
  assert_same(run, big_batch)
  assert params == [20]
  # As Keras: once per call, the index of its last batch; two optimizer
  # steps a call, and the epoch's last call holds one group.
  assert ends == [(7, 2), (15, 4), (19, 5), (7, 7), (15, 9), (19, 10)]
  with pytest.raises(ValueError, match="steps_per_execution=6 is not a "
                     "multiple of gradient_accumulation_steps=4"):
    make(1, 4, steps_per_execution=6)


def test_a_trailing_partial_group_fails_before_the_first_step(digits_flat):
  x, y = digits_flat
  trainer = make(1, 4)
  # 360 examples are 23 batches of 16.
  with pytest.raises(ValueError, match=r"23 batches.*steps_per_epoch=20"):
    trainer.fit(x[:360], y[:360], batch_size=16, verbose=0)
  assert trainer.global_step == 0
  trainer.fit(x[:360], y[:360], batch_size=16, steps_per_epoch=20, verbose=0)
  assert trainer.global_step == 5
  # Over two epochs the second continues through the data (as Keras's do)
  # and stops at its end after 3 batches: refused before its first step.
  with pytest.raises(ValueError, match=r"stops there after 3 batches"):
    trainer.fit(x[:360], y[:360], batch_size=16, steps_per_epoch=20,
                epochs=2, verbose=0)
  assert trainer.global_step == 5


def test_data_of_unknown_length_ending_mid_group_fails_loudly(data):
  x, y = data

  def six_batches():
    for i in range(6):
      yield x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)]

  trainer = make(1, 4)
  with pytest.raises(ValueError, match=r"ended after 6 batches.*last 2"):
    trainer.fit(six_batches(), verbose=0)
  assert trainer.global_step == 1  # the whole group before stays applied


def test_backup_and_restore_resumes_between_groups_exactly(data, big_batch,
                                                          tmp_path):
  def run(callbacks):
    return fit(make(2, 4), data, callbacks=callbacks)

  # save_freq counts batches, as Keras's: every 8 batches is every second
  # optimizer step. Killed after step 7 (batch 7 of epoch 2).
  with pytest.raises(KeyboardInterrupt):
    run([Interrupt(7), jdist.BackupAndRestore(tmp_path, save_freq=8)])
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [4, 6]
  backup = jdist.BackupAndRestore(tmp_path, save_freq=8)
  resumed = run([backup])
  assert backup.restored_step == 6
  assert_same(resumed, big_batch)  # as if never interrupted
  # A backup from a run without accumulation, saved after batch 5.
  other = tmp_path / "other"
  with pytest.raises(KeyboardInterrupt):
    fit(make(2, 1), data,
        callbacks=[jdist.BackupAndRestore(other, save_freq=5), Interrupt(5)])
  with pytest.raises(ValueError, match="after batch 5 of epoch 1, inside a "
                     "group of gradient_accumulation_steps=4"):
    run([jdist.BackupAndRestore(other)])


def test_an_overflow_in_one_batch_skips_the_whole_group(data):
  """mixed_float16: a batch whose gradient is not finite skips its group's
  optimizer step; the other groups train as without that group."""
  x, y = data
  x, y = x[:256], y[:256]
  bad = x.copy()
  bad[5 * 16 + 3] = 1e6  # batch 5 (group 1) overflows float16
  keep = np.r_[0:64, 128:256]  # the data without group 1

  def run(x, y):
    # A scale low enough that no finite batch overflows: only the bad one.
    trainer = jdist.Trainer(
        MLP(), optimizer=jdist.loss_scale_optimizer(
            optax.sgd(0.1, momentum=0.9), initial_scale=64.0),
        loss=LOSS, dtype_policy="mixed_float16", gradient_accumulation_steps=4)
    history = trainer.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    return trainer, history.history

  with pytest.warns(UserWarning, match="loss of epoch 1"):
    with_bad, h_bad = run(bad, y)
  without, h = run(x[keep], y[keep])
  assert h_bad["skipped_steps"] == [1.0] and h["skipped_steps"] == [0.0]
  assert h_bad["loss_scale"] == [32.0]
  assert with_bad.global_step == 4 and without.global_step == 3
  for a, b in zip(jax.tree.leaves(with_bad.params),
                  jax.tree.leaves(without.params)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_one_all_reduce_per_optimizer_step_of_k_batches(data):
  """The compiled call of K batches reduces the gradients once, after the
  loop over its batches: as many all-reduces as one step on one batch."""
  x, y = data
  totals = []

  class Grab(jdist.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      totals.append(self.fit_loop.totals)

  def program(k, batches):
    trainer = make(2, k)
    trainer.fit(x[:64], y[:64], batch_size=64 // k, verbose=0,
                callbacks=[Grab()])
    batches = trainer.strategy.experimental_distribute_dataset(batches)
    item = next(iter(batches.group(k) if k > 1 else batches))
    return jax.jit(trainer.train_function).lower(
        trainer.state, totals[-1], item).compile().as_text()

  whole = [{"x": x[:64], "y": y[:64]}]
  quarters = [{"x": x[i:i + 16], "y": y[i:i + 16]} for i in range(0, 64, 16)]
  plain_total, _ = _all_reduces(program(1, whole))
  total, in_loop = _all_reduces(program(4, quarters))
  assert plain_total >= 1
  assert (total, in_loop) == (plain_total, 0)
