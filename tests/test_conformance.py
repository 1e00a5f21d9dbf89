"""One conformance suite, run over every strategy: same training as one device.

Each strategy of several replicas trains with SGD with momentum on
scikit-learn's digits and is compared with a one-device run on final
parameters, optimizer state, per-step losses and per-example outputs. SGD, not
adam: adam normalises the gradient's scale away, so a gradient N times too large
would still pass. The strategies of one replica cannot show a device-count bug
against one device; they are compared with the same training written in plain
JAX instead (no jdist), and checked to run where they say.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jdist
import jdist.testing
from jdist.examples.data import batches
from jdist.examples.models import CNN, MLP


def mirrored(n):
  return lambda: jdist.MirroredStrategy(jax.local_devices()[:n])


# Every single-process strategy of several replicas, by name (multi-process
# ones: tests/multiprocess).
STRATEGIES = {
    "mirrored_2": mirrored(2),
    "mirrored_4": mirrored(4),
    # Without a cluster: one process over every local device.
    "multi_worker": jdist.MultiWorkerMirroredStrategy,
    # Variables held once on cpu:0, steps on all four devices.
    "central_storage": jdist.CentralStorageStrategy,
}
# The strategies of one replica, with the device each promises to run on.
ONE_REPLICA = {
    "default": (jdist.get_strategy, 0),
    "one_device": (lambda: jdist.OneDeviceStrategy("cpu:1"), 1),
    "mirrored_1": (mirrored(1), 0),
}


class State(train_state.TrainState):
  batch_stats: Any = None
  key: Any = None


def make_state(model, sample, *, lr=0.1, seed=0):
  variables = model.init({"params": jax.random.key(seed),
                          "dropout": jax.random.key(1)}, sample, train=False)
  return State.create(apply_fn=model.apply, params=variables["params"],
                      tx=optax.sgd(lr, momentum=0.9),
                      batch_stats=variables.get("batch_stats"),
                      key=jax.random.key(seed + 7))


def classifier_step(state, batch, average=jdist.compute_average_loss):
  """A user's per-replica step: flax model, optax, compute_average_loss."""
  dropout_key = jax.random.fold_in(state.key, state.step)
  has_bn = state.batch_stats is not None

  def loss_fn(params):
    variables = {"params": params}
    if has_bn:
      variables["batch_stats"] = state.batch_stats
    logits, updates = state.apply_fn(
        variables, batch["x"], train=True, rngs={"dropout": dropout_key},
        mutable=["batch_stats"] if has_bn else [])
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return average(per_example), (logits, updates)

  (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params)
  new = state.apply_gradients(grads=grads)
  if has_bn:
    new = new.replace(batch_stats=updates["batch_stats"])
  return new, {"loss": loss, "logits": logits}


@pytest.fixture(scope="module")
def digit_batches(digits, digits_flat):
  x, y = digits
  xf, _ = digits_flat
  return {"image": batches(x[:1280], y[:1280], 64),
          "flat": batches(xf[:1280], y[:1280], 64)}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_mlp_matches_one_device(name, digit_batches):
  """Parameters, momentum, losses and logits of every step, N vs 1 device."""
  data = digit_batches["flat"]
  strategy = STRATEGIES[name]()
  assert strategy.num_replicas_in_sync > 1  # else it proves nothing
  state = make_state(MLP(), data[0]["x"])
  out = jdist.testing.assert_equivalent(classifier_step, state, data,
                                        strategy=strategy)
  assert out.outputs[-1]["loss"] < 0.75 * out.outputs[0]["loss"]  # it learned


def plain_jax_training(state, data):
  """The same training with no jdist at all: jit, a mean loss, optax."""
  step = jax.jit(lambda s, b: classifier_step(s, b, average=jnp.mean))
  losses = []
  for batch in data:
    state, out = step(state, batch)
    losses.append(float(out["loss"]))
  return state, losses


@pytest.mark.parametrize("name", sorted(ONE_REPLICA))
def test_one_replica_strategy_is_plain_jax_on_its_device(name, digit_batches):
  """A strategy of one replica trains exactly as plain JAX does (a padded
  last batch included), on the device it names."""
  make_strategy, device = ONE_REPLICA[name]
  strategy = make_strategy()
  assert strategy.num_replicas_in_sync == 1
  assert strategy.devices == (jax.local_devices()[device],)
  data = digit_batches["flat"][:5] + [
      {k: v[:40] for k, v in digit_batches["flat"][5].items()}]
  state = make_state(MLP(), data[0]["x"])
  want, want_losses = plain_jax_training(state, data)
  got = jdist.testing.run_training(strategy, classifier_step, state, data)
  np.testing.assert_allclose([o["loss"] for o in got.outputs], want_losses,
                             rtol=1e-5)
  for a, b in zip(jax.tree.leaves((got.state.params, got.state.opt_state)),
                  jax.tree.leaves((want.params, want.opt_state))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  step = strategy.function(classifier_step)
  placed = strategy.replicate(state)
  (batch,) = strategy.experimental_distribute_dataset(data[:1])
  new, out = step(placed, batch)
  for leaf in jax.tree.leaves((new.params, out)):
    assert leaf.devices() == {jax.local_devices()[device]}


def test_cnn_batchnorm_dropout_matches_one_device(digits):
  """BatchNorm (statistics all-reduced MEAN) and dropout, bit-for-bit semantics.

  Runs in float64, so that the tolerance can be tight: a semantic difference
  (wrong statistics, dropout masks that depend on the replica) shows at
  1e-9; reduction-order noise does not. On 4 replicas (2 runs the same
  program with larger shards: test_mlp_matches_one_device covers both).
  """
  strategy = STRATEGIES["mirrored_4"]()
  with jax.enable_x64(True):
    x, y = digits
    data = batches(x[:768].astype(np.float64), y[:768], 64)
    model = CNN(batch_norm=True, bn_axis_name=strategy.axis_name,
                dropout_rate=0.3, param_dtype=jnp.float64)
    state = make_state(model, data[0]["x"])
    out = jdist.testing.assert_equivalent(classifier_step, state, data,
                                          strategy=strategy, rtol=1e-9,
                                          atol=1e-11)
  assert len(out.outputs) == 12
  assert out.outputs[-1]["loss"] < out.outputs[0]["loss"] / 2  # it learned


def test_cnn_float32_stays_close_to_one_device(digit_batches):
  """The float32 run on 4 replicas follows one device within reduction-order
  noise (SGD with momentum does not amplify it as adam does)."""
  strategy = STRATEGIES["mirrored_4"]()
  model = CNN(batch_norm=True, bn_axis_name=strategy.axis_name, dropout_rate=0.3)
  data = digit_batches["image"]
  state = make_state(model, data[0]["x"])
  out = jdist.testing.assert_equivalent(classifier_step, state, data[:6],
                                        strategy=strategy)
  assert len(out.outputs) == 6


def test_assert_equivalent_catches_a_wrong_step(digit_batches):
  """A step that scales its loss by the local batch is caught, with a diff
  that names loss scaling (issue 9.2)."""
  data = digit_batches["flat"][:3]

  def wrong_step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      per_example = optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["y"])
      # A local mean with a computed divisor: the tracing check cannot see
      # it; the gradient is still N times too large.
      weights = jnp.ones_like(per_example)
      return jnp.sum(weights * per_example) / jnp.sum(weights)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  momentum_state = make_state(MLP(), data[0]["x"])
  sgd = optax.sgd(0.1)  # the parameters then move N times as far
  state = momentum_state.replace(tx=sgd, opt_state=sgd.init(momentum_state.params))
  with pytest.raises(AssertionError, match=r"(?s)state.*params.*differ.*"
                     r"Loss scaling\? The 4-replica run moved the parameters.*"
                     r"about [34]\.\d+ times.*compute_average_loss"):
    jdist.testing.assert_equivalent(wrong_step, state, data, num_replicas=4)


def test_sync_on_read_metrics_match_one_device(digit_batches):
  """Accuracy counted per replica in SyncOnRead SUM totals reads exactly."""
  data = digit_batches["flat"][:5] + [{"x": digit_batches["flat"][5]["x"][:40],
                                       "y": digit_batches["flat"][5]["y"][:40]}]

  def step(state, batch):
    params, totals = state
    logits = MLP().apply({"params": params}, batch["x"])
    ctx = jdist.get_replica_context()
    valid = ctx.example_mask
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["y"]) & valid)
    new_totals = totals.assign({"correct": totals.value["correct"] + correct,
                                "seen": totals.value["seen"] + jnp.sum(valid)})
    return (params, new_totals), {}

  params = make_state(MLP(), data[0]["x"]).params
  totals = jdist.SyncOnRead({"correct": jnp.int32(0), "seen": jnp.int32(0)}, "sum")
  out = jdist.testing.assert_equivalent(step, (params, totals), data,
                                        num_replicas=4)
  _, read = out.state
  assert int(read["seen"]) == 5 * 64 + 40
  logits = MLP().apply({"params": params}, np.concatenate([b["x"] for b in data]))
  labels = np.concatenate([b["y"] for b in data])
  assert int(read["correct"]) == int(np.sum(np.argmax(logits, -1) == labels))


def test_sync_on_read_batchnorm_keeps_per_replica_statistics(digit_batches):
  """BatchNorm without cross-replica sync: statistics kept per replica.

  Normalising with local statistics is not the single-device computation (as
  in tf.distribute without SyncBatchNormalization), so this checks the
  mechanics: replicas hold different running means and reading gives their mean.
  """
  strategy = STRATEGIES["mirrored_4"]()
  model = CNN(batch_norm=True, bn_axis_name=None)
  data = digit_batches["image"][:3]
  variables = model.init(jax.random.key(0), data[0]["x"])
  tx = optax.sgd(0.1)
  state = {"params": variables["params"],
           "opt": tx.init(variables["params"]),
           "bn": jdist.SyncOnRead(variables["batch_stats"], "mean")}

  @strategy.function
  def step(state, batch):
    def loss_fn(params):
      logits, upd = model.apply({"params": params, "batch_stats": state["bn"].value},
                                batch["x"], train=True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
      return jdist.compute_average_loss(loss), upd
    (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = tx.update(grads, state["opt"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt,
            "bn": state["bn"].assign(upd["batch_stats"])}, loss

  state = strategy.replicate(state)
  for batch in strategy.experimental_distribute_dataset(data):
    state, _ = step(state, batch)
  per_replica = state["bn"].value["BatchNorm_0"]["mean"]
  assert per_replica.shape == (4, 32)
  assert not np.allclose(per_replica[0], per_replica[1])
  read = jdist.read_value(state)["bn"]["BatchNorm_0"]["mean"]
  np.testing.assert_allclose(read, np.mean(np.asarray(per_replica), 0), rtol=1e-6)
