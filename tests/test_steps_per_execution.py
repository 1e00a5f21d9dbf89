"""Many steps per dispatch: `Trainer(steps_per_execution=K)` and
`jdist.multi_step` in a custom loop give the results of one step per call."""

import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import CNN, MLP

from conftest import Interrupt, strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return x[:600], y[:600]  # 9 batches of 64 and one of 24


def make_trainer(k, n=2):
  return jdist.Trainer(MLP(), optimizer=optax.adam(1e-2), loss=LOSS,
                       metrics=["accuracy"], strategy=strategy_on(n), seed=0,
                       steps_per_execution=k)


def fit(trainer, data, callbacks=(), epochs=2):
  x, y = data
  return trainer.fit(x, y, batch_size=64, epochs=epochs, verbose=0,
                     callbacks=list(callbacks))


class Batches(jdist.Callback):
  """Records the batch numbers and global steps the hooks see."""

  def __init__(self):
    super().__init__()
    self.begin, self.end, self.steps = [], [], []

  def on_train_batch_begin(self, batch, logs=None):
    self.begin.append(batch)

  def on_train_batch_end(self, batch, logs=None):
    self.end.append(batch)
    self.steps.append(self.model.global_step)


@pytest.fixture(scope="module")
def one_step_run(data):
  trainer = make_trainer(1)
  return trainer, fit(trainer, data)


def assert_same_training(a, b, history_a, history_b, *, exact=False):
  assert a.global_step == b.global_step
  for key in history_a.history:
    np.testing.assert_allclose(history_a.history[key], history_b.history[key],
                               rtol=1e-5, err_msg=key)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    if exact:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                                 atol=1e-6)


def test_fit_with_steps_per_execution_trains_as_one_step_per_call(
    data, one_step_run):
  trainer, batches = make_trainer(4), Batches()
  history = fit(trainer, data, [batches])
  assert_same_training(trainer, one_step_run[0], history, one_step_run[1])
  assert int(trainer.state.step) == 20
  # Keras calls per-batch hooks once per execution: begin with the first
  # batch of the group, end with its last. 10 batches: groups of 4, 4, 2.
  assert batches.begin == [0, 4, 8] * 2
  assert batches.end == [3, 7, 9] * 2
  assert batches.steps == [4, 8, 10, 14, 18, 20]
  # The shorter last group compiles once more, and only once.
  assert trainer.train_function.num_compilations == 2


def test_custom_loop_multi_step_equals_one_step_per_call():
  strategy = strategy_on(2)
  rng = np.random.default_rng(0)
  data = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(6)]
  data.append(rng.normal(size=(5, 3)).astype(np.float32))  # padded, masked
  tx = optax.sgd(0.1)

  @strategy.function
  def step(state, batch):
    w, opt = state
    loss = lambda w: jdist.compute_average_loss((batch @ w - 1.0) ** 2)
    value, grad = jax.value_and_grad(loss)(w)
    updates, opt = tx.update(grad, opt, w)
    return (optax.apply_updates(w, updates), opt), value, batch * 2

  init = strategy.replicate((jnp.ones(3), tx.init(jnp.ones(3))))
  state, losses, doubled = init, [], []
  for batch in strategy.experimental_distribute_dataset(data):
    state, loss, out = step(state, batch)
    losses.append(float(strategy.reduce("sum", loss)))
    doubled.append(strategy.gather(out))
  run = jdist.multi_step(step)
  multi, multi_losses = init, []
  for epoch in range(2):  # the second epoch compiles nothing new
    multi, multi_losses = init, []
    for group in strategy.experimental_distribute_dataset(data).group(3):
      multi, loss, out = run(multi, group)
      multi_losses.extend(np.asarray(strategy.reduce("sum", loss)).tolist())
  np.testing.assert_allclose(multi_losses, losses, rtol=1e-6)
  np.testing.assert_allclose(multi[0], state[0], rtol=1e-6)
  # Per-step outputs come back stacked after the replica axis.
  assert out.values.shape == (2, 1, 4, 3)
  np.testing.assert_allclose(out.values.reshape(8, 3)[:5], doubled[-1])
  assert run.num_compilations == 2  # groups of 3 and the last of 1


def test_multi_step_of_a_cnn_keeps_its_convolutions_fast_on_cpu():
  """A CNN's steps in one multi-step call train as one call per batch, and
  every convolution of the compiled loop is in the (batch, spatial,
  features) x (spatial, in, out) order XLA's CPU backend runs with its
  library kernels: autodiff's convolutions come in other orders, which XLA
  reorders only outside loops (inside one: a plain loop nest, ~30x slower)."""
  strategy = strategy_on(2)
  model = CNN()
  rng = np.random.default_rng(0)
  data = [{"x": rng.standard_normal((16, 8, 8, 1)).astype(np.float32),
           "y": rng.integers(0, 10, 16).astype(np.int32)} for _ in range(2)]

  @strategy.function
  def step(params, batch):
    def loss(p):
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(
              model.apply({"params": p}, batch["x"]), batch["y"]))
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  init = strategy.replicate(
      model.init(jax.random.key(0), data[0]["x"])["params"])
  params = init
  for batch in strategy.experimental_distribute_dataset(data):
    params, _ = step(params, batch)
  run = jdist.multi_step(step)
  (group,) = strategy.experimental_distribute_dataset(data).group(2)
  compiled = run.lower(init, group).compile()
  multi, _ = compiled(init, group)
  for a, b in zip(jax.tree.leaves(multi), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  hlo = compiled.as_text()
  assert re.search(r"\bwhile\(", hlo)
  labels = re.findall(r"\bconvolution\(.*?dim_labels=([\w>-]+)", hlo)
  assert len(labels) >= 5  # 2 forward, 2 kernel gradients, 1 input gradient
  assert set(labels) == {"b01f_01io->b01f"}, labels


def test_multi_step_refuses_what_it_cannot_run():
  strategy = strategy_on(2)
  data = [np.ones((4, 2), np.float32)] * 2

  @strategy.function
  def mean_only(w, batch):
    return jnp.mean(batch)

  w = strategy.replicate(jnp.ones(2))
  group = next(iter(strategy.experimental_distribute_dataset(data).group(2)))
  with pytest.raises(TypeError, match="new values of its arguments"):
    jdist.multi_step(mean_only)(w, group)
  with pytest.raises(TypeError, match="pass the group to jdist.multi_step"):
    mean_only(w, group)
  with pytest.raises(TypeError, match="strategy.function"):
    jdist.multi_step(lambda w, b: w)
  with pytest.raises(ValueError, match="steps_per_execution must be at least"):
    make_trainer(0)


class Preempt(jdist.Callback):
  """Sends this process SIGTERM at the end of the execution ending at `at`."""

  def __init__(self, at):
    super().__init__()
    self.at = at

  def on_train_batch_end(self, batch, logs=None):
    if self.model.global_step == self.at:
      os.kill(os.getpid(), signal.SIGTERM)


def test_backups_at_group_boundaries_resume_exactly(data, tmp_path):
  reference = make_trainer(4)
  ref_history = fit(reference, data)
  # Steps run 4, 8, 10 | 14, 18, 20: every 5 steps is saved at the end of
  # the execution that reaches it (8, 10 and 18, as Keras does).
  saved = []

  class Saves(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      saved.append(sorted(int(d) for d in os.listdir(tmp_path / "a")
                          if d.isdigit()))

  trainer = make_trainer(4)
  with pytest.raises(KeyboardInterrupt):
    fit(trainer, data, [jdist.BackupAndRestore(tmp_path / "a", save_freq=5,
                                               max_to_keep=5), Saves(),
                        Interrupt(18)])
  assert saved[-1] == [8, 10, 18]
  shutil_steps = sorted(int(d) for d in os.listdir(tmp_path / "a")
                        if d.isdigit())
  assert shutil_steps == [8, 10, 18]
  backup = jdist.BackupAndRestore(tmp_path / "a", save_freq=5)
  resumed = make_trainer(4)
  history = fit(resumed, data, [backup])
  assert backup.restored_step == 18
  assert_same_training(resumed, reference, history, ref_history, exact=True)

  # Preemption (SIGTERM) saves where the execution ends and exits; the
  # relaunch finishes exactly.
  preempted = make_trainer(4)
  with pytest.raises(SystemExit) as stop:
    fit(preempted, data, [Preempt(14), jdist.BackupAndRestore(tmp_path / "b")])
  assert stop.value.code == 0
  backup = jdist.BackupAndRestore(tmp_path / "b")
  resumed = make_trainer(4)
  history = fit(resumed, data, [backup])
  assert backup.restored_step == 14
  assert_same_training(resumed, reference, history, ref_history, exact=True)
