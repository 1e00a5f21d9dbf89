"""`jdist.diagnose` names where a loop's time goes, as a user calls it."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist


def linear_step(w, batch):
  def loss_fn(w):
    return jdist.compute_average_loss((batch["x"] @ w - batch["y"]) ** 2)
  loss, grad = jax.value_and_grad(loss_fn)(w)
  return w - 0.1 * grad, loss


def linear_batches(n, size=32):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(size, 8)).astype(np.float32),
           "y": rng.normal(size=(size,)).astype(np.float32)} for _ in range(n)]


class SlowReader:
  """A dataset whose every batch takes 20 ms to read (decoding, a disk)."""

  def __init__(self, data):
    self.data = data

  def __iter__(self):
    for batch in self.data:
      time.sleep(0.02)
      yield batch


def test_an_input_bound_loop_is_named_input_bound():
  d = jdist.diagnose(linear_step, jnp.zeros(8), SlowReader(linear_batches(4)),
                     num_replicas=2, steps=4)
  assert d.bottleneck == "input"
  assert d.multi.input_wait > 0.5 * d.multi.step > 0.005
  assert d.single.num_replicas == 1 and d.multi.num_replicas == 2
  assert d.global_batch == 32 and d.steps == 4
  text = str(d)
  assert "Bottleneck on 2 devices: input" in text and "prefetch" in d.fix
  assert "input wait" in text and "collectives" in text
  parts = (d.multi.input_wait + d.multi.compute + d.multi.collectives +
           d.multi.overhead)
  assert parts == pytest.approx(d.multi.step, rel=1e-6)
  with pytest.raises(dataclasses.FrozenInstanceError):
    d.bottleneck = "compute"


def deep_step(w, batch):
  """Little to reduce (a 128x128 matrix), much to compute (40 layers)."""
  def loss_fn(w):
    h = batch
    for _ in range(40):
      h = jnp.tanh(h @ w)
    return jdist.compute_average_loss(jnp.sum(h ** 2, axis=1))
  loss, grad = jax.value_and_grad(loss_fn)(w)
  return w - 0.01 * grad, loss


def test_a_compute_bound_step_is_not_called_input_bound(devices):
  strategy = jdist.MirroredStrategy(devices[:2])
  rng = np.random.default_rng(0)
  data = [rng.normal(size=(256, 128)).astype(np.float32) for _ in range(3)]
  w = jnp.asarray(rng.normal(size=(128, 128)) / 12, jnp.float32)
  # A jdist step brings its own strategy.
  d = jdist.diagnose(strategy.function(deep_step), w, data, steps=3)
  assert d.multi.num_replicas == 2
  assert d.bottleneck == "compute", str(d)
  assert d.multi.compute > d.multi.input_wait
  assert sum(getattr(d.multi, p) for p in ("input_wait", "compute",
             "collectives", "overhead")) == pytest.approx(d.multi.step)
  assert d.multi.collective_bytes >= 128 * 128 * 4  # at least the gradient
  assert d.single.collectives == 0 < d.multi.collectives


def test_batches_that_change_shape_are_named_recompilation():
  def step(w, batch):
    return w + jdist.compute_average_loss(jnp.sum(batch ** 2, axis=1)), ()
  data = [np.ones((8, k), np.float32) for k in (2, 3, 4)]
  d = jdist.diagnose(step, jnp.zeros(()), data, num_replicas=2, steps=3)
  assert d.bottleneck == "recompilation"
  assert d.multi.recompilations >= 2
  assert "pad to a fixed size" in d.fix


def test_a_callback_to_python_in_the_step_is_counted():
  def step(w, batch):
    jax.debug.callback(lambda x: None, batch)
    return linear_step(w, batch)
  d = jdist.diagnose(step, jnp.zeros(8), linear_batches(2), num_replicas=2,
                     steps=2)
  assert d.multi.host_callbacks >= 1
  assert any("calls back to Python" in note for note in d.notes)


def test_bad_arguments_say_what_to_pass(devices):
  data = linear_batches(2)
  w = jnp.zeros(8)
  with pytest.raises(TypeError, match="one-shot iterator.*Pass a list"):
    jdist.diagnose(linear_step, w, iter(data), num_replicas=2)
  with pytest.raises(TypeError, match="needs a step function"):
    jdist.diagnose("train_step", w, data)
  with pytest.raises(ValueError, match="steps must be a positive int"):
    jdist.diagnose(linear_step, w, data, steps=0)
  with pytest.raises(ValueError, match="strategy or num_replicas, not both"):
    jdist.diagnose(linear_step, w, data, num_replicas=2,
                   strategy=jdist.MirroredStrategy())
  with pytest.raises(ValueError, match="has one replica.*device_count"):
    jdist.diagnose(linear_step, w, data,
                   strategy=jdist.OneDeviceStrategy(devices[0]))
  with pytest.raises(ValueError, match="Only 4 local devices; 8 are needed"):
    jdist.diagnose(linear_step, w, data, num_replicas=8)
  with pytest.raises(ValueError, match="no batches"):
    jdist.diagnose(linear_step, w, [], num_replicas=2)
  with pytest.raises(TypeError, match=r"state, outputs = step\(state, batch\)"
                     r".*returned Array"):
    jdist.diagnose(lambda w, b: w, w, data, num_replicas=2)
