"""TensorFlow's parameter-server tutorial idioms, as a user ports them.

`batch_data, labels = next(iterator)` inside a scheduled function, and
metrics held on the servers (`acc.result()`, `acc.reset_states()`,
`jdist.read_value`).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

Local = jdist.cluster_resolver.LocalClusterResolver
X = np.random.default_rng(1).normal(size=(6, 2)).astype(np.float32)
Y = np.array([1.0, 0.0, 1.0, 2.0, -1.0, 0.5], np.float32)


@pytest.fixture
def strategy():
  # Sequential updates of identical batches: any order of the workers'
  # updates is the one-device trajectory.
  strategy = jdist.ParameterServerStrategy(Local(num_workers=2, num_ps=1),
                                           max_staleness=0)
  yield strategy
  strategy.coordinator.shutdown()


def numpy_sgd(steps: int) -> np.ndarray:
  w = np.zeros(2, np.float64)
  for _ in range(steps):
    w = w - 0.1 * 2 * X.T @ (X @ w - Y) / len(X)
  return w


def test_a_batch_unpacks_into_data_and_labels_on_the_worker(strategy):
  coordinator = jdist.ClusterCoordinator(strategy)
  w = strategy.replicate(jnp.zeros(2))

  def per_worker_dataset_fn():
    return itertools.repeat((X, Y))

  per_worker_iterator = iter(
      coordinator.create_per_worker_dataset(per_worker_dataset_fn))

  def replica_fn(w, batch_data, labels):
    loss, g = jax.value_and_grad(lambda w: jdist.compute_average_loss(
        (batch_data @ w - labels) ** 2))(w)
    return w - 0.1 * g, loss

  def step_fn(iterator):
    batch_data, labels = next(iterator)  # as the tutorial writes it
    _, loss = strategy.run(replica_fn, args=(w, batch_data, labels))
    return strategy.reduce("sum", loss)

  losses = [coordinator.schedule(step_fn, args=(per_worker_iterator,))
            for _ in range(15)]
  coordinator.join()
  np.testing.assert_allclose(w.read(), numpy_sgd(15), rtol=1e-5, atol=1e-6)
  assert len(set(np.round(coordinator.fetch(losses), 5))) == 15


def test_unpacking_under_mirrored_keeps_the_padding_out():
  strategy = jdist.MirroredStrategy()  # 4 devices: 6 rows pad to 8
  dataset = strategy.experimental_distribute_dataset([(X, Y)],
                                                     global_batch_size=8)
  images, labels = next(iter(dataset))
  assert isinstance(images, jdist.PerReplica)
  loss = strategy.run(lambda x, y: jdist.compute_average_loss(
      (x[:, 0] - y) ** 2), args=(images, labels))
  np.testing.assert_allclose(strategy.reduce("sum", loss),
                             np.mean((X[:, 0] - Y) ** 2), rtol=1e-6)
  with pytest.raises(TypeError, match="Cannot unpack a PerReplica of dict"):
    a, b = next(iter(strategy.experimental_distribute_dataset(
        [{"x": X, "y": Y}], global_batch_size=8)))
