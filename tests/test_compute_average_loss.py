"""compute_average_loss takes sample weights and a divisor as TensorFlow does.

Weights of shape (b, 1) against losses of shape (b,) once broadcast to
(b, b): the loss and its gradients came out multiplied by the per-replica
batch size, silently. TF squeezes them; every shape TF refuses is an error.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

from conftest import strategy_on

B = 8  # global batch; 2 replicas of 4


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(B, 3)).astype(np.float32),
          "y": rng.normal(size=(B,)).astype(np.float32),
          "w": rng.uniform(0.5, 2.0, size=(B,)).astype(np.float32)}


def weighted_step(reshape_w):
  """A user's step: squared error, weighted per example, then its gradient."""
  def step(params, batch):
    def loss_fn(p):
      per_example = (batch["x"] @ p - batch["y"]) ** 2
      return jdist.compute_average_loss(per_example,
                                        sample_weight=reshape_w(batch["w"]))
    return jax.value_and_grad(loss_fn)(params)
  return step


def reference(batch, params):
  """The weighted mean over the global batch and its gradient, on the host."""
  def loss_fn(p):
    return jnp.sum(batch["w"] * (batch["x"] @ p - batch["y"]) ** 2) / B
  return jax.value_and_grad(loss_fn)(params)


@pytest.mark.parametrize("shape", ["(b,)", "(b, 1)", "scalar"])
def test_the_weight_shapes_tf_accepts_give_the_weighted_mean(batch, shape):
  strategy = strategy_on(2)
  reshape = {"(b,)": lambda w: w, "(b, 1)": lambda w: w[:, None],
             "scalar": lambda w: 2.0}[shape]
  data = dict(batch, w=batch["w"] if shape != "scalar" else
              np.full(B, 2.0, np.float32))
  params = jnp.array([0.5, -1.0, 2.0], jnp.float32)
  step = jax.jit(strategy.function(weighted_step(reshape)))
  dist = next(iter(strategy.experimental_distribute_dataset([data])))
  loss, grads = step(strategy.replicate(params), dist)
  want_loss, want_grads = reference(data, params)
  np.testing.assert_allclose(float(strategy.reduce("sum", loss)), want_loss,
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grads), want_grads, rtol=1e-5)


def test_weights_of_the_losses_own_shape_and_per_example_weights_of_2d_losses():
  loss = jnp.arange(8.0).reshape(4, 2)  # (b, k): extra axes are summed
  w = jnp.array([1.0, 0.0, 2.0, 1.0])
  want = float(jnp.sum(loss * w[:, None]) / 4)
  assert float(jdist.compute_average_loss(loss, sample_weight=w)) == want
  assert float(jdist.compute_average_loss(
      loss, sample_weight=jnp.broadcast_to(w[:, None], (4, 2)))) == want
  assert float(jdist.compute_average_loss(
      loss, sample_weight=w[:, None, None])) == want  # (b, k, 1): squeezed


@pytest.mark.parametrize("w_shape", [(4, 4), (8,), (1, 4), (4, 2)])
def test_weights_of_other_shapes_are_an_error(w_shape):
  strategy = strategy_on(2)
  data = {"l": np.ones(8, np.float32)}
  w = np.ones(w_shape, np.float32)
  dist = next(iter(strategy.experimental_distribute_dataset([data])))
  with pytest.raises(ValueError, match=(
      rf"sample_weight of shape {re.escape(str(w_shape))} does not fit the "
      r"per-example loss of shape \(4,\).*\(4,\) or \(4, 1\)")):
    strategy.run(lambda b: jdist.compute_average_loss(b["l"], sample_weight=w),
                 args=(dist,))


@pytest.mark.parametrize("n", [0, -8, 2.5, True, np.array([8])])
def test_global_batch_size_must_be_a_positive_integer(n):
  with pytest.raises(ValueError, match="global_batch_size must be a positive "
                     "integer"):
    jdist.compute_average_loss(jnp.ones(4), global_batch_size=n)


def test_global_batch_size_computed_inside_a_step():
  """A traced divisor cannot be checked while tracing: it is used as it is."""
  @jax.jit
  def f(losses, n):
    return jdist.compute_average_loss(losses, global_batch_size=n)
  assert float(f(jnp.ones(4), jnp.int32(8))) == 0.5
  assert float(jdist.compute_average_loss(
      jnp.ones(4), global_batch_size=np.int64(8))) == 0.5


def test_a_batch_every_replica_gets_whole_is_refused():
  """A batch passed to the step as it is reaches every replica whole: the
  loss is the same on all of them, autodiff sums nothing, and the gradients
  were 4 times too small, silently. It is an error naming the fix."""
  strategy = jdist.MirroredStrategy(jax.local_devices()[:4])
  x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(16, 4)

  @strategy.function
  def grad(w, batch):
    return jax.grad(lambda w: jdist.compute_average_loss(
        (batch @ w) ** 2))(w)

  w = strategy.replicate(np.ones(4, np.float32))
  with pytest.raises(jdist.LossScalingError,
                     match=r"same on all 4 replicas.*4 times too small.*"
                     r"experimental_distribute_dataset"):
    grad(w, x)
  split, = strategy.experimental_distribute_dataset([x])
  np.testing.assert_allclose(  # distributed, it is one device's gradient
      grad(w, split), jax.grad(lambda w: jnp.mean((x @ w) ** 2))(np.ones(4)),
      rtol=1e-6)
