"""The classic loss-scaling mistake fails loudly, correct steps stay silent
(issue 9.2). The step is flax's examples/mnist train step, ported as is:
nnx model with BatchNorm and dropout, `nnx.value_and_grad`, `nnx.Optimizer`,
and a loss that is a mean over the (local) batch."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdist

from conftest import strategy_on

GLOBAL_BATCH_SIZE = 32

# The CNN's nnx Dropout draws the same mask on every replica, which jdist
# warns of (test_meshes.py tests that warning); here the loss is the subject.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.* draws random numbers .* same on every replica")


class CNN(nnx.Module):
  """flax examples/mnist's CNN (its `__call__(x, rngs)`), sized for 8x8."""

  def __init__(self, rngs: nnx.Rngs, axis_name=None):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(64, 32, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x),
                                                              rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


def mnist_loss(model, batch, rngs):  # flax's loss_fn, as is
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch["label"]).mean()
  return loss, logits


def global_sum_loss(model, batch, rngs):  # the older TF tutorials' scaling
  logits = model(batch["image"], rngs)
  per_example = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch["label"])
  return jnp.sum(per_example) / GLOBAL_BATCH_SIZE, logits


def average_loss(model, batch, rngs):
  logits = model(batch["image"], rngs)
  return jdist.compute_average_loss(
      optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
  ), logits


def rescaled_mean_loss(model, batch, rngs):  # the mean, made global by hand
  loss, logits = mnist_loss(model, batch, rngs)
  return loss / jdist.get_replica_context().num_replicas_in_sync, logits


def _train(strategy, loss_fn, **options):
  model = CNN(nnx.Rngs(0), axis_name=strategy.axis_name)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, 0.9), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @partial(strategy.function, **options)
  def train_step(state, batch, key):
    model, optimizer = nnx.merge(graphdef, state)
    model.train()
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, nnx.Rngs(key))
    optimizer.update(model, grads)  # in-place updates
    return nnx.state((model, optimizer)), loss

  rng = np.random.default_rng(0)
  images = rng.normal(size=(64, 8, 8, 1)).astype(np.float32)
  labels = (np.arange(64) % 10).astype(np.int32)
  data = [{"image": images[i:i + 32], "label": labels[i:i + 32]}
          for i in (0, 32)]
  state = strategy.replicate(state)
  for batch in strategy.experimental_distribute_dataset(data):
    state, loss = train_step(state, batch, jax.random.key(1))
  return train_step, state


def test_flax_mnist_step_ported_as_is_raises_at_the_first_call():
  strategy = strategy_on(4)
  with pytest.raises(jdist.LossScalingError,
                     match=r"(?s)averages its loss over this replica's batch.*"
                     r"8 examples per replica.*4 times.*compute_average_loss.*"
                     r"GLOBAL_BATCH_SIZE.*check_loss_scaling=False"):
    _train(strategy, mnist_loss)


@pytest.mark.parametrize("loss_fn", [global_sum_loss, average_loss,
                                     rescaled_mean_loss],
                         ids=lambda f: f.__name__)
def test_correctly_scaled_steps_are_silent(loss_fn):
  step, _ = _train(strategy_on(4), loss_fn)
  assert step.num_compilations == 1


def test_the_mean_is_right_on_one_replica_and_can_be_allowed():
  _train(strategy_on(1), mnist_loss)  # the global batch is the local one
  step, _ = _train(strategy_on(2), mnist_loss, check_loss_scaling=False)
  assert step.num_compilations == 1


def test_a_local_mean_that_no_gradient_sum_depends_on_is_silent():
  """A saliency map: the gradient of a local mean with respect to the
  inputs, not the mirrored parameters: nothing is summed over replicas."""
  strategy = strategy_on(2)

  def step(w, x):
    saliency = jax.grad(lambda x: jnp.mean(jnp.tanh(x @ w)))(x)
    return saliency

  batch, = strategy.experimental_distribute_dataset([np.ones((8, 3))])
  out = strategy.run(step, args=(strategy.replicate(jnp.ones((3, 2))), batch))
  assert strategy.gather(out).shape == (8, 3)
