"""Sharded optimizer state (ZeRO): less memory per device, the same training.

`jdist.ShardedOptimizer` keeps each replica's block of the optimizer state;
these tests train with it as users would (a custom loop with flax's
TrainState, `jax.jit` around the step, `Trainer(shard_optimizer_state=True)`)
and compare with mirrored state, measure the state's bytes on a device from
the arrays' addressable shards, resume a 4-device checkpoint on 2 devices,
and check the errors that come before the first step.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jdist
import jdist.testing
from conftest import strategy_on
from jdist.examples.models import MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = MLP(hidden=32)


def device_bytes(tree) -> int:
  """Bytes of `tree`'s arrays held by the first device (its shards)."""
  device = jax.local_devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == device)


def _batches(digits_flat, steps=20, batch=64):
  x, y = digits_flat
  return [{"x": x[i * batch:(i + 1) * batch], "y": y[i * batch:(i + 1) * batch]}
          for i in range(steps)]


def _loss(params, batch):
  logits = MODEL.apply({"params": params}, batch["x"])
  return jdist.compute_average_loss(
      optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def _train(strategy, tx, batches, *, own_grads):
  """A user's custom loop: flax TrainState, jax.jit around the step."""
  params = MODEL.init(jax.random.key(0), batches[0]["x"][:1])["params"]
  with strategy.scope():
    state = train_state.TrainState.create(
        apply_fn=MODEL.apply, params=strategy.replicate(params), tx=tx)

  grad = tx.value_and_grad if own_grads else jax.value_and_grad

  @strategy.function
  def step(state, batch):
    loss, grads = grad(_loss)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  jitted = jax.jit(step)
  losses = []
  for batch in strategy.experimental_distribute_dataset(batches):
    state, loss = jitted(state, batch)
    losses.append(float(strategy.reduce("sum", loss).addressable_data(0)))
  return state, losses, step


@pytest.mark.parametrize("own_grads", [False, True], ids=["zero1", "zero2"])
def test_adam_on_4_replicas_matches_mirrored_with_a_quarter_of_the_state(
    digits_flat, own_grads):
  strategy = strategy_on(4)
  batches = _batches(digits_flat)
  mirrored, m_losses, _ = _train(strategy, optax.adam(1e-2), batches,
                                 own_grads=False)
  sharded, s_losses, step = _train(
      strategy, jdist.ShardedOptimizer(optax.adam(1e-2), strategy), batches,
      own_grads=own_grads)
  one, o_losses, _ = _train(strategy_on(1), optax.adam(1e-2), batches,
                            own_grads=False)

  problems = jdist.testing.compare_trees(
      jax.device_get(mirrored.params), jax.device_get(sharded.params),
      rtol=1e-5, atol=1e-6, names=("mirrored", "sharded"), prefix="params")
  problems += jdist.testing.compare_trees(
      jax.device_get(one.params), jax.device_get(sharded.params),
      rtol=1e-4, atol=1e-5, names=("1-device", "sharded"), prefix="params")
  assert not problems, "\n".join(problems)
  np.testing.assert_allclose(s_losses, m_losses, rtol=1e-5)
  assert s_losses[-1] < 0.6 * s_losses[0]  # it trained
  # The moments are whole on each replica when mirrored, a quarter sharded.
  ratio = device_bytes(sharded.opt_state) / device_bytes(mirrored.opt_state)
  assert ratio <= 0.3, ratio
  # The state stays split between steps, in the layout init gave it.
  mu = sharded.opt_state.value[0].mu["Dense_0"]["kernel"]
  assert mu.shape == (64, 32) and {s.data.shape for s in
                                    mu.addressable_shards} == {(16, 32)}
  batch = next(iter(strategy.experimental_distribute_dataset(batches[:1])))
  hlo = step.lower(sharded, batch).compile().as_text()
  assert "all-gather" in hlo
  assert ("reduce-scatter" in hlo) == own_grads


def test_trainer_shard_optimizer_state_fits_as_mirrored(digits_flat):
  x, y = digits_flat
  x, y = x[:512], y[:512]
  runs = {}
  for sharded in (False, True):
    trainer = jdist.Trainer(
        MODEL, optimizer=optax.inject_hyperparams(optax.adam)(
            learning_rate=1e-2),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], strategy=strategy_on(4),
        shard_optimizer_state=sharded)
    history = trainer.fit(x, y, batch_size=64, epochs=2, verbose=0)
    runs[sharded] = (trainer, history.history)
  (mirrored, m_hist), (sharded, s_hist) = runs[False], runs[True]
  np.testing.assert_allclose(s_hist["loss"], m_hist["loss"], rtol=1e-5)
  assert not jdist.testing.compare_trees(
      jax.device_get(mirrored.state.params),
      jax.device_get(sharded.state.params), rtol=1e-5, atol=1e-6)
  assert isinstance(sharded.state.opt_state, jdist.Sharded)
  assert (device_bytes(sharded.state.opt_state) <=
          0.3 * device_bytes(mirrored.state.opt_state))
  # Keras habits still read and set the learning rate in the sharded state.
  sharded.optimizer.learning_rate.assign(5e-3)
  assert float(sharded.optimizer.learning_rate) == pytest.approx(5e-3)


def test_a_4_device_checkpoint_resumes_on_2_devices(digits_flat, tmp_path):
  x, y = digits_flat
  x, y = x[:512], y[:512]

  def trainer_on(n):
    return jdist.Trainer(
        MODEL, optimizer=optax.adam(1e-2),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy_on(n), shard_optimizer_state=True)

  trainer = trainer_on(4)
  trainer.fit(x, y, batch_size=64, epochs=1, verbose=0,
              callbacks=[jdist.ModelCheckpoint(str(tmp_path / "ckpt"))])
  mu = trainer.state.opt_state.value[0].mu["Dense_0"]["kernel"]
  assert {s.data.shape for s in mu.addressable_shards} == {(16, 32)}
  # Restored by a trainer on 2 of the devices: each holds half the state.
  resumed = trainer_on(2)
  resumed.build(x)
  assert resumed.load_checkpoint(tmp_path / "ckpt") == 8
  mu2 = resumed.state.opt_state.value[0].mu["Dense_0"]["kernel"]
  assert {s.data.shape for s in mu2.addressable_shards} == {(32, 32)}
  assert len(mu2.addressable_shards) == 2
  np.testing.assert_array_equal(np.asarray(mu2), np.asarray(mu))
  resumed.fit(x, y, batch_size=64, epochs=1, verbose=0)
  assert resumed.global_step == 16


def _params():
  return {"Dense_0": {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros(32)},
          "head": {"kernel": jnp.zeros((32, 10)), "bias": jnp.zeros(10)}}


def test_layout_keeps_leaves_no_axis_of_which_splits_whole():
  strategy = strategy_on(4)
  tx = jdist.ShardedOptimizer(optax.sgd(0.1, momentum=0.9), strategy)
  assert tx.layout(_params()) == {"Dense_0": {"kernel": 0, "bias": 0},
                                  "head": {"kernel": 0, "bias": None}}
  state = tx.init(_params())
  trace = state.value[0].trace
  assert {s.data.shape for s in trace["head"]["bias"].addressable_shards} == {
      (10,)}


def test_an_indivisible_leaf_is_an_error_when_asked_not_to_mirror_it():
  tx = jdist.ShardedOptimizer(optax.adam(1e-3), strategy_on(4),
                              mirror_indivisible=False)
  with pytest.raises(jdist.ShardingError, match=r"\['head'\]\['bias'\] \(10,\)"):
    tx.init(_params())


def test_a_model_with_nothing_to_split_is_an_error():
  tx = jdist.ShardedOptimizer(optax.adam(1e-3), strategy_on(4))
  with pytest.raises(jdist.ShardingError, match=r"None of the parameters can "
                     r"be split over 4 replicas: \['b'\] \(\), \['w'\] \(3, 5\)"
                     r".*would save nothing. Use the optimizer itself") as e:
    tx.init({"w": jnp.zeros((3, 5)), "b": jnp.zeros(())})
  # Issue 20.6: it advised mirror_indivisible=True, already the default.
  assert "mirror_indivisible" not in str(e.value)


def _roll_sgd(learning_rate):
  """A user's update that is not elementwise: each element takes its
  neighbour's gradient (jnp.roll), as in a hand-written smoothing."""
  def update(grads, state, params=None):
    del params
    return jax.tree.map(lambda g: -learning_rate * jnp.roll(g, 1, axis=0),
                        grads), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update)


def _sign_sgd(learning_rate):
  """A user's elementwise update (signSGD with momentum): accepted."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, state, params=None):
    del params
    state = jax.tree.map(lambda m, g: 0.9 * m + g, state, grads)
    return jax.tree.map(lambda m: -learning_rate * jnp.sign(m), state), state
  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("optimizer, reason", [
    (optax.noisy_sgd(1e-2, key=jax.random.key(0)),
     r"it draws random numbers \(random_bits.*\): every replica would draw the "
     r"same numbers for its block"),
    (_roll_sgd(1e-2), r"it moves values between elements \(concatenate, slice\)"),
], ids=["noisy_sgd", "jnp.roll"])
def test_an_update_that_differs_on_blocks_is_refused_naming_the_leaf(
    optimizer, reason, digits_flat):
  """Issue 20.4: noisy_sgd drew the same noise in every replica's block
  (0.28 from mirrored training) and a jnp.roll update differed by 1.8, both
  silently. Now init runs the update on a small probe, whole and per
  block, and names the first parameter whose update differs, and why."""
  tx = jdist.ShardedOptimizer(optimizer, strategy_on(4))
  with pytest.raises(jdist.ShardingError, match=(
      r"cannot split this optimizer's state: on parameter \['Dense_0'\]"
      r"\['bias'\], its update on each replica's block differs from its "
      r"update on the whole leaf \(by up to [0-9.e-]+ on a small random "
      r"probe\): " + reason + r".*must be elementwise")):
    _train(strategy_on(4), tx, _batches(digits_flat, steps=1), own_grads=True)


def test_global_norm_clipping_is_refused_by_program_naming_the_leaf():
  """A probe whose norm is under the threshold would not clip: the program
  check refuses the reduction itself, as before."""
  tx = jdist.ShardedOptimizer(optax.chain(optax.clip_by_global_norm(1e6),
                                          optax.sgd(0.1)), strategy_on(4))
  with pytest.raises(jdist.ShardingError, match=(
      r"on parameter \['b'\], it combines elements of a parameter \("
      r".*reduce_sum.*\)")):
    tx.init({"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)})


# One optimizer per kind of state and update (adam, with its own gradients,
# is test_adam_on_4_replicas_..._state[zero2]): no state (sgd), one moment per
# parameter (momentum), moments and an update that reads the parameters
# (adamw; lion's is the same kind), a user's own GradientTransformation.
@pytest.mark.parametrize("make", [
    lambda: optax.sgd(0.1), lambda: optax.sgd(0.1, momentum=0.9),
    lambda: optax.adamw(1e-2), lambda: _sign_sgd(1e-3),
], ids=["sgd", "momentum", "adamw", "custom_sign_sgd"])
def test_elementwise_optimizers_are_accepted_and_train_as_mirrored(
    make, digits_flat):
  strategy = strategy_on(4)
  batches = _batches(digits_flat, steps=3)
  mirrored, m_losses, _ = _train(strategy, make(), batches, own_grads=False)
  sharded, s_losses, _ = _train(strategy, jdist.ShardedOptimizer(
      make(), strategy), batches, own_grads=True)
  problems = jdist.testing.compare_trees(
      jax.device_get(mirrored.params), jax.device_get(sharded.params),
      rtol=1e-5, atol=1e-6, names=("mirrored", "sharded"))
  assert not problems, "\n".join(problems)
  np.testing.assert_allclose(s_losses, m_losses, rtol=1e-5)


@pytest.mark.parametrize("optimizer", [
    optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    optax.lamb(1e-3),
    optax.adafactor(1e-3),
], ids=["clip_by_global_norm", "lamb", "adafactor"])
def test_an_optimizer_that_is_not_elementwise_is_refused(optimizer):
  tx = jdist.ShardedOptimizer(optimizer, strategy_on(4))
  with pytest.raises(jdist.ShardingError, match="must be elementwise"):
    tx.init({"w": jnp.zeros((256, 256))})


def test_trainer_refuses_a_coupling_optimizer_before_the_first_step(
    digits_flat):
  x, y = digits_flat
  trainer = jdist.Trainer(
      MODEL, optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                   optax.adam(1e-2)),
      loss="sparse_categorical_crossentropy", strategy=strategy_on(4),
      shard_optimizer_state=True)
  with pytest.raises(jdist.ShardingError, match="clip_by_global_norm"):
    trainer.fit(x[:64], y[:64], batch_size=64, verbose=0)
  assert trainer.global_step == 0


def test_state_of_another_replica_count_and_update_outside_a_step():
  params = {"w": jnp.zeros((8, 4))}
  four = jdist.ShardedOptimizer(optax.adam(1e-3), strategy_on(4))
  two = strategy_on(2)
  state = four.init(params)

  @two.function
  def step(params, state):
    updates, state = four.update(params, state, params)
    return optax.apply_updates(params, updates), state

  with pytest.raises(jdist.StrategyMismatchError):
    step(two.replicate(params), state)
  with pytest.raises(jdist.ReplicaContextError, match="inside a step"):
    four.update(params, state, params)


def test_a_loss_averaged_over_the_replica_batch_is_caught_with_zero2():
  strategy = strategy_on(4)
  tx = jdist.ShardedOptimizer(optax.sgd(0.1), strategy)
  params = strategy.replicate({"w": jnp.ones((8, 4))})
  opt_state = tx.init(params)

  @strategy.function
  def step(params, opt_state, x):
    # The mistake: a mean over this replica's batch, not the global one.
    _, grads = tx.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x = strategy.experimental_distribute_dataset([np.ones((16, 8), np.float32)])
  with pytest.raises(jdist.LossScalingError, match="this replica's batch"):
    step(params, opt_state, next(iter(x)))


def test_on_one_device_the_state_is_whole_and_training_the_same(digits_flat):
  one = strategy_on(1)
  batches = _batches(digits_flat, steps=5)
  tx = jdist.ShardedOptimizer(optax.adam(1e-2), one)
  sharded, s_losses, _ = _train(one, tx, batches, own_grads=True)
  plain, p_losses, _ = _train(one, optax.adam(1e-2), batches, own_grads=False)
  assert set(sharded.opt_state.axes) == {None}
  assert not jdist.testing.compare_trees(
      jax.device_get(plain.params), jax.device_get(sharded.params),
      rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(s_losses, p_losses, rtol=1e-6)


@pytest.mark.parametrize("kwargs, words", [
    (dict(dtype_policy="mixed_float16"), "'mixed_float16'"),
])
def test_combinations_not_supported_yet_fail_when_the_trainer_is_made(
    kwargs, words):
  with pytest.raises(ValueError, match=words):
    jdist.Trainer(MLP(), optimizer=optax.adam(1e-3),
                  loss=jdist.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  shard_optimizer_state=True, **kwargs)


def test_reading_the_step_functions_before_fit_keeps_the_state_sharded(
    digits_flat):
  """Issue 17: `train_function`, `test_function` and `optimizer` read before
  the first fit; `shard_optimizer_state=True` still holds, and training is
  that of a trainer nothing was read from."""
  x, y = digits_flat
  runs = []
  for read_first in (True, False):
    trainer = jdist.Trainer(
        MODEL, optimizer=optax.sgd(0.05, momentum=0.9),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy_on(4), shard_optimizer_state=True)
    if read_first:
      assert trainer.train_function is trainer.train_function
      assert trainer.test_function is not None
      assert isinstance(trainer.optimizer.transformation,
                        jdist.ShardedOptimizer)
    history = trainer.fit(x[:256], y[:256], batch_size=64, epochs=2,
                          verbose=0)
    runs.append((trainer, history.history))
  (trainer, history), (_, reference) = runs
  assert isinstance(trainer.state.opt_state, jdist.Sharded)
  trace = trainer.state.opt_state.value[0].trace["Dense_0"]["kernel"]
  assert {s.data.shape for s in trace.addressable_shards} == {(16, 32)}
  assert history["loss"] == reference["loss"]


def _trainer(n, *, sharded, policy="float32"):
  return jdist.Trainer(
      MODEL, optimizer=optax.adam(1e-2),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      strategy=strategy_on(n), shard_optimizer_state=sharded,
      dtype_policy=policy)


@pytest.mark.parametrize("saved_sharded,saved_on,loaded_on", [
    (True, 4, 4), (False, 4, 4), (True, 4, 1), (False, 2, 4)])
def test_sharded_and_mirrored_checkpoints_load_into_each_other(
    digits_flat, tmp_path, saved_sharded, saved_on, loaded_on):
  """A user turns sharding on for a bigger run, or off to evaluate."""
  x, y = digits_flat[0][:256], digits_flat[1][:256]
  saver = _trainer(saved_on, sharded=saved_sharded)
  saver.fit(x, y, batch_size=64, epochs=1, verbose=0,
            callbacks=[jdist.ModelCheckpoint(str(tmp_path / "ckpt"))])
  loader = _trainer(loaded_on, sharded=not saved_sharded)
  loader.build(x)
  assert loader.load_checkpoint(tmp_path / "ckpt") == 4
  unwrap = lambda s: s.value if isinstance(s, jdist.Sharded) else s
  saved_state = jax.device_get(unwrap(saver.state.opt_state))
  loaded_state = jax.device_get(unwrap(loader.state.opt_state))
  assert not jdist.testing.compare_trees(saved_state, loaded_state, rtol=0,
                                         atol=0)
  assert not jdist.testing.compare_trees(jax.device_get(saver.state.params),
                                         jax.device_get(loader.state.params),
                                         rtol=0, atol=0)
  assert isinstance(loader.state.opt_state, jdist.Sharded) == (
      not saved_sharded)
  # And it trains on from there like the run that saved it.
  saver.fit(x, y, batch_size=64, epochs=1, verbose=0)
  loader.fit(x, y, batch_size=64, epochs=1, verbose=0)
  assert not jdist.testing.compare_trees(
      jax.device_get(saver.state.params), jax.device_get(loader.state.params),
      rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_another_dtype_policy_says_so(digits_flat, tmp_path):
  x, y = digits_flat[0][:256], digits_flat[1][:256]
  saver = _trainer(2, sharded=False, policy="mixed_float16")
  saver.fit(x, y, batch_size=64, epochs=1, verbose=0,
            callbacks=[jdist.ModelCheckpoint(str(tmp_path / "ckpt"))])
  loader = _trainer(2, sharded=False)
  loader.build(x)
  with pytest.raises(jdist.CheckpointMismatchError,
                     match=r'dtype_policy="mixed_float16"'):
    loader.load_checkpoint(tmp_path / "ckpt")


def test_a_sharded_checkpoint_of_the_previous_format_still_loads(
    digits_flat, tmp_path):
  """tests/data/trainer_v2_sharded: written in checkpoint format 2 (sharded
  state named with one more level), 2 devices, MLP(hidden=8), one epoch."""
  import shutil
  source = os.path.join(ROOT, "tests", "data", "trainer_v2_sharded")
  shutil.copytree(source, tmp_path / "v2")  # a reader may tidy the directory
  expected = np.load(tmp_path / "v2" / "expected.npz")
  trainer = jdist.Trainer(
      MLP(hidden=8), optimizer=optax.adam(1e-2),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      strategy=strategy_on(2), shard_optimizer_state=True)
  trainer.build(digits_flat[0][:64])
  assert trainer.load_checkpoint(tmp_path / "v2" / "ckpt") == 2
  np.testing.assert_array_equal(
      np.asarray(trainer.state.opt_state.value[0].mu["Dense_0"]["kernel"]),
      expected["mu"])
  np.testing.assert_array_equal(
      np.asarray(trainer.state.params["Dense_0"]["kernel"]), expected["kernel"])
