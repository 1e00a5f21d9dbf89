"""Gradient accumulation: K micro-batches, one all-reduce, the big batch's step.

Custom loops call `jdist.accumulate_gradients` inside their step; the Trainer
takes `micro_batches=K` (its `gradient_accumulation_steps`, Keras' meaning,
is tested in test_accumulation_fit.py). Both must train exactly as one step on
the whole batch does (a padded last batch included) and reduce gradients over
replicas once per optimizer step, which the compiled program shows.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.data import batches
from jdist.examples.models import CNN, MLP

from conftest import strategy_on

STRATEGIES = {
    "default": jdist.get_strategy,
    "one_device": lambda: jdist.OneDeviceStrategy("cpu:1"),
    "mirrored_2": lambda: strategy_on(2),
    "mirrored_4": lambda: strategy_on(4),
    "multi_worker": jdist.MultiWorkerMirroredStrategy,
}


def sgd_step(model, k_on_many, k_on_one=1):
  """A user's step: accumulates over `k_on_many` micro-batches when it runs
  on several replicas and over `k_on_one` on one device, so that
  `assert_equivalent` compares K micro-batches with the big batch."""

  def step(params, batch):
    ctx = jdist.get_replica_context()
    k = k_on_many if ctx.num_replicas_in_sync > 1 else k_on_one

    def loss_fn(p, b):
      logits = model.apply({"params": p}, b["x"], train=True,
                           rngs={"dropout": jax.random.key(3)})
      per_example = optax.softmax_cross_entropy_with_integer_labels(
          logits, b["y"])
      return jdist.compute_average_loss(per_example), logits

    (loss, logits), grads = jdist.accumulate_gradients(
        loss_fn, params, batch, num_micro_batches=k, has_aux=True)
    new = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    return new, {"loss": loss, "logits": logits.reshape(-1, 10)}

  return step


@pytest.fixture(scope="module")
def uneven(digits_flat):
  x, y = digits_flat
  # 5 batches of 64 and a last batch of 40: padded, its micro-batches are
  # partly or wholly padding (on 2 replicas: 32 + 8 valid rows).
  return batches(x[:360], y[:360], 64)


def test_four_micro_batches_on_two_replicas_equal_the_big_batch(uneven):
  model = MLP()
  params = model.init(jax.random.key(0), uneven[0]["x"])["params"]
  out = jdist.testing.assert_equivalent(sgd_step(model, 4), params, uneven,
                                        strategy=strategy_on(2), rtol=1e-5,
                                        atol=1e-6)
  assert len(out.outputs) == 6
  assert out.outputs[-1]["loss"] < out.outputs[0]["loss"]  # it learned


def test_dropout_draws_the_big_batchs_masks(digits):
  """`jdist.dropout` keys each example by its place in the step's batch, so
  micro-batches draw what the whole batch draws (float64: no noise)."""
  x, y = digits
  with jax.enable_x64(True):
    data = batches(x[:128].astype(np.float64), y[:128], 64)
    model = CNN(dropout_rate=0.5, param_dtype=jnp.float64)
    params = model.init(jax.random.key(0), data[0]["x"])["params"]
    jdist.testing.assert_equivalent(sgd_step(model, 2), params, data,
                                    strategy=strategy_on(4), rtol=1e-9,
                                    atol=1e-11)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_matches_the_big_batch_on_one_device(name, uneven):
  """K=2 on each strategy (one replica included) against one device's plain
  steps on the whole batches: final parameters and every step's outputs."""
  model = MLP()
  params = model.init(jax.random.key(0), uneven[0]["x"])["params"]
  reference = jdist.testing.run_training(
      jdist.OneDeviceStrategy("cpu:0"), sgd_step(model, 1), params, uneven)
  got = jdist.testing.run_training(STRATEGIES[name](), sgd_step(model, 2, 2),
                                   params, uneven)
  problems = jdist.testing.compare_trees(
      (reference.state, reference.outputs), (got.state, got.outputs),
      rtol=1e-5, atol=1e-6)
  assert not problems, problems


def _computations(hlo: str) -> dict:
  """`{name: body text}` of every computation in an HLO module's text."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name, lines = head.group(1), []
    elif line.startswith("}") and name is not None:
      out[name] = "\n".join(lines)
      name = None
    elif name is not None:
      lines.append(line)
  return out


def _all_reduces(hlo: str) -> tuple[int, int]:
  """(all-reduces in the program, all-reduces inside while-loop bodies)."""
  comps = _computations(hlo)
  count = lambda text: len(re.findall(r"\ball-reduce(?:-start)?\(", text))
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  return (sum(count(t) for t in comps.values()),
          sum(count(comps.get(b, "")) for b in bodies))


def test_one_all_reduce_per_optimizer_step(uneven):
  """The compiled step reduces once, after the micro-batches' loop, as many
  all-reduces as the step without accumulation; a scan of plain
  `jax.value_and_grad` (the mistake this avoids) reduces inside the loop."""
  model = MLP()
  params = model.init(jax.random.key(0), uneven[0]["x"])["params"]
  strategy = strategy_on(2)
  batch = next(iter(strategy.experimental_distribute_dataset(uneven)))
  placed = strategy.replicate(params)

  def loss_fn(p, b):
    per = optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, b["x"]), b["y"])
    return jdist.compute_average_loss(per)

  def compiled(step):
    return jax.jit(strategy.function(step)).lower(
        placed, batch).compile().as_text()

  def accumulated(k):
    return lambda p, b: jdist.accumulate_gradients(
        loss_fn, p, b, num_micro_batches=k)[1]

  def naive(p, b):  # what a hand-written scan does: K reductions
    micro = jax.tree.map(lambda x: x.reshape((4, -1) + x.shape[1:]), b)
    def micro_loss(p, mb):
      return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
          model.apply({"params": p}, mb["x"]), mb["y"])) / 64
    def body(acc, mb):
      g = jax.grad(micro_loss)(p, mb)
      return jax.tree.map(jnp.add, acc, g), None
    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), micro)[0]

  plain_total, _ = _all_reduces(compiled(accumulated(1)))
  total, in_loop = _all_reduces(compiled(accumulated(4)))
  assert plain_total >= 1
  assert (total, in_loop) == (plain_total, 0)
  naive_total, naive_in_loop = _all_reduces(compiled(naive))
  assert naive_in_loop >= 1


def test_convolutions_in_the_micro_batches_loop_run_fast_on_cpu():
  """A CNN's K=4 gradients on 2 replicas equal the whole batch's, and every
  convolution of the compiled step, those in the micro-batches' loop too, is
  in the (batch, spatial, features) x (spatial, in, out) order XLA's CPU
  backend runs with its library kernels; any other order inside a loop is
  compiled as a plain loop nest, ~30x slower (autodiff's convolutions come in
  other orders: only the program's top level is reordered by the compiler).
  Under `jax.checkpoint` too, whose backward pass holds the convolutions."""
  model = CNN()
  rng = np.random.default_rng(0)
  data = {"x": rng.standard_normal((32, 8, 8, 1)).astype(np.float32),
          "y": rng.integers(0, 10, 32).astype(np.int32)}
  strategy = strategy_on(2)
  batch = next(iter(strategy.experimental_distribute_dataset([data])))
  params = strategy.replicate(
      model.init(jax.random.key(0), data["x"])["params"])

  def step(k, remat):
    apply = lambda p, x: model.apply({"params": p}, x)
    apply = jax.checkpoint(apply) if remat else apply

    def loss_fn(p, b):
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(
              apply(p, b["x"]), b["y"]))

    return strategy.function(lambda p, b: jdist.accumulate_gradients(
        loss_fn, p, b, num_micro_batches=k))

  loss1, grads1 = step(1, remat=True)(params, batch)
  for remat in (False, True):
    loss4, grads4 = step(4, remat)(params, batch)
    np.testing.assert_allclose(strategy.reduce("sum", loss4),
                               strategy.reduce("sum", loss1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads4), jax.tree.leaves(grads1)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    hlo = step(4, remat).lower(params, batch).compile().as_text()
    assert re.search(r"\bwhile\(", hlo)  # still a loop: one micro-batch alive
    labels = re.findall(r"\bconvolution\(.*?dim_labels=([\w>-]+)", hlo)
    assert len(labels) >= 5  # 2 forward, 2 kernel gradients, 1 input gradient
    assert set(labels) == {"b01f_01io->b01f"}, (remat, labels)


def test_trainer_micro_batches_train_as_the_whole_batch(digits_flat):
  """fit with micro_batches=4 on 2 replicas: the history and weights of one
  micro-batch, on data whose last batch is short (padded micro-batches)."""
  x, y = digits_flat
  x, y = x[:360], y[:360]
  runs = []
  for k in (1, 4):
    trainer = jdist.Trainer(
        MLP(), optimizer=optax.adam(1e-2), strategy=strategy_on(2),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], micro_batches=k)
    history = trainer.fit(x, y, batch_size=64, epochs=2, verbose=0,
                          shuffle=False)
    runs.append((trainer, history))
  (t1, h1), (t4, h4) = runs
  assert t4.global_step == 12
  for key in ("loss", "accuracy"):
    np.testing.assert_allclose(h4.history[key], h1.history[key], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(t1.params), jax.tree.leaves(t4.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k,error", [(0, ValueError), (-2, ValueError),
                                     (1.5, TypeError), (True, TypeError)])
def test_bad_accumulation_steps_fail_at_once(k, error):
  for name in ("gradient_accumulation_steps", "micro_batches"):
    with pytest.raises(error, match=name):
      jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), loss="mse", **{name: k})
  with pytest.raises(error, match="accumulation steps"):
    jdist.accumulate_gradients(lambda p, b: jnp.sum(p * b), jnp.ones(2),
                               jnp.ones((4, 2)), num_micro_batches=k)


def test_batch_that_does_not_split_fails_before_the_first_step(digits_flat):
  x, y = digits_flat
  trainer = jdist.Trainer(
      MLP(), optimizer=optax.sgd(0.1), strategy=strategy_on(2),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      micro_batches=4)
  seen = []

  class Spy(jdist.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      seen.append(batch)

  with pytest.raises(ValueError, match="multiple of 8"):
    trainer.fit(x[:100], y[:100], batch_size=20, verbose=0,
                callbacks=[Spy()])
  assert seen == [] and trainer.global_step == 0
