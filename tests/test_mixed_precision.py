"""Mixed precision: Keras' policies in the Trainer and in custom loops.

float32 master weights, low-precision computation, float32 loss; dynamic loss
scaling for float16 that skips overflowing steps. Tolerances are stated where
they are used: low precision changes the numbers, not the training.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.data import batches
from jdist.examples.models import CNN, MLP

from conftest import Interrupt, strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)
# Per-epoch training loss of a mixed policy against float32 on the seed CNN
# (digits, 3 epochs): within 5% + 0.01. Seen: under 1.5% for both policies.
CURVE_RTOL, CURVE_ATOL = 0.05, 0.01


def fit_cnn(policy, x, y, *, n=2, epochs=3, optimizer=None, **kwargs):
  trainer = jdist.Trainer(CNN(), optimizer=optimizer or optax.adam(1e-3),
                          loss=LOSS, metrics=["accuracy"],
                          strategy=strategy_on(n), dtype_policy=policy,
                          **kwargs)
  history = trainer.fit(x, y, batch_size=64, epochs=epochs, verbose=0)
  return trainer, history


@pytest.fixture(scope="module")
def float32_run(digits):
  x, y = digits
  return fit_cnn("float32", x[:1000], y[:1000])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_loss_curve_follows_float32(policy, digits, float32_run):
  x, y = digits
  trainer, history = fit_cnn(policy, x[:1000], y[:1000])
  _, reference = float32_run
  np.testing.assert_allclose(history.history["loss"],
                             reference.history["loss"], rtol=CURVE_RTOL,
                             atol=CURVE_ATOL)
  assert history.history["loss"][-1] < history.history["loss"][0] / 3
  # Master weights and optimizer state stay float32.
  for leaf in jax.tree.leaves((trainer.state.params, trainer.state.opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  if policy == "mixed_float16":
    assert history.history["skipped_steps"] == [0.0, 0.0, 0.0]
    assert history.history["loss_scale"][-1] == 2.0 ** 15
  else:
    assert "skipped_steps" not in history.history


@pytest.mark.parametrize("policy,dtype", [("mixed_bfloat16", jnp.bfloat16),
                                          ("mixed_float16", jnp.float16),
                                          ("float32", jnp.float32)])
def test_the_model_computes_in_the_policys_dtype(policy, dtype, digits_flat):
  """An apply function sees parameters and inputs in the compute dtype while
  the trainer keeps float32 parameters."""
  x, y = digits_flat
  model = MLP()
  params = model.init(jax.random.key(0), x[:1])["params"]
  seen = set()

  def apply_fn(params, x):
    seen.update(str(leaf.dtype) for leaf in jax.tree.leaves((params, x)))
    return model.apply({"params": params}, x)

  trainer = jdist.Trainer(apply_fn, params=params, optimizer=optax.adam(1e-3),
                          loss=LOSS, strategy=strategy_on(2),
                          dtype_policy=policy)
  trainer.fit(x[:128], y[:128], batch_size=64, verbose=0)
  assert seen == {jnp.dtype(dtype).name}
  assert {leaf.dtype for leaf in jax.tree.leaves(trainer.params)} == {
      jnp.dtype(jnp.float32)}


def _residual_bytes(policy, model, params, x, y):
  """Bytes the step keeps from the forward pass for the backward pass (the
  activation memory): the residuals held by `jax.vjp`'s backward function."""
  policy = jdist.DTypePolicy(policy)

  def loss_fn(p):
    logits = model.apply({"params": policy.cast_to_compute(p)},
                         policy.cast_to_compute(x))
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        policy.cast_to_variable(logits), y)
    return jnp.mean(per_example)

  backward = jax.eval_shape(lambda p: jax.vjp(loss_fn, p)[1], params)
  return sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize
             for r in jax.tree.leaves(backward))


def test_activation_memory_is_at_most_0_6_of_float32(digits):
  x, y = digits
  x, y = jnp.asarray(x[:256]), jnp.asarray(y[:256])
  model = CNN()
  params = model.init(jax.random.key(0), x[:1])["params"]
  full = _residual_bytes("float32", model, params, x, y)
  for policy in ("mixed_bfloat16", "mixed_float16"):
    ratio = _residual_bytes(policy, model, params, x, y) / full
    assert ratio <= 0.6, (policy, ratio)


def test_overflowing_float16_step_is_skipped_and_training_goes_on(digits):
  """A custom loop on 2 replicas with the public pieces: a batch that
  overflows float16 is skipped (parameters and adam state unchanged), the
  scale halves, the next batches train."""
  x, y = digits
  data = batches(x[:320], y[:320], 64)
  data[2] = {"x": data[2]["x"] * 1e5, "y": data[2]["y"]}  # overflows float16
  policy = jdist.DTypePolicy("mixed_float16")
  model = MLP()
  tx = jdist.loss_scale_optimizer(optax.adam(1e-2))
  flat = lambda b: {"x": b["x"].reshape(len(b["x"]), -1), "y": b["y"]}
  data = [flat(b) for b in data]
  params = model.init(jax.random.key(0), data[0]["x"])["params"]

  def step(state, batch):
    params, opt_state = state

    def loss_fn(p):
      logits = model.apply({"params": policy.cast_to_compute(p)},
                           policy.cast_to_compute(batch["x"]))
      per_example = optax.softmax_cross_entropy_with_integer_labels(
          policy.cast_to_variable(logits), batch["y"])
      return opt_state.loss_scale.scale_loss(
          jdist.compute_average_loss(per_example))

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), None

  strategy = strategy_on(2)
  run = strategy.function(step)
  state = strategy.replicate((params, tx.init(params)))
  seen = []
  for batch in strategy.experimental_distribute_dataset(data):
    state, _ = run(state, batch)
    seen.append(jax.tree.map(np.asarray, state))
  scales = [float(s[1].loss_scale.scale) for s in seen]
  skipped = [int(s[1].skipped_steps) for s in seen]
  assert scales == [2.0 ** 15, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 14]
  assert skipped == [0, 0, 1, 1, 1]
  before, after = seen[1], seen[2]  # the overflowing step changed nothing
  for a, b in zip(jax.tree.leaves((before[0], before[1].inner.inner_state)),
                  jax.tree.leaves((after[0], after[1].inner.inner_state))):
    np.testing.assert_array_equal(a, b)
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), seen[3][0],
                       seen[4][0])
  assert all(np.isfinite(m) and m > 0 for m in jax.tree.leaves(moved))


def test_fit_reports_skipped_steps_of_a_scale_that_starts_too_high(digits):
  """A loss scale of 2**40 overflows float16 gradients: fit skips those
  steps, halves the scale until it fits, logs both, and still learns."""
  x, y = digits
  tx = jdist.loss_scale_optimizer(optax.adam(1e-3), initial_scale=2.0 ** 40)
  trainer, history = fit_cnn("mixed_float16", x[:1536], y[:1536], epochs=2,
                             optimizer=tx)
  skipped = history.history["skipped_steps"]
  scale = history.history["loss_scale"]
  assert skipped[0] >= 1
  assert scale[0] == 2.0 ** (40 - skipped[0])  # halved once per skip
  assert skipped[1] - skipped[0] < 24  # epoch 2 (24 steps) mostly trains
  assert history.history["loss"][-1] < history.history["loss"][0] / 2
  assert trainer.optimizer.iterations == 48


def test_mixed_bfloat16_step_matches_one_device(digits_flat):
  """The same bfloat16 step on 4 replicas and on one device (the float32
  gradient reduction only changes the order of a sum; 2 replicas run the
  same program with larger shards)."""
  x, y = digits_flat
  data = batches(x[:360], y[:360], 64)  # a padded last batch
  policy = jdist.DTypePolicy("mixed_bfloat16")
  model = MLP()
  params = model.init(jax.random.key(0), data[0]["x"])["params"]

  def step(params, batch):
    def loss_fn(p):
      logits = model.apply({"params": policy.cast_to_compute(p)},
                           policy.cast_to_compute(batch["x"]))
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(
              policy.cast_to_variable(logits), batch["y"]))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

  strategy = strategy_on(4)
  # bfloat16 keeps 8 bits of mantissa: a gradient rounded to bfloat16 on a
  # 64-row batch and on 16- or 32-row shards differs by ~0.4% per rounding,
  # which 6 steps of SGD at 0.5 turn into up to ~2e-3 in the weights.
  jdist.testing.assert_equivalent(step, params, data, strategy=strategy,
                                  rtol=2e-2, atol=5e-3)


def test_trainer_mixed_precision_with_accumulation_matches_one_device(
    digits_flat):
  """mixed_bfloat16 and K=2 batches of 32 on 4 replicas against one device
  with batches of 64: the losses, and the parameters and momentum (SGD,
  which a wrong gradient scale cannot hide behind as it can behind adam)."""
  x, y = digits_flat
  runs = []
  for n, k in ((1, 1), (4, 2)):
    trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.1, momentum=0.9),
                            loss=LOSS, strategy=strategy_on(n),
                            dtype_policy="mixed_bfloat16",
                            gradient_accumulation_steps=k)
    history = trainer.fit(x[:360], y[:360], batch_size=64 // k, epochs=2,
                          verbose=0, shuffle=False).history["loss"]
    runs.append((history, trainer.state.params, trainer.state.opt_state))
  (h1, *state1), (h4, *state4) = runs
  assert h4[1] < h4[0]  # it learned
  # bfloat16 rounds a 64-row batch's and a 8-row micro-batch's products
  # differently (8 bits of mantissa): about 0.4% per rounding.
  np.testing.assert_allclose(h4, h1, rtol=2e-3)
  for a, b in zip(jax.tree.leaves(state4), jax.tree.leaves(state1)):
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("policy,error,match", [
    ("mixed_float32", ValueError, "Unknown dtype policy 'mixed_float32'"),
    ("bfloat16", ValueError, "mixed_bfloat16"),
    (16, TypeError, "dtype_policy must be"),
])
def test_unknown_policy_fails_when_the_trainer_is_made(policy, error, match):
  with pytest.raises(error, match=match):
    jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), loss=LOSS,
                  dtype_policy=policy)


def test_loss_scale_state_round_trips_through_jit():
  tx = jdist.loss_scale_optimizer(optax.adam(1e-3), initial_scale=4.0,
                                  dynamic_growth_steps=3)
  state = tx.init({"w": jnp.ones(3)})
  same = jax.jit(lambda s: s)(state)
  assert isinstance(same, jdist.LossScaleState)
  assert same.loss_scale.growth_steps == 3
  assert float(same.loss_scale.scale) == 4.0
  grads = {"w": jnp.ones(3)}
  for _ in range(3):
    _, state = jax.jit(tx.update)(grads, state, {"w": jnp.ones(3)})
  assert float(state.loss_scale.scale) == 8.0  # grew after 3 finite steps
  assert int(state.loss_scale.good_steps) == 0


def test_a_loss_scaled_run_resumes_exactly_from_its_backup(digits_flat,
                                                            tmp_path):
  """mixed_float16 with a scale that starts too high (steps skipped, the
  scale halved) and grows every 3 finite steps (into overflow again): the
  scale, its growth counter and the skipped steps are part of the backup,
  and the resumed run's state equals the uninterrupted one's bit for bit."""
  x, y = digits_flat
  x, y = x[:512], y[:512]

  def run(callbacks):
    tx = jdist.loss_scale_optimizer(optax.adam(1e-3), initial_scale=2.0 ** 26,
                                    dynamic_growth_steps=3)
    trainer = jdist.Trainer(MLP(), optimizer=tx, loss=LOSS,
                            strategy=strategy_on(2), seed=0,
                            dtype_policy="mixed_float16")
    history = trainer.fit(x, y, batch_size=64, epochs=3, verbose=0,
                          callbacks=callbacks)
    return trainer, history

  reference, ref_history = run([])
  skipped = ref_history.history["skipped_steps"]
  # The case under test: steps skipped before the backup and after it (the
  # scale grows into overflow every few steps).
  assert skipped[0] >= 1 and skipped[-1] > skipped[1]
  backup = tmp_path / "backup"
  with pytest.raises(KeyboardInterrupt):
    run([Interrupt(11), jdist.BackupAndRestore(backup, save_freq=5)])
  restore = jdist.BackupAndRestore(backup, save_freq=5)
  trainer, history = run([restore])
  assert restore.restored_step == 10  # mid-epoch 2, a state saved mid-run
  # The scale and the skipped steps exactly; the epochs' mean losses within
  # float rounding: resumed mid-epoch 2, the first replica carries the sums
  # of the batches before the backup, so epoch 2's sum over the replicas adds
  # the same numbers in another order.
  assert {k: v for k, v in history.history.items() if k != "loss"} == {
      k: v for k, v in ref_history.history.items() if k != "loss"}
  np.testing.assert_allclose(history.history["loss"],
                             ref_history.history["loss"], rtol=1e-6)
  ref_state, state = reference.state.opt_state, trainer.state.opt_state
  assert isinstance(state, jdist.LossScaleState)
  for a, b in zip(jax.tree.leaves((reference.state.params, ref_state)),
                  jax.tree.leaves((trainer.state.params, state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(state.skipped_steps) == skipped[-1]
  assert float(state.loss_scale.scale) == ref_history.history["loss_scale"][-1]


def test_a_long_overflow_run_leaves_the_scale_at_one_and_clean_data_trains():
  """Issue 20.1: 200 batches with NaN, then clean ones, through a custom loop
  on 4 devices. The scale halves to its floor of 1 (TensorFlow's rule; it
  used to reach 0.0, after which every step was skipped), the clean batches
  train exactly as they do without loss scaling on one device, and the
  scale grows again."""
  strategy = strategy_on(4)
  tx = jdist.loss_scale_optimizer(optax.sgd(0.05, momentum=0.9),
                                  dynamic_growth_steps=10)
  rng = np.random.default_rng(0)
  w_true = np.array([1.0, -2.0, 0.5], np.float32)

  def batch(nan):
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = x @ w_true
    if nan:
      x[rng.integers(8), rng.integers(3)] = np.nan
    return {"x": x, "y": y}

  nan_batches = [batch(True) for _ in range(200)]
  clean = [batch(False) for _ in range(20)]

  def loss_fn(w, b):  # float16 compute, float32 loss
    pred = (b["x"].astype(jnp.float16) @ w.astype(jnp.float16))
    return (pred.astype(jnp.float32) - b["y"]) ** 2

  @strategy.function
  def train_step(w, opt_state, b):
    grads = jax.grad(lambda w: opt_state.loss_scale.scale_loss(
        jdist.compute_average_loss(loss_fn(w, b))))(w)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state

  w0 = jnp.zeros(3)
  w, state = strategy.replicate(w0), strategy.replicate(tx.init(w0))
  for b in strategy.experimental_distribute_dataset(nan_batches):
    w, state = train_step(w, state, b)
  assert float(state.loss_scale.scale) == 1.0
  assert bool(state.at_floor) and bool(state.last_step_skipped)
  assert int(state.skipped_steps) == int(state.consecutive_skipped_steps) == 200
  np.testing.assert_array_equal(np.asarray(w), np.zeros(3))
  for b in strategy.experimental_distribute_dataset(clean):
    w, state = train_step(w, state, b)
  assert int(state.skipped_steps) == 200
  assert int(state.consecutive_skipped_steps) == 0
  assert not bool(state.last_step_skipped)
  assert float(state.loss_scale.scale) == 4.0  # grown after 10 and 20

  # The same clean batches on one device, without loss scaling.
  plain = optax.sgd(0.05, momentum=0.9)
  ref_w, ref_state = w0, plain.init(w0)
  for b in clean:
    grads = jax.grad(lambda w: loss_fn(w, b).mean())(ref_w)
    updates, ref_state = plain.update(grads, ref_state, ref_w)
    ref_w = optax.apply_updates(ref_w, updates)
  assert np.abs(np.asarray(ref_w)).max() > 0.5  # it trained
  # float16 products summed over 2 rows per replica vs 8 on one device:
  # the order of float16 roundings differs, nothing else.
  np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=2e-3,
                             atol=2e-3)


def _fit_mlp_float16(digits_flat, *, read_first: bool):
  x, y = digits_flat
  trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.05, momentum=0.9),
                          loss=LOSS, strategy=strategy_on(2),
                          dtype_policy="mixed_float16")
  if read_first:  # Keras users read these before training
    assert trainer.train_function is trainer.train_function
    assert trainer.test_function is not None
    assert trainer.optimizer.iterations == 0
  history = trainer.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0)
  return trainer, history.history


def test_reading_the_step_functions_before_fit_keeps_loss_scaling(
    digits_flat):
  """Issue 17: `train_function`, `test_function` and `optimizer` read before
  the first fit under "mixed_float16" (once they fixed an optimizer without
  loss scaling, silently). Training scales the loss all the same."""
  trainer, history = _fit_mlp_float16(digits_flat, read_first=True)
  _, reference = _fit_mlp_float16(digits_flat, read_first=False)
  assert history["loss_scale"] == [2.0 ** 15, 2.0 ** 15]
  assert history["skipped_steps"] == [0.0, 0.0]
  assert isinstance(trainer.state.opt_state, jdist.LossScaleState)
  assert history["loss"] == reference["loss"]
  assert trainer.optimizer.iterations == 8


def test_a_hand_rebuilt_loss_scaled_optimizer_is_not_scaled_twice(
    digits_flat):
  """A loss-scaled optimizer rebuilt by hand (its state a LossScaleState, its
  type not `loss_scale_optimizer`'s) would be wrapped a second time by
  "mixed_float16": the trainer says so before the first step."""
  x, y = digits_flat
  scaled = jdist.loss_scale_optimizer(optax.sgd(0.1))
  rebuilt = optax.GradientTransformation(scaled.init, scaled.update)
  trainer = jdist.Trainer(MLP(), optimizer=rebuilt, loss=LOSS,
                          strategy=strategy_on(2),
                          dtype_policy="mixed_float16")
  with pytest.raises(ValueError, match="scales the loss already"):
    trainer.fit(x[:64], y[:64], batch_size=32, verbose=0)
  assert trainer.global_step == 0
  # loss_scale_optimizer's own result is used as it is.
  trainer = jdist.Trainer(MLP(), optimizer=scaled, loss=LOSS,
                          strategy=strategy_on(2),
                          dtype_policy="mixed_float16")
  history = trainer.fit(x[:64], y[:64], batch_size=32, verbose=0)
  assert history.history["loss_scale"] == [2.0 ** 15]


def _fit_after(first, clean, x_test, y_test):
  trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.05, momentum=0.9),
                          loss=LOSS, metrics=["accuracy"],
                          strategy=strategy_on(4),
                          dtype_policy="mixed_float16")
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    first_history = trainer.fit(first, epochs=1, verbose=0).history
  later = trainer.fit(clean, epochs=3, verbose=0).history  # no warning here
  accuracy = trainer.evaluate(x_test, y_test, batch_size=64)["accuracy"]
  return first_history, later, accuracy, [str(w.message) for w in seen]


def test_a_long_nan_run_through_fit_is_named_and_training_recovers(
    digits_flat):
  """Issue 20.1 through `fit` on 4 devices under "mixed_float16": 40 batches
  with a NaN, then clean ones. The scale halves to its floor of 1 (15
  steps) and stays there; fit warns once, naming the skipped batches; the
  clean batches then train as well as a run that never saw the NaNs."""
  x, y = digits_flat
  clean = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 1376, 32)]
  poisoned = []
  for bx, by in clean[:40]:
    bx = bx.copy()
    bx[3, 5] = np.nan
    poisoned.append((bx, by))
  x_test, y_test = x[1400:], y[1400:]
  first, later, accuracy, messages = _fit_after(poisoned + clean, clean,
                                                x_test, y_test)
  assert first["skipped_steps"] == [40.0] and first["loss_scale"] == [1.0]
  assert later["skipped_steps"][-1] == 40.0  # none of the clean steps
  floor = [m for m in messages if "at its floor" in m]
  assert len(floor) == 1, messages
  assert "Epoch 1: 40 training step(s) were skipped" in floor[0]
  assert "epoch 1, as on_train_batch_end gets them): 0-39." in floor[0]
  _, _, reference, clean_messages = _fit_after(clean, clean, x_test, y_test)
  assert clean_messages == []
  assert reference > 0.8
  assert abs(accuracy - reference) < 0.03, (accuracy, reference)


def test_skipped_batches_are_named_within_executions_of_several_steps(
    digits_flat):
  """With steps_per_execution=4 a call runs 4 batches: a call of which only
  some steps were skipped is named as such; whole runs as ranges."""
  x, y = digits_flat
  data = []
  for k, i in enumerate(range(0, 1376, 32)):
    bx = x[i:i + 32].copy()
    if k < 40 and k != 21:
      bx[3, 5] = np.nan
    data.append((bx, y[i:i + 32]))
  trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.05), loss=LOSS,
                          strategy=strategy_on(4),
                          dtype_policy="mixed_float16", steps_per_execution=4)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    history = trainer.fit(data, epochs=1, verbose=0).history
  assert history["skipped_steps"] == [39.0]
  floor = [str(w.message) for w in seen if "at its floor" in str(w.message)]
  assert len(floor) == 1
  assert "them): 0-19, 20-23 (3 of 4 skipped), 24-39." in floor[0]
