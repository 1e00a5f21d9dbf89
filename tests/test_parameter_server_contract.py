"""Which outputs of a step the parameter servers take as new state.

Written as a user ports TensorFlow's parameter-server tutorial: a per-worker
dataset, `coordinator.schedule(step_fn, args=(iterator,))`, a train step and
an evaluation. The new state is what the function's `state_output` contract
says, never a value that happens to have the state's shape.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

Local = jdist.cluster_resolver.LocalClusterResolver
X = np.random.default_rng(0).normal(size=(4, 2)).astype(np.float32)
Y = np.array([1.0, 0.0, 1.0, 2.0], np.float32)


@pytest.fixture
def strategy():
  # Sequential updates: every batch is the same, so any order of the two
  # workers' updates gives the one-device trajectory.
  strategy = jdist.ParameterServerStrategy(Local(num_workers=2, num_ps=1),
                                           max_staleness=0)
  yield strategy
  strategy.coordinator.shutdown()


def loss_then_state(w, batch):
  """A ported step in the order TF code often returns things."""
  x, y = batch
  loss, g = jax.value_and_grad(
      lambda w: jdist.compute_average_loss((x @ w - y) ** 2))(w)
  return loss, w - 0.1 * g


def numpy_sgd(steps: int, losses: list | None = None) -> np.ndarray:
  w = np.zeros(2, np.float64)
  for _ in range(steps):
    if losses is not None:
      losses.append(np.mean((X @ w - Y) ** 2))
    w = w - 0.1 * 2 * X.T @ (X @ w - Y) / len(X)
  return w


def schedule_steps(strategy, train_step, w, steps):
  coordinator = strategy.coordinator
  iterator = iter(coordinator.create_per_worker_dataset(
      lambda: itertools.repeat((X, Y))))

  def step_fn(iterator):
    loss, _ = train_step(w, next(iterator))
    return strategy.reduce("sum", loss)

  losses = [coordinator.schedule(step_fn, args=(iterator,))
            for _ in range(steps)]
  coordinator.join()
  return coordinator.fetch(losses)


def refused(strategy, call) -> str:
  """The message of the error that `call` (a step's first call on the
  coordinator, which waits for its result) raises; join() reports it too."""
  with pytest.raises(jdist.DistributionError) as error:
    call()
  with pytest.raises(jdist.DistributionError):
    strategy.coordinator.join()
  return str(error.value)


def test_a_step_returning_loss_then_state_trains_as_one_device(strategy):
  train_step = strategy.function(loss_then_state, state_output=1)
  w = strategy.replicate(jnp.zeros(2))
  losses = schedule_steps(strategy, train_step, w, 20)
  want_losses = []
  np.testing.assert_allclose(w.read(), numpy_sgd(20, want_losses), rtol=1e-5,
                             atol=1e-6)
  assert w.version() == {0: 20}
  # Applied one at a time in some order: the losses are one device's.
  np.testing.assert_allclose(sorted(losses), sorted(want_losses), rtol=1e-5)
  # The same declaration runs unchanged under a synchronous strategy.
  mirrored = jdist.MirroredStrategy()
  sync_step = mirrored.function(loss_then_state, state_output=1)
  v = mirrored.replicate(jnp.zeros(2))
  for batch in mirrored.experimental_distribute_dataset([(X, Y)] * 20):
    _, v = sync_step(v, batch)
  np.testing.assert_allclose(w.read(), np.asarray(v), rtol=1e-5, atol=1e-6)


def test_the_default_contract_refuses_loss_then_state_and_writes_nothing(
    strategy):
  w = strategy.replicate(jnp.zeros(2))
  with pytest.raises(jdist.DistributionError) as error:
    schedule_steps(strategy, strategy.function(loss_then_state), w, 3)
  message = str(error.value)
  assert "the ServerVariables argument 0 `w`" in message
  assert "as output 0 of a tuple" in message
  assert "Output 1 has the variables' shapes" in message
  assert "state_output=1" in message and "state_output=None" in message
  assert w.version() == {0: 0}
  np.testing.assert_array_equal(w.read(), [0.0, 0.0])


def test_a_read_only_evaluation_leaves_the_variables_alone(strategy):
  w = strategy.replicate(jnp.array([3.0, 4.0]))

  def normalized(w):
    return w / jnp.linalg.norm(w)

  unit = strategy.function(normalized, state_output=None)(w)
  np.testing.assert_allclose(unit.fetch(), [0.6, 0.8], rtol=1e-6)
  np.testing.assert_array_equal(w.read(), [3.0, 4.0])
  assert w.version() == {0: 0}
  # Undeclared, the same function is refused: its output has the variables'
  # shapes, and whether it is their new value is the user's to say.
  message = refused(strategy, lambda: strategy.function(normalized)(w))
  assert ("The whole output has the variables' shapes: if it is their new "
          "value, pass state_output=lambda out: out; if it is only computed "
          "from them, state_output=None.") in message
  np.testing.assert_array_equal(w.read(), [3.0, 4.0])


def test_an_all_reduced_eval_loss_does_not_replace_a_scalar_variable(strategy):
  scale = strategy.replicate(jnp.float32(1.0))

  def eval_step(scale, batch):
    x, y = batch
    per_replica = jnp.sum((scale * x[:, 0] - y) ** 2)
    return jdist.get_replica_context().all_reduce("sum", per_replica)

  coordinator = strategy.coordinator
  iterator = iter(coordinator.create_per_worker_dataset(
      lambda: itertools.repeat((X, Y))))
  evaluate = strategy.function(eval_step, state_output=None)
  losses = [coordinator.schedule(lambda it: evaluate(scale, next(it)),
                                 args=(iterator,)) for _ in range(4)]
  want = float(np.sum((X[:, 0] - Y) ** 2))
  np.testing.assert_allclose(coordinator.fetch(losses), [want] * 4, rtol=1e-6)
  assert float(scale.read()) == 1.0 and scale.version() == {0: 0}
  with pytest.raises(jdist.DistributionError, match="state_output=None"):
    undeclared = strategy.function(eval_step)
    coordinator.schedule(lambda it: undeclared(scale, next(it)),
                         args=(iterator,))
    coordinator.join()
  assert float(scale.read()) == 1.0


def test_a_dict_output_and_several_variable_sets(strategy):
  w = strategy.replicate(jnp.zeros(2))
  seen = strategy.replicate(jnp.int32(0))

  def step(w, seen, batch):
    loss, new_w = loss_then_state(w, batch)
    return {"loss": loss, "w": new_w, "seen": seen + batch[0].shape[0]}

  batches = strategy.experimental_distribute_dataset([(X, Y)] * 3)
  ambiguous = strategy.function(step)
  message = refused(strategy,
                    lambda: ambiguous(w, seen, next(iter(batches))))
  assert ("takes 2 sets of ServerVariables (the ServerVariables argument 0 "
          "`w`; the ServerVariables argument 1 `seen`)") in message
  assert "strategy.function(step, state_output=(0, 1)) for a step" in message
  assert w.version() == {0: 0} and seen.version() == {0: 0}

  train = strategy.function(step, state_output=("w", "seen"))
  for batch in batches:
    out = train(w, seen, batch)
  assert out["w"] is w and out["seen"] is seen
  assert isinstance(out["loss"], jdist.RemoteValue)
  np.testing.assert_allclose(w.read(), numpy_sgd(3), rtol=1e-5, atol=1e-6)
  assert int(seen.read()) == 12

  wrong = strategy.function(step, state_output=("loss", None))
  message = refused(strategy, lambda: wrong(w, seen, next(iter(batches))))
  assert "state_output='loss': output['loss'] of the step is " in message
  assert ("not the new value of the ServerVariables argument 0 `w` "
          "float32[2]. Nothing was written. Output 'w' has the variables' "
          "shapes: if it is their new value, pass state_output='w'.") in message


def test_state_output_takes_only_places():
  with pytest.raises(TypeError, match="is not a place in the step's output"):
    jdist.MirroredStrategy().function(loss_then_state, state_output=[1])
  with pytest.raises(TypeError, match="is not a place"):
    jdist.ParameterServerStrategy(Local(1, 1)).function(
        loss_then_state, state_output=1.5)


def test_the_trainer_evaluates_and_predicts_without_writing(digits_flat):
  x, y = digits_flat
  strategy = jdist.ParameterServerStrategy(Local(num_workers=1, num_ps=1))
  with strategy.scope():
    trainer = jdist.Trainer(
        MLP(hidden=16), optimizer=optax.sgd(0.1, momentum=0.9),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
  trainer.fit(x[:128], y[:128], batch_size=32, epochs=1, verbose=0)
  before = trainer.state.version()
  params = trainer.params
  assert before == {0: 4}
  trainer.evaluate(x[128:256], y[128:256], batch_size=32, verbose=0)
  trainer.predict(x[128:256], batch_size=32, verbose=0)
  assert trainer.state.version() == before
  jax.tree.map(np.testing.assert_array_equal, trainer.params, params)
  strategy.coordinator.shutdown()
