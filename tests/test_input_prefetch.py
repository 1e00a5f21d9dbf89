"""Input prefetch: `jdist.InputOptions` (TF's names) places batches ahead of
the step, in the loop's thread or a background one, without changing what
the steps compute."""

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


def test_a_bad_batch_read_in_the_thread_is_raised_in_the_loop():
  strategy = strategy_on(2)
  batches = [np.ones((4, 2), np.float32), np.ones((6, 2), np.float32)]
  it = iter(strategy.experimental_distribute_dataset(
      batches, jdist.InputOptions(experimental_prefetch_in_thread=True)))
  next(it)  # the first batch is fine
  with pytest.raises(ValueError, match="may shrink at the end of the data but"):
    next(it)


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
  with pytest.raises(ValueError, match="experimental_fetch_to_device=False"):
    jdist.InputOptions(experimental_fetch_to_device=False)
  with pytest.raises(TypeError, match="jdist.InputOptions"):
    strategy_on(2).experimental_distribute_dataset([], options="fast")
