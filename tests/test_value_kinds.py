"""Every kind of value through a step and back (the engine's table of value
kinds), and what a call does around the compiled program: fresh values placed
before it compiles, arguments on other devices named, a multi-step carry that
changes type refused, options kept when a step is re-wrapped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

from conftest import strategy_on


def test_every_kind_crosses_a_step_and_comes_back():
  strategy = strategy_on(2)

  @strategy.function(static_argnums=(5,), check_state=False)
  def step(w, batch, total, opt, n, scale):
    x = batch["x"]
    new_opt = opt.replace(jax.tree.map(lambda b: b + scale, opt.value))
    return (w * scale, x.sum(axis=1), total.assign(total.value + x.sum()),
            new_opt, n + 1)

  data = [np.arange(8, dtype=np.float32).reshape(4, 2)]
  batch = next(iter(strategy.experimental_distribute_dataset(
      [{"x": d} for d in data])))
  total = strategy.replicate(jdist.SyncOnRead(jnp.zeros(()), "sum"))
  opt = jdist.Sharded({"m": strategy.replicate(jnp.zeros((4, 3)))}, (0,),
                      strategy.axis_name)
  w = strategy.replicate(jnp.ones(2))
  w, rows, total, opt, n = step(w, batch, total, opt, jnp.int32(0), 3.0)
  np.testing.assert_array_equal(w, [3.0, 3.0])  # mirrored in, mirrored out
  assert isinstance(rows, jdist.PerReplica) and rows.mask is not None
  np.testing.assert_array_equal(strategy.gather(rows), data[0].sum(axis=1))
  assert isinstance(total, jdist.SyncOnRead) and total.per_replica
  assert float(total.read()) == data[0].sum()
  assert isinstance(opt, jdist.Sharded) and opt.axes == (0,)
  np.testing.assert_array_equal(opt.value["m"], np.full((4, 3), 3.0))
  assert int(n) == 1
  group = next(iter(strategy.experimental_distribute_dataset(data).group(1)))
  with pytest.raises(TypeError, match="got a BatchGroup.*jdist.multi_step"):
    step(w, group, total, opt, n, 3.0)


def test_a_placed_sync_on_read_is_read_per_replica_outside_steps():
  strategy = strategy_on(2)
  total = strategy.replicate(jdist.SyncOnRead(jnp.array([1.0, 2.0]), "mean"))
  np.testing.assert_array_equal(strategy.gather(total), [1, 2, 1, 2])
  np.testing.assert_array_equal(strategy.reduce("sum", total), [2, 4])
  assert [np.asarray(r).tolist() for r in
          strategy.experimental_local_results(total)] == [[1, 2], [1, 2]]
  other = jdist.MirroredStrategy(["cpu:2", "cpu:3"])
  with pytest.raises(jdist.StrategyMismatchError, match="strategy.gather got"):
    other.gather(total)


def _mean_step(strategy, **options):
  """A step `(w, metric, batch) -> (w, metric)` averaging `batch @ w`."""
  @strategy.function(**options)
  def step(w, metric, batch):
    return w, metric.update(batch @ w)
  return step


def test_a_fresh_metric_does_not_compile_the_step_twice():
  strategy = strategy_on(2)
  step = _mean_step(strategy, donate_argnums=(0,))
  data = [np.full((4, 2), i, np.float32) for i in range(3)] + [
      np.full((2, 2), 3, np.float32)]  # a short last batch, padded
  w = strategy.replicate(jnp.ones(2))
  for epoch in range(3):
    metric = jdist.metrics.Mean()  # made outside a step: not placed
    for batch in strategy.experimental_distribute_dataset(data):
      w, metric = step(w, metric, batch)
    expected = np.concatenate([2 * np.full(len(b), b[0, 0]) for b in data])
    assert float(metric.result()) == pytest.approx(expected.mean())
  assert step.num_compilations == 1
  np.testing.assert_array_equal(w, np.ones(2))  # the donated state lived on


def test_a_fresh_metric_inside_the_users_jit_compiles_once():
  strategy = strategy_on(2)
  step = _mean_step(strategy)
  traces = []

  @jax.jit
  def evaluate(w, batch):
    traces.append(1)
    _, metric = step(w, jdist.metrics.Mean(), batch)
    return metric.result()

  w = strategy.replicate(jnp.array([1.0, 2.0]))
  data = [np.full((4, 2), i, np.float32) for i in range(1, 4)]
  for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
    assert float(evaluate(w, batch)) == pytest.approx(3.0 * (i + 1))
  assert len(traces) == 1 and step.num_compilations == 1


def test_an_argument_on_other_devices_is_named():
  two, other = strategy_on(2), jdist.MirroredStrategy(["cpu:2", "cpu:3"])
  step = other.function(lambda state, x: (state, x * state["w"]))
  state = two.replicate({"w": jnp.ones(2)})
  with pytest.raises(jdist.StrategyMismatchError,
                     match=r"other devices than MirroredStrategy.*"
                     r"args\[0\]\['w'\] \(a mirrored array\) is on "
                     r"\[cpu:0, cpu:1\].*replicate\(\)"):
    step(state, jnp.ones(2))
  batch = next(iter(two.experimental_distribute_dataset([np.ones((4, 2))])))
  with pytest.raises(jdist.StrategyMismatchError,
                     match=r"args\[1\] \(a PerReplica\) is on \[cpu:0, cpu:1\]"):
    step(other.replicate({"w": jnp.ones(2)}), batch)


def test_a_value_error_of_the_step_itself_is_not_blamed_on_devices():
  strategy = strategy_on(2)

  @strategy.function
  def step(x):
    raise ValueError("the user's own mistake")

  with pytest.raises(ValueError, match="the user's own mistake") as raised:
    step(strategy.replicate(jnp.ones(2)))
  assert not isinstance(raised.value, jdist.StrategyMismatchError)


def test_a_multi_step_carry_that_changes_type_is_a_clear_error():
  strategy = strategy_on(2)

  @strategy.function
  def step(state, batch):
    loss = jdist.compute_average_loss(batch @ state["w"])
    return {"w": state["w"], "n": state["n"] + 0.5}, loss  # int + float

  run = jdist.multi_step(step)
  group = next(iter(strategy.experimental_distribute_dataset(
      [np.ones((4, 2), np.float32)] * 2).group(2)))
  state = strategy.replicate({"w": jnp.ones(2), "n": jnp.zeros((), jnp.int32)})
  with pytest.raises(TypeError,
                     match=r"carried values whose types differ.*"
                     r"\[0\]\['n'\]: argument int32\[\], output float32\[\]"):
    run(state, group)


def test_multi_step_keeps_the_options_of_its_step():
  strategy = strategy_on(2)

  @strategy.function(donate_argnums=(0,), check_loss_scaling=False)
  def step(w, batch):
    return w, jnp.mean(batch @ w)

  run = jdist.multi_step(step)
  assert run.options == step.options
  assert run.python_function is step.python_function
  w = strategy.replicate(jnp.ones(2))
  group = next(iter(strategy.experimental_distribute_dataset(
      [np.ones((4, 2), np.float32)] * 3).group(3)))
  w, losses = run(w, group)
  np.testing.assert_allclose(strategy.reduce("sum", losses), [4.0] * 3)


@pytest.mark.parametrize("donate", [(), (1,)], ids=["kept", "donated"])
def test_a_per_replica_output_keeps_its_batch_validity(donate):
  strategy = strategy_on(2)

  @strategy.function(donate_argnums=donate)
  def step(w, batch):
    return w, batch @ w  # per example: masked where the batch is padded

  w = strategy.replicate(jnp.array([1.0, 2.0]))
  data = [np.ones((4, 2), np.float32), np.full((2, 2), 2, np.float32)]
  means = []
  for batch in strategy.experimental_distribute_dataset(data):
    w, per_example = step(w, batch)
    assert per_example.mask is not None
    means.append(float(strategy.reduce("mean", per_example, axis=0)))
  assert means == [3.0, 6.0]  # the short batch's padding rows left out
