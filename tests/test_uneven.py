"""Uneven data: the last batch is padded and masked; nothing lost or doubled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.models import MLP

from conftest import strategy_on

N_EXAMPLES, BATCH = 1000, 64  # 15 full batches and one of 40


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  x, y = x[:N_EXAMPLES], y[:N_EXAMPLES]
  ids = np.arange(N_EXAMPLES, dtype=np.int32)
  batches = [{"x": x[i:i + BATCH], "y": y[i:i + BATCH], "id": ids[i:i + BATCH]}
             for i in range(0, N_EXAMPLES, BATCH)]
  return x, y, batches


@pytest.fixture(scope="module")
def params(data):
  x, _, _ = data
  return MLP().init(jax.random.key(0), x[:2])["params"]


def per_example_loss(params, x, y):
  logits = MLP().apply({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def eval_step(params, batch):
  per_ex = per_example_loss(params, batch["x"], batch["y"])
  loss, grads = jax.value_and_grad(
      lambda p: jdist.compute_average_loss(
          per_example_loss(p, batch["x"], batch["y"])))(params)
  return {"loss": loss, "grads": grads, "id": batch["id"], "per_ex": per_ex}


@pytest.mark.parametrize("n", [1, 2, 4])
def test_epoch_is_exact_and_compiles_once(n, data, params):
  x, y, batches = data
  strategy = strategy_on(n)
  step = strategy.function(eval_step)
  p = strategy.replicate(params)
  seen, epoch_sum, outs = [], 0.0, []
  for batch in strategy.experimental_distribute_dataset(batches):
    out = step(p, batch)
    outs.append(out)
    seen.append(np.asarray(strategy.gather(out["id"])))
    # loss is each replica's share of the batch mean; SUM gives the batch mean.
    batch_mean = float(strategy.reduce("sum", out["loss"]))
    assert batch_mean == pytest.approx(
        float(strategy.reduce("mean", out["per_ex"], axis=0)), rel=1e-5)
    epoch_sum += batch_mean * len(seen[-1])
  seen = np.concatenate(seen)
  np.testing.assert_array_equal(seen, np.arange(N_EXAMPLES))  # none lost or doubled
  exact = float(jnp.mean(per_example_loss(params, x, y)))
  assert epoch_sum / N_EXAMPLES == pytest.approx(exact, rel=1e-5)
  assert step.num_compilations == 1  # the short batch did not recompile

  # The short batch's gradient is that of its 40 real examples on one device.
  last = batches[-1]
  assert len(last["x"]) == 40
  want = jax.grad(lambda p: jnp.mean(per_example_loss(p, last["x"], last["y"])))(params)
  got = outs[-1]["grads"]
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
  # Per-example outputs come back without the padding rows.
  assert strategy.gather(outs[-1]["per_ex"]).shape == (40,)


def test_training_on_uneven_data_matches_one_device(data, params):
  _, _, batches = data
  tx = optax.adam(1e-2)

  def train_step(state, batch):
    params, opt = state
    loss, grads = jax.value_and_grad(lambda p: jdist.compute_average_loss(
        per_example_loss(p, batch["x"], batch["y"])))(params)
    updates, opt = tx.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), {"loss": loss}

  jdist.testing.assert_equivalent(train_step, (params, tx.init(params)), batches,
                                  num_replicas=4)


def test_replica_with_only_padding(params):
  """A last batch smaller than the replica count leaves replicas empty."""
  strategy = strategy_on(4)
  x = np.linspace(0, 1, 9 * 64, dtype=np.float32).reshape(9, 64)
  batches = [{"x": x[:8], "y": np.arange(8) % 10},
             {"x": x[8:9], "y": np.array([3])}]
  step = strategy.function(lambda p, b: jdist.compute_average_loss(
      per_example_loss(p, b["x"], b["y"])))
  losses = [float(strategy.reduce("sum", step(strategy.replicate(params), b)))
            for b in strategy.experimental_distribute_dataset(batches)]
  want = float(per_example_loss(params, x[8:9], np.array([3]))[0])
  assert losses[1] == pytest.approx(want, rel=1e-5)
  assert np.isfinite(losses).all()


def test_from_function_pads_missing_replicas(params):
  """distribute_datasets_from_function: per-replica batches, short tail."""
  strategy = strategy_on(4)
  rows = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
  contexts = []

  def dataset_fn(ctx):
    contexts.append(ctx)
    b = ctx.get_per_replica_batch_size(8)
    return [rows[i:i + b] for i in range(0, len(rows), b)]  # 2,2,2,2,2

  ds = strategy.distribute_datasets_from_function(dataset_fn)
  step = strategy.function(lambda v: (v, jnp.sum(v)))
  got = []
  for batch in ds:
    vals, _ = step(batch)
    got.append(np.asarray(strategy.gather(vals)))
  assert contexts[0] == jdist.InputContext(1, 0, 4)
  assert [g.shape[0] for g in got] == [8, 2]  # second step: replica 0 only
  np.testing.assert_array_equal(np.concatenate(got), rows)


def test_batch_that_cannot_split_is_a_clear_error():
  strategy = strategy_on(4)
  ds = strategy.experimental_distribute_dataset([np.zeros((10, 2))] * 2)
  with pytest.raises(ValueError, match=r"10 examples cannot split evenly over 4 "
                     r"replicas.*multiple of 4 \(for example 8 or 12\)"):
    next(iter(ds))
  small = strategy.experimental_distribute_dataset([np.zeros((3, 2))] * 2)
  with pytest.raises(ValueError, match=r"\(for example 4\);"):
    next(iter(small))


def test_data_shorter_than_the_replicas_is_one_padded_batch():
  """Issue 10.8: a short only batch is a short last batch."""
  strategy = strategy_on(4)
  data = np.arange(6, dtype=np.float32).reshape(3, 2)
  batch, = strategy.experimental_distribute_dataset([data])
  assert batch.values.shape == (4, 1, 2) and int(batch.num_valid) == 3
  np.testing.assert_array_equal(strategy.gather(batch), data)
  mean = strategy.run(lambda x: jdist.compute_average_loss(x[:, 0]),
                      args=(batch,))
  assert float(strategy.reduce("sum", mean)) == pytest.approx(2.0)


def test_growing_batch_is_a_clear_error():
  strategy = strategy_on(2)
  ds = strategy.experimental_distribute_dataset(
      [np.zeros((4, 2)), np.zeros((6, 2))])
  with pytest.raises(ValueError, match="may shrink at the end.*not grow"):
    list(ds)


def test_leaves_with_different_batch_sizes_are_a_clear_error():
  strategy = strategy_on(2)
  ds = strategy.experimental_distribute_dataset(
      [{"x": np.zeros((4, 2)), "y": np.zeros(6)}])
  with pytest.raises(ValueError, match=r"disagree on the batch size"):
    next(iter(ds))


def test_each_iter_is_a_new_pass_and_position_counts():
  strategy = strategy_on(2)
  ds = strategy.experimental_distribute_dataset([np.ones((4, 1))] * 3)
  it = iter(ds)
  next(it)
  assert it.position == 1
  assert len(list(it)) == 2
  assert len(list(ds)) == 3


def test_declared_global_batch_size_lets_the_first_batch_be_short():
  """A pass that starts at the short last batch keeps the static shape."""
  strategy = strategy_on(4)
  step = strategy.function(lambda b: jdist.compute_average_loss(b))
  full = strategy.experimental_distribute_dataset([np.ones(8, np.float32)])
  short = strategy.experimental_distribute_dataset([np.ones(3, np.float32)],
                                                   global_batch_size=8)
  for batch in list(full) + list(short):
    assert float(strategy.reduce("sum", step(batch))) == pytest.approx(1.0)
  assert step.num_compilations == 1
  with pytest.raises(ValueError, match="6 examples cannot split evenly over 4"):
    strategy.experimental_distribute_dataset([], global_batch_size=6)


def test_donated_batches_keep_working():
  """A step may donate its batches: prefetched batches share no buffers."""
  strategy = strategy_on(2)  # (sharing one donated buffer crashed jax here)
  step = strategy.function(lambda w, b: (w + jdist.all_reduce("sum", jnp.sum(b)),
                                         jdist.compute_average_loss(b)),
                           donate_argnums=(0, 1))
  w = strategy.replicate(jnp.float32(0))
  for batch in strategy.experimental_distribute_dataset([np.ones(4, np.float32)] * 3):
    w, _ = step(w, batch)
  assert float(w) == 12.0


def test_pad_to_replicas_trains_the_same_on_3_replicas_as_on_4():
  """A global batch of 16 on 3 replicas (3 x 6, 2 rows masked) with
  `InputOptions(pad_to_replicas=True)`: SGD with momentum follows the same
  trajectory as on 4 replicas and on 1; without the option it is an error
  that names it."""
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(16, 5)).astype(np.float32),
              "y": rng.normal(size=16).astype(np.float32)} for _ in range(8)]
  batches.append({k: v[:7] for k, v in batches[0].items()})  # a short last one
  opt = optax.sgd(0.1, momentum=0.9)

  def train_step(state, b):
    def loss(w):
      return jdist.compute_average_loss((jnp.tanh(b["x"] @ w) - b["y"]) ** 2)
    grads = jax.grad(loss)(state["w"])
    updates, opt_state = opt.update(grads, state["opt"])
    return {"w": optax.apply_updates(state["w"], updates), "opt": opt_state}

  def train(n):
    strategy = strategy_on(n)
    w = jnp.full(5, 0.1, jnp.float32)
    state = strategy.replicate({"w": w, "opt": opt.init(w)})
    step = strategy.function(train_step)
    options = jdist.InputOptions(pad_to_replicas=True)
    for batch in strategy.experimental_distribute_dataset(batches, options):
      state = step(state, batch)
    return np.asarray(state["w"])

  first = next(iter(strategy_on(3).experimental_distribute_dataset(
      batches, jdist.InputOptions(pad_to_replicas=True))))
  assert first.values["x"].shape == (3, 6, 5) and int(first.num_valid) == 16
  three = train(3)
  np.testing.assert_allclose(three, train(4), rtol=0, atol=1e-6)
  np.testing.assert_allclose(three, train(1), rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match=r"16 examples cannot split evenly over "
                     r"3 replicas.*InputOptions\(pad_to_replicas=True\)"):
    next(iter(strategy_on(3).experimental_distribute_dataset(batches)))
