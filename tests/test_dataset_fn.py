"""`distribute_datasets_from_function` as TensorFlow runs it: `dataset_fn`
once per input pipeline, and each pass iterates what it returned again."""

import jax
import numpy as np
import pytest

import jdist

from conftest import strategy_on


class ReshufflingDataset:
  """tf.data's `shuffle(seed=S, reshuffle_each_iteration=True).batch(b)`,
  hand-written: each `iter()` is a new pass with its own seeded order."""

  def __init__(self, rows, batch_size, seed):
    self.rows, self.batch_size, self.seed = rows, batch_size, seed
    self.passes = 0

  def __iter__(self):
    order = np.random.default_rng([self.seed, self.passes]).permutation(
        len(self.rows))
    self.passes += 1
    for i in range(0, len(order), self.batch_size):
      yield self.rows[order[i:i + self.batch_size]]


def tf_order(rows, batch_size, seed, epoch):
  """What TensorFlow's pipeline gives in `epoch`: dataset_fn ran once, and
  the epoch-th iteration of its dataset reshuffled with its own order."""
  order = np.random.default_rng([seed, epoch]).permutation(len(rows))
  return rows[order]


def test_dataset_fn_runs_once_and_each_epoch_reshuffles():
  strategy = strategy_on(4)
  rows = np.arange(40, dtype=np.float32)[:, None]
  calls = []

  def dataset_fn(ctx):
    calls.append(ctx)
    return ReshufflingDataset(rows, ctx.get_per_replica_batch_size(8), seed=7)

  ds = strategy.distribute_datasets_from_function(dataset_fn)
  assert calls == [jdist.InputContext(1, 0, 4)]  # at once, as TF does
  identity = strategy.function(lambda b: b)
  epochs = []
  for _ in range(3):
    seen = [np.asarray(strategy.gather(identity(batch))) for batch in ds]
    epochs.append(np.concatenate(seen))
  assert len(calls) == 1
  for epoch, got in enumerate(epochs):
    # Step j takes the dataset's batches 4j..4j+3, one per replica in order.
    np.testing.assert_array_equal(got, tf_order(rows, 2, 7, epoch))
  assert not np.array_equal(epochs[0], epochs[1])
  assert not np.array_equal(epochs[1], epochs[2])


def test_a_one_shot_iterator_from_dataset_fn_is_an_error_on_the_second_pass():
  strategy = strategy_on(2)
  calls = []

  def dataset_fn(ctx):
    calls.append(ctx)
    return (np.full((2, 1), i, np.float32) for i in range(4))

  ds = strategy.distribute_datasets_from_function(dataset_fn)
  assert len(list(ds)) == 2
  with pytest.raises(ValueError, match=r"dataset_fn returned a one-shot "
                     r"iterator.*once per input pipeline.*re-iterable"):
    iter(ds)
  with pytest.raises(ValueError, match="one-shot"):  # its groups read it too
    iter(ds.group(2))
  assert len(calls) == 1


def test_dataset_fn_must_return_an_iterable():
  with pytest.raises(TypeError, match=r"dataset_fn must return an iterable.*"
                     r"got NoneType"):
    strategy_on(2).distribute_datasets_from_function(lambda ctx: None)


def test_a_seeded_pipeline_trains_each_epoch_on_its_own_order():
  """Training over 2 epochs equals one device fed TF's per-epoch orders."""
  strategy = strategy_on(4)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 3)).astype(np.float32)
  w0 = np.array([0.5, -1.0, 2.0], np.float32)
  ds = strategy.distribute_datasets_from_function(
      lambda ctx: ReshufflingDataset(x, ctx.get_per_replica_batch_size(8),
                                     seed=3))

  def loss(w, batch):
    return jdist.compute_average_loss((batch @ w - 1.0) ** 2)

  @strategy.function
  def step(w, batch):
    return w - 0.1 * jax.grad(loss)(w, batch)

  w = strategy.replicate(w0)
  for _ in range(2):
    for batch in ds:
      w = step(w, batch)
  want = w0
  for epoch in range(2):
    ordered = tf_order(x, 2, 3, epoch)
    for i in range(0, 32, 8):
      b = ordered[i:i + 8]
      want = want - 0.1 * (2 * b.T @ (b @ want - 1.0)) / 8
  np.testing.assert_allclose(np.asarray(w), want, rtol=1e-5)
