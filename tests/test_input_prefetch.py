"""Input prefetch: `jdist.InputOptions` (TF's names) places batches ahead of
the step, in the loop's thread or a background one, without changing what
the steps compute."""

import collections
import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

from conftest import strategy_on

OPTIONS = {
    "none ahead": jdist.InputOptions(experimental_per_replica_buffer_size=0),
    "3 ahead": jdist.InputOptions(experimental_per_replica_buffer_size=3),
    "thread": jdist.InputOptions(experimental_prefetch_in_thread=True),
    "thread, 3 ahead": jdist.InputOptions(
        experimental_prefetch_in_thread=True,
        experimental_per_replica_buffer_size=3),
}


def data():
  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(7)]
  return batches + [rng.normal(size=(3, 3)).astype(np.float32)]  # padded


@pytest.mark.parametrize("name", list(OPTIONS))
def test_prefetch_keeps_results_and_masks_with_donated_batches(name):
  strategy = strategy_on(2)

  # The step donates its state and its batch (buffers, mask and count):
  # batches placed ahead must not share a buffer with a donated one.
  @strategy.function(donate_argnums=(0, 1))
  def step(w, batch):
    loss = lambda w: jdist.compute_average_loss((batch @ w - 1.0) ** 2)
    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value

  def run(options, group=None):
    dataset = strategy.experimental_distribute_dataset(data(), options)
    w, losses = strategy.replicate(jnp.ones(3)), []
    if group:
      multi = jdist.multi_step(step)
      for g in dataset.group(group):
        w, loss = multi(w, g)
        losses.extend(np.asarray(strategy.reduce("sum", loss)).tolist())
    else:
      for batch in dataset:
        w, loss = step(w, batch)
        losses.append(float(strategy.reduce("sum", loss)))
    return np.asarray(w), losses

  w, losses = run(None)
  assert len(losses) == 8
  for group in (None, 3):
    got_w, got = run(OPTIONS[name], group)
    np.testing.assert_allclose(got, losses, rtol=1e-6)
    np.testing.assert_allclose(got_w, w, rtol=1e-6)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_bad_batch_read_ahead_is_raised_at_that_batch(name):
  """The batches before it are handed out first; the pass ends there."""
  strategy = strategy_on(2)
  batches = [np.ones((4, 2), np.float32)] * 3 + [np.ones((6, 2), np.float32)]
  it = iter(strategy.experimental_distribute_dataset(batches, OPTIONS[name]))
  for _ in range(3):
    next(it)  # the first batches are fine
  with pytest.raises(ValueError, match="may shrink at the end of the data but"):
    next(it)
  assert it.position == 3
  assert list(it) == []


def test_an_abandoned_iterator_stops_its_thread():
  strategy = strategy_on(2)
  endless = ({"x": np.ones((4, 2), np.float32)} for _ in iter(int, 1))
  it = iter(strategy.experimental_distribute_dataset(
      endless, jdist.InputOptions(experimental_prefetch_in_thread=True)))
  next(it)
  name = "jdist-input-prefetch"
  assert any(t.name == name for t in threading.enumerate())
  del it
  gc.collect()
  deadline = time.monotonic() + 10
  while any(t.name == name for t in threading.enumerate()):
    assert time.monotonic() < deadline, "the prefetch thread kept running"
    time.sleep(0.05)


def test_input_options_refuse_what_they_cannot_do():
  with pytest.raises(ValueError, match="0 or more"):
    jdist.InputOptions(experimental_per_replica_buffer_size=-1)
  with pytest.raises(ValueError, match=r"experimental_fetch_to_device=False\) "
                     r"is not supported: only True \(the default\) is"):
    jdist.InputOptions(experimental_fetch_to_device=False)
  with pytest.raises(ValueError, match=r"experimental_fetch_to_device='yes'\) "
                     r"is not supported: only True \(the default\) is"):
    jdist.InputOptions(experimental_fetch_to_device="yes")
  for bad in ("no", 0, 1, None):
    with pytest.raises(TypeError, match=r"experimental_prefetch_in_thread must "
                       r"be True or False, got " + repr(bad)):
      jdist.InputOptions(experimental_prefetch_in_thread=bad)
  with pytest.raises(TypeError, match="jdist.InputOptions"):
    strategy_on(2).experimental_distribute_dataset([], options="fast")


# TensorFlow's tf.distribute.InputOptions, field for field (a namedtuple).
TFInputOptions = collections.namedtuple("InputOptions", [
    "experimental_fetch_to_device", "experimental_replication_mode",
    "experimental_place_dataset_on_device",
    "experimental_per_replica_buffer_size"])


def tf_options(fetch=None, mode="PER_WORKER", on_device=False, size=1):
  return TFInputOptions(fetch, mode, on_device, size)


def test_tensorflow_options_keep_their_meaning():
  strategy = strategy_on(2)
  reads = []
  source = CountingSource(reads)
  # TF's buffer size 0 turns placing ahead off: each batch is read when asked.
  it = iter(strategy.experimental_distribute_dataset(source, tf_options(size=0)))
  for k in range(1, 4):
    next(it)
    assert len(reads) == k
  assert jdist.InputOptions.of(tf_options()) == jdist.InputOptions()
  assert jdist.InputOptions.of(tf_options(fetch=True, size=3)) == (
      jdist.InputOptions(experimental_per_replica_buffer_size=3))
  with pytest.raises(ValueError, match=r"experimental_fetch_to_device=False\) "
                     r"is not supported"):
    strategy.experimental_distribute_dataset([], tf_options(fetch=False))
  with pytest.raises(ValueError, match=r"replication_mode=PER_REPLICA is not "
                     r"supported.*one input pipeline per process"):
    strategy.experimental_distribute_dataset([], tf_options(mode="PER_REPLICA"))
  with pytest.raises(ValueError, match=r"place_dataset_on_device=True is not "
                     r"supported"):
    strategy.experimental_distribute_dataset([], tf_options(on_device=True))


class CountingSource:
  """An endless source of batches that records each read."""

  def __init__(self, reads):
    self.reads = reads

  def __iter__(self):
    while True:
      self.reads.append(len(self.reads))
      yield np.full((4, 2), len(self.reads), np.float32)


@pytest.mark.parametrize("in_thread", [False, True])
def test_a_deep_buffer_fills_lazily_and_is_bounded(in_thread):
  """Issue 20.5: a buffer of 10**6 over an endless source filled memory
  before the first batch. Now the first batch comes after at most two reads,
  and the buffer never holds more than its (bounded) size."""
  with pytest.raises(ValueError, match=r"buffer_size=1000000 is above jdist's "
                     r"limit of 64 batches: every batch placed ahead holds "
                     r"device memory"):
    jdist.InputOptions(experimental_per_replica_buffer_size=10**6)
  size = 64  # the documented limit
  strategy = strategy_on(2)
  reads = []
  options = jdist.InputOptions(experimental_per_replica_buffer_size=size,
                               experimental_prefetch_in_thread=in_thread)
  it = iter(strategy.experimental_distribute_dataset(CountingSource(reads),
                                                      options))
  first = next(it)
  np.testing.assert_array_equal(strategy.gather(first), np.full((4, 2), 1))
  if not in_thread:
    assert len(reads) == 2  # the batch handed out and one placed ahead
  for k in range(2, 200):
    batch = next(it)
    # Handed out, plus at most `size` placed ahead (and one being read).
    assert k <= len(reads) <= k + size + 1
    assert float(strategy.gather(batch)[0, 0]) == k
