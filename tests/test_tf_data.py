"""A tf.data pipeline as the Trainer's data, the way a Keras user passes it.

TensorFlow is a test dependency only: jdist recognises a `tf.data.Dataset`
by its methods and never imports TensorFlow.
"""

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import Interrupt, strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)
N = 320  # 5 batches of 64
tf = None  # TensorFlow, imported by the first test (_tensorflow)


@pytest.fixture(scope="module", autouse=True)
def _tensorflow():
  """Imports TensorFlow when this module's tests run, not when pytest
  collects them: each pytest worker collects every module, and only one runs
  these tests (TensorFlow takes seconds to import)."""
  global tf
  import tensorflow
  tf = tensorflow


def trainer_on(n):
  # SGD with momentum: a gradient of the wrong scale shows in the momentum.
  return jdist.Trainer(MLP(), optimizer=optax.sgd(0.1, momentum=0.9),
                       loss=LOSS, metrics=["accuracy"], strategy=strategy_on(n))


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return x[:N], y[:N]


def pipeline(x, y, *, reshuffle=False):
  return (tf.data.Dataset.from_tensor_slices((x, y))
          .shuffle(N, seed=7, reshuffle_each_iteration=reshuffle)
          .map(lambda a, b: (2.0 * a - 1.0, b))
          .batch(64))


def as_arrays(dataset):
  """The dataset's batches of one pass, concatenated in their order."""
  batches = list(dataset.as_numpy_iterator())
  return tuple(np.concatenate(part) for part in zip(*batches))


def assert_same(h1, h2, t1, t2, rtol=1e-5):
  assert h1.epoch == h2.epoch and sorted(h1.history) == sorted(h2.history)
  for key in h1.history:
    np.testing.assert_allclose(h1.history[key], h2.history[key], rtol=rtol,
                               err_msg=key)
  for a, b in zip(*(jax_leaves(t) for t in (t1, t2))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def jax_leaves(trainer):
  return jax.tree.leaves((trainer.params, trainer.state.opt_state))


def test_fit_evaluate_predict_on_a_dataset_equal_the_same_batches_as_arrays(
    data):
  """2 replicas reading the pipeline train as 1 device on its arrays."""
  dataset = pipeline(*data)  # shuffled once, the same order every pass
  x, y = as_arrays(dataset)
  assert not np.array_equal(y, data[1])  # the shuffle did reorder
  on_arrays = trainer_on(1)
  h1 = on_arrays.fit(x, y, batch_size=64, epochs=2, shuffle=False,
                     validation_data=(x[:128], y[:128]), verbose=0)
  on_dataset = trainer_on(2)
  h2 = on_dataset.fit(dataset, epochs=2, validation_data=dataset.take(2),
                      verbose=0)
  assert on_dataset.global_step == 2 * 5
  assert h2.history["loss"][-1] < h2.history["loss"][0]
  assert_same(h1, h2, on_arrays, on_dataset)

  expected = on_arrays.evaluate(x, y, batch_size=64)
  got = on_dataset.evaluate(dataset)
  assert sorted(got) == ["accuracy", "loss"]
  for key in expected:
    np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)
  want = on_arrays.predict(x, batch_size=64)
  for inputs in (dataset, dataset.map(lambda a, b: a)):  # y is ignored
    np.testing.assert_allclose(on_dataset.predict(inputs), want, rtol=1e-4,
                               atol=1e-5)


def test_a_reshuffling_dataset_gives_every_epoch_its_order(data):
  """Each epoch is a new pass, as in Keras: epoch e trains on the dataset's
  e-th pass (and no pass is spent elsewhere)."""
  passes = pipeline(*data, reshuffle=True)  # an identical twin to read
  epochs = [list(passes.as_numpy_iterator()) for _ in range(2)]
  orders = [np.concatenate([b[1] for b in e]) for e in epochs]
  assert not np.array_equal(orders[0], orders[1])

  def replay():
    for epoch in epochs:
      yield from epoch
  expected = trainer_on(2)
  h1 = expected.fit(replay(), epochs=2, steps_per_epoch=5, verbose=0)
  trainer = trainer_on(2)
  h2 = trainer.fit(pipeline(*data, reshuffle=True), epochs=2, verbose=0)
  assert_same(h1, h2, expected, trainer, rtol=1e-6)


def test_a_resumed_fit_reads_the_pass_the_interrupted_one_read(data,
                                                               tmp_path):
  """BackupAndRestore in a new process's fit (a new dataset object):
  epoch 1 resumes in the reshuffled order it had, not the first pass's."""
  reference = trainer_on(2)
  h_ref = reference.fit(pipeline(*data, reshuffle=True), epochs=2, verbose=0)
  with pytest.raises(KeyboardInterrupt):
    trainer_on(2).fit(pipeline(*data, reshuffle=True), epochs=2, verbose=0,
                      callbacks=[Interrupt(8),
                                 jdist.BackupAndRestore(tmp_path, save_freq=3)])
  backup = jdist.BackupAndRestore(tmp_path, save_freq=3)
  trainer = trainer_on(2)
  history = trainer.fit(pipeline(*data, reshuffle=True), epochs=2, verbose=0,
                        callbacks=[backup])
  assert backup.restored_step == 6  # epoch 1, after its first batch
  assert_same(h_ref, history, reference, trainer, rtol=1e-6)


def test_weights_and_dict_batches(data):
  x, y = data
  w = np.linspace(0.5, 2.0, N).astype(np.float32)
  expected = trainer_on(2).fit(x, y, sample_weight=w, batch_size=64,
                               shuffle=False, verbose=0)
  as_tuples = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(64)
  as_dicts = tf.data.Dataset.from_tensor_slices(
      {"x": x, "y": y, "sample_weight": w}).batch(64)
  for dataset in (as_tuples, as_dicts):
    h = trainer_on(2).fit(dataset, verbose=0)
    np.testing.assert_allclose(h.history["loss"], expected.history["loss"],
                               rtol=1e-5)


def test_a_dataset_that_repeats_forever_needs_steps_and_continues(data):
  """As in Keras: steps_per_epoch batches per epoch, each epoch continuing
  where the last ended."""
  dataset = pipeline(*data).repeat()
  with pytest.raises(ValueError, match="repeats forever.*steps_per_epoch="):
    trainer_on(2).fit(dataset, verbose=0)
  with pytest.raises(ValueError, match="repeats forever.*validation_steps="):
    trainer_on(2).fit(pipeline(*data), validation_data=dataset, verbose=0)
  batches = list(pipeline(*data).as_numpy_iterator())
  order = batches[:5] + batches[:1]  # epoch 1 is batches 3, 4, 0
  expected = trainer_on(2).fit(iter(order), epochs=2, steps_per_epoch=3,
                               verbose=0)
  trainer = trainer_on(2)
  got = trainer.fit(dataset, epochs=2, steps_per_epoch=3, verbose=0)
  np.testing.assert_allclose(got.history["loss"], expected.history["loss"],
                             rtol=1e-6)
  evaluated = trainer.evaluate(dataset, steps=2)  # its first 2 batches
  want = trainer.evaluate(batches[:2])
  np.testing.assert_allclose(evaluated["loss"], want["loss"], rtol=1e-6)
  assert trainer.predict(dataset, steps=2).shape == (128, 10)


def test_batch_size_with_a_dataset_is_a_clear_error(data):
  trainer = trainer_on(2)
  dataset = pipeline(*data)
  message = "batch_size=64 was given with a tf.data.Dataset.*batch_size=None"
  with pytest.raises(ValueError, match=message):
    trainer.fit(dataset, batch_size=64, verbose=0)
  with pytest.raises(ValueError, match=message):
    trainer.evaluate(dataset, batch_size=64)
  with pytest.raises(ValueError, match=message):
    trainer.predict(dataset, batch_size=64)


def test_experimental_distribute_dataset_reads_each_pass_again(data):
  """A custom loop's distributed dataset: every pass is a new pass over the
  pipeline (so it reshuffles), each replica gets its rows of the batch."""
  strategy = strategy_on(2)
  dist = strategy.experimental_distribute_dataset(
      pipeline(*data, reshuffle=True))
  twin = pipeline(*data, reshuffle=True)
  orders = []
  for _ in range(2):
    got = [np.asarray(strategy.gather(labels, axis=0))
           for _, labels in dist]
    want = [labels for _, labels in twin.as_numpy_iterator()]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
    orders.append(np.concatenate(got))
  assert not np.array_equal(*orders)
