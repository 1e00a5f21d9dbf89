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

# Two workers, sequential updates (max_staleness=0): with identical batches
# any order of the workers' updates is the one-device trajectory.
from test_parameter_server_contract import strategy  # noqa: F401 (fixture)

X = np.random.default_rng(1).normal(size=(6, 2)).astype(np.float32)
Y = np.array([1.0, 0.0, 1.0, 2.0, -1.0, 0.5], np.float32)


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


XE = np.random.default_rng(2).normal(size=(8, 3)).astype(np.float32)
YE = np.array([0, 1, 2, 0, 1, 2, 0, 1])
W = np.random.default_rng(3).normal(size=(3, 3)).astype(np.float32)


def test_a_metric_on_the_servers_reads_and_resets_as_in_the_tutorial(strategy):
  coordinator = strategy.coordinator
  eval_accuracy = strategy.replicate(jdist.metrics.SparseCategoricalAccuracy())
  per_worker_eval_iterator = iter(coordinator.create_per_worker_dataset(
      lambda: itertools.repeat((XE, YE))))

  def replica_fn(eval_accuracy, batch_data, labels):
    return eval_accuracy.update(labels, batch_data @ W), None

  def eval_step(iterator):
    batch_data, labels = next(iterator)
    strategy.run(replica_fn, args=(eval_accuracy, batch_data, labels))

  for _ in range(5):
    coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
  coordinator.join()
  expected = np.mean(np.argmax(XE @ W, -1) == YE)
  assert 0 < expected < 1
  assert float(eval_accuracy.result()) == pytest.approx(expected)
  assert float(eval_accuracy.sums()["count"]) == 5 * len(XE)
  read = jdist.read_value(eval_accuracy)
  assert isinstance(read, jdist.metrics.SparseCategoricalAccuracy)
  assert float(read.result()) == pytest.approx(expected)

  eval_accuracy.reset_states()  # Keras' in-place reset, on the servers
  assert {k: float(v) for k, v in eval_accuracy.sums().items()} == {
      "total": 0.0, "count": 0.0}
  eval_accuracy.reset_state()
  # The functional forms would leave the servers' metric as it is: refused,
  # with what to write.
  with pytest.raises(TypeError, match=r"reset\(\) returns a new Sparse.*"
                                      r"handle.reset_state\(\)"):
    eval_accuracy.reset()
  with pytest.raises(TypeError, match="is updated inside a step"):
    eval_accuracy.update_state(YE, XE @ W)
  with pytest.raises(AttributeError, match="nor has the SparseCategorical"):
    eval_accuracy.results()


def test_an_nnx_metric_on_the_servers_computes_and_resets_in_place(strategy):
  from flax import nnx
  accuracy = strategy.replicate(nnx.metrics.Accuracy())

  def replica_fn(accuracy, batch_data, labels):
    accuracy.update(logits=batch_data @ W, labels=labels)  # nnx: in place
    return accuracy, None

  strategy.run(replica_fn, args=(accuracy, XE, YE))
  expected = np.mean(np.argmax(XE @ W, -1) == YE)
  assert float(accuracy.compute()) == pytest.approx(expected)
  accuracy.reset()  # in place on the copy read, written back
  assert [float(x) for x in jax.tree.leaves(accuracy.read())] == [0.0, 0.0]
  accuracy.update(logits=XE[:4] @ W, labels=YE[:4])
  assert float(accuracy.compute()) == pytest.approx(
      np.mean(np.argmax(XE[:4] @ W, -1) == YE[:4]))


def test_read_value_reads_server_variables(strategy):
  w = strategy.replicate({"w": jnp.arange(3.0)})
  got = jdist.read_value({"params": w, "n": jdist.SyncOnRead(jnp.ones(()),
                                                             "sum")})
  np.testing.assert_array_equal(got["params"]["w"], [0.0, 1.0, 2.0])
  assert float(got["n"]) == 1.0
  with pytest.raises(AttributeError, match=r"has no attribute 'w'.*"
                                           r"\.read\(\)"):
    w.w


def test_input_options_reach_the_worker_that_distributes_the_batch(strategy):
  """The options travel with each batch to the worker that runs its step,
  which distributes it over its devices with them (they were dropped)."""
  coordinator = jdist.ClusterCoordinator(strategy)
  w = strategy.replicate(jnp.zeros(2))

  @strategy.function
  def step(w, batch):
    x, y = batch
    loss, g = jax.value_and_grad(lambda w: jdist.compute_average_loss(
        (x @ w - y) ** 2))(w)
    return w - 0.1 * g, loss

  options = jdist.InputOptions(pad_to_replicas=True)
  batches = list(strategy.experimental_distribute_dataset([(X, Y)] * 3,
                                                          options))
  assert [b.options for b in batches] == [options] * 3
  for batch in batches:
    coordinator.schedule(step, args=(w, batch))
  coordinator.join()
  np.testing.assert_allclose(w.read(), numpy_sgd(3), rtol=1e-5, atol=1e-6)
  with pytest.raises(TypeError, match="jdist.InputOptions or None"):
    strategy.experimental_distribute_dataset([(X, Y)], {"pad": True})


def test_the_coordinator_reads_fetched_results_as_the_worker_does(strategy):
  """`reduce`, `gather` and `experimental_local_results` of a step's
  results fetched to the coordinator give what the same calls give on the
  worker that computed them (the synchronous strategies' reading): a
  `SyncOnRead`'s rows too are gathered and picked, as every strategy does."""
  coordinator = strategy.coordinator
  iterator = iter(coordinator.create_per_worker_dataset(
      lambda: itertools.repeat((X[:5], Y[:5]))))

  def replica_fn(x, y):
    error = x[:, 0] - y
    return error, jdist.SyncOnRead(jnp.stack([error.sum(), error.max()]),
                                   "mean")

  def reads(out):
    return (strategy.reduce("sum", out[0], axis=0),
            strategy.reduce("max", out[1]), strategy.gather(out[0]),
            strategy.gather(out[1]), strategy.experimental_local_results(out))

  def on_worker(iterator):
    out = strategy.run(replica_fn, args=next(iterator))
    return out, reads(out)

  out, on_the_worker = coordinator.fetch(
      coordinator.schedule(on_worker, args=(iterator,)))
  here = reads(out)
  assert jax.tree.structure(here) == jax.tree.structure(on_the_worker)
  jax.tree.map(np.testing.assert_allclose, here, on_the_worker)
  np.testing.assert_allclose(here[2], X[:5, 0] - Y[:5], rtol=1e-6)
