"""CentralStorageStrategy: the variables held once, steps on every device.

The conformance suite (tests/test_conformance.py) runs it against one device;
these tests check what it promises besides: where the state lives and how
much memory it takes between steps, with a user's loop and with `fit`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.data import batches
from jdist.examples.models import MLP
from jdist.examples.steps import classifier_step


def held_bytes(tree) -> int:
  """Bytes of every device buffer behind `tree`'s arrays (all copies)."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards)


def one_copy_bytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return batches(x[:640], y[:640], 64)


def user_loop(strategy, data, steps=5):
  """A user's custom loop: replicate, distribute, a compiled step."""
  model, tx = MLP(), optax.adam(1e-2)
  params = model.init(jax.random.key(0), data[0]["x"])["params"]
  step = strategy.function(classifier_step(
      lambda p, x: model.apply({"params": p}, x), tx))
  state = strategy.replicate((params, tx.init(params)))
  for batch in strategy.experimental_distribute_dataset(data[:steps]):
    state, loss = step(state, batch)
  return state, step, loss


def test_state_is_held_once_between_steps(data):
  central = jdist.CentralStorageStrategy()
  assert central.num_replicas_in_sync == 4
  assert central.parameter_device == jax.devices("cpu")[0]
  state, step, loss = user_loop(central, data)
  copy = one_copy_bytes(state)
  assert held_bytes(state) == copy  # one copy, not one per replica
  assert all(x.devices() == {central.parameter_device}
             for x in jax.tree.leaves(state))
  assert step.num_compilations == 1
  assert isinstance(loss, jdist.PerReplica)  # per-replica outputs stay put
  mirrored_state, _, _ = user_loop(jdist.MirroredStrategy(), data)
  assert held_bytes(mirrored_state) == 4 * copy


def test_parameter_device_outside_the_compute_devices(data):
  devices = jax.local_devices()
  strategy = jdist.CentralStorageStrategy(compute_devices=["cpu:1", "cpu:2"],
                                          parameter_device="cpu:3")
  assert strategy.devices == (devices[1], devices[2])
  assert strategy.parameter_device == devices[3]
  model, tx = MLP(), optax.sgd(0.1)
  params = model.init(jax.random.key(0), data[0]["x"])["params"]
  step = classifier_step(lambda p, x: model.apply({"params": p}, x), tx)
  out = jdist.testing.assert_equivalent(step, (params, tx.init(params)),
                                        data[:4], strategy=strategy)
  assert len(out.outputs) == 4
  state, _, _ = user_loop(strategy, data)
  assert {d for x in jax.tree.leaves(state) for d in x.devices()} == {
      devices[3]}


def test_one_compute_device_holds_its_own_variables(data):
  """With one compute device, the variables stay on it (not on the default
  parameter device, cpu:0), and so do the step's outputs."""
  devices = jax.local_devices()
  strategy = jdist.CentralStorageStrategy(compute_devices=["cpu:2"])
  assert strategy.parameter_device == devices[2]
  state, _, loss = user_loop(strategy, data)
  assert {d for x in jax.tree.leaves((state, loss)) for d in x.devices()} == {
      devices[2]}


def test_fit_matches_one_device_and_keeps_one_copy(digits_flat):
  x, y = digits_flat
  x, y, vx, vy = x[:600], y[:600], x[1500:], y[1500:]
  histories, trainers = {}, {}
  for name, strategy in (("one", jdist.OneDeviceStrategy("cpu:0")),
                         ("central", jdist.CentralStorageStrategy())):
    with strategy.scope():
      trainer = jdist.Trainer(MLP(), optimizer=optax.inject_hyperparams(
          optax.sgd)(learning_rate=0.1, momentum=0.9),
          loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
          metrics=["accuracy"])
    histories[name] = trainer.fit(x, y, batch_size=64, epochs=2,
                                  validation_data=(vx, vy), verbose=0).history
    trainers[name] = trainer
  for key, values in histories["one"].items():
    np.testing.assert_allclose(histories["central"][key], values, rtol=1e-4,
                               err_msg=key)
  # Parameters and momentum (SGD: a wrong gradient scale shows in both).
  one, central = (jax.device_get((t.params, t.state.opt_state))
                  for t in (trainers["one"], trainers["central"]))
  problems = jdist.testing.compare_trees(one, central, rtol=1e-4, atol=1e-5,
                                         names=("1 device", "central"))
  assert not problems, "\n".join(problems)
  trainer = trainers["central"]
  device = trainer.strategy.parameter_device
  trainer.learning_rate = 1e-3  # set between steps: held centrally as well
  assert all(x.devices() == {device} for x in jax.tree.leaves(trainer.state))
  assert held_bytes(trainer.state) == one_copy_bytes(trainer.state)
  assert trainer.learning_rate == pytest.approx(1e-3)


def test_strategies_differ_by_parameter_device():
  a = jdist.CentralStorageStrategy(parameter_device="cpu:0")
  b = jdist.CentralStorageStrategy(parameter_device="cpu:1")
  assert a != b and a == jdist.CentralStorageStrategy()
  assert a != jdist.MirroredStrategy()
  assert "parameter_device=cpu:1" in repr(b)


def test_unknown_parameter_device_is_a_clear_error():
  with pytest.raises(ValueError, match=r"Unknown device 'gpu:0': there are 0 "
                     r"gpu devices"):
    jdist.CentralStorageStrategy(parameter_device="gpu:0")
