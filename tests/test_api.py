"""The public API, used the way a tf.distribute user would use it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

from conftest import strategy_on


def test_facade_is_sorted_and_complete():
  assert jdist.__all__ == sorted(jdist.__all__)
  for name in jdist.__all__:
    assert hasattr(jdist, name), name


def test_default_strategy_and_scope():
  default = jdist.get_strategy()
  assert default.num_replicas_in_sync == 1
  assert not jdist.has_strategy()
  assert jdist.get_replica_context().num_replicas_in_sync == 1
  strategy = jdist.MirroredStrategy()
  assert strategy.num_replicas_in_sync == len(jax.local_devices()) == 4
  with strategy.scope():
    assert jdist.get_strategy() == strategy
    assert jdist.has_strategy()
    assert jdist.in_cross_replica_context()
    assert jdist.get_replica_context() is None
    with strategy.scope():  # re-entering the same strategy is fine
      pass
  assert not jdist.has_strategy()


def test_strategies_are_values():
  a, b = jdist.MirroredStrategy(), jdist.MirroredStrategy()
  assert a == b and hash(a) == hash(b) and a is not b
  assert jdist.MirroredStrategy(["cpu:0", "cpu:1"]) == jdist.MirroredStrategy(
      jax.local_devices()[:2])
  assert jdist.MirroredStrategy(["cpu:0", "cpu:1"]) != a
  # values distributed by one feed steps of the other
  batch = next(iter(a.experimental_distribute_dataset([np.ones((8, 2))])))
  out = b.run(lambda x: x * 2, args=(batch,))
  assert float(b.reduce("sum", out, axis=0).sum()) == 32.0


def test_run_outputs_mirrored_and_per_replica():
  strategy = strategy_on(4)
  def step(w, x):
    ctx = jdist.get_replica_context()
    assert ctx.num_replicas_in_sync == 4
    return {"w": w + 1, "rid": ctx.replica_id_in_sync_group, "x": x * w}
  batch = next(iter(strategy.experimental_distribute_dataset(
      [np.arange(8, dtype=np.float32)])))
  out = strategy.run(step, args=(strategy.replicate(jnp.float32(2)), batch))
  assert isinstance(out["w"], jax.Array) and float(out["w"]) == 3.0
  assert isinstance(out["rid"], jdist.PerReplica)
  assert [int(r) for r in strategy.experimental_local_results(out["rid"])] == [0, 1, 2, 3]
  np.testing.assert_array_equal(strategy.gather(out["x"]), 2 * np.arange(8))
  local = strategy.experimental_local_results(out["x"])
  assert len(local) == 4 and local[1].shape == (2,)
  np.testing.assert_array_equal(local[1], [4, 6])
  # A mirrored value's local results are that value on every replica.
  assert len(strategy.experimental_local_results(out["w"])) == 4


def test_run_caches_the_compiled_step():
  strategy = strategy_on(2)
  traces = []
  def step(x):
    traces.append(1)
    return x + 1
  for _ in range(3):
    strategy.run(step, args=(jnp.ones(3),))
  assert len(traces) == 2  # one compilation: an abstract trace and the real one


def test_a_step_inspected_then_called_compiles_once():
  """`step.lower(...).compile()` (memory or cost analysis before training)
  compiles the program the calls run: training after it compiles nothing."""
  strategy = strategy_on(2)
  step = strategy.function(lambda w, b: (w * 0.5, b * 2))
  w = strategy.replicate(jnp.ones(3))
  (batch,) = strategy.experimental_distribute_dataset([np.ones((4, 2))])
  compiles = []  # compiled, or read from the suite's compilation cache
  def count(event, *seconds, **kwargs):
    if event in ("/jax/core/compile/backend_compile_duration",
                 "/jax/compilation_cache/cache_hits"):
      compiles.append(event)
  jax.monitoring.register_event_duration_secs_listener(count)
  jax.monitoring.register_event_listener(count)
  try:
    compiled = step.lower(w, batch).compile()
    assert compiled.memory_analysis() is not None and len(compiles) == 1
    new_w, doubled = compiled(w, batch)  # outputs as a call returns them
    w, out = step(w, batch)
    w, out = step(w, batch)
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
    jax.monitoring.unregister_event_listener(count)
  assert len(compiles) == 1 and step.num_compilations == 1
  assert isinstance(doubled, jdist.PerReplica) and isinstance(out, jdist.PerReplica)
  np.testing.assert_array_equal(strategy.gather(doubled), 2 * np.ones((4, 2)))
  np.testing.assert_array_equal(w, 0.25 * np.ones(3))


def test_function_decorator_and_kwargs():
  strategy = strategy_on(2)
  @strategy.function
  def step(x, *, scale):
    return x * scale
  assert float(step(jnp.float32(2), scale=jnp.float32(3))) == 6.0
  assert step.strategy == strategy and step.__name__ == "step"


def test_mirrored_decorator_uses_all_local_devices():
  @jdist.mirrored
  def step(x):
    return jdist.get_replica_context().num_replicas_in_sync * x
  assert float(step(jnp.float32(1))) == 4.0
  assert step.strategy == jdist.MirroredStrategy()

  @jdist.mirrored(devices=["cpu:2", "cpu:3"])
  def step2(x):
    return jdist.get_replica_context().all_gather(x[None], axis=0)
  assert step2(jnp.float32(1)).shape == (2,)


@pytest.mark.parametrize("op,axis,want", [
    ("sum", None, [10.0, 14.0]), ("mean", None, [2.5, 3.5]),
    ("max", None, [4.0, 5.0]), ("min", None, [1.0, 2.0]),
    ("sum", 0, 24.0), ("mean", 0, 3.0), ("max", 0, 5.0), ("min", 0, 1.0)])
def test_reduce_ops(op, axis, want):
  strategy = strategy_on(4)
  v = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.array([1.0, 2.0], np.float32) + ctx.replica_id_in_sync_group)
  np.testing.assert_allclose(strategy.reduce(op, v, axis=axis), want)


def test_reduce_nested_structure_and_enum():
  strategy = strategy_on(2)
  v = strategy.experimental_distribute_values_from_function(
      lambda ctx: {"a": np.float32(ctx.replica_id_in_sync_group + 1)})
  out = strategy.reduce(jdist.ReduceOp.SUM, {"m": v})
  assert float(out["m"]["a"]) == 3.0
  assert out["m"]["a"].sharding.is_fully_replicated


def test_replica_context_collectives():
  strategy = strategy_on(4)
  def step(x):
    ctx = jdist.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    local = x * (rid + 1)
    return {
        "sum": ctx.all_reduce("sum", local),
        "mean": jdist.all_reduce(jdist.ReduceOp.MEAN, local),
        "max": ctx.all_reduce("max", local),
        "min": ctx.all_reduce("min", local),
        "gathered": ctx.all_gather(jnp.reshape(local, (1,)), axis=0),
        "mean_of_mirrored": ctx.all_reduce("mean", x),
    }
  out = strategy.run(step, args=(jnp.float32(1),))
  assert float(out["sum"]) == 10 and float(out["mean"]) == 2.5
  assert float(out["max"]) == 4 and float(out["min"]) == 1
  np.testing.assert_array_equal(out["gathered"], [1, 2, 3, 4])
  assert float(out["mean_of_mirrored"]) == 1
  # all results are the same on every replica: mirrored, not PerReplica
  assert not any(isinstance(v, jdist.PerReplica) for v in out.values())


def test_merge_call_sees_per_replica_values():
  strategy = strategy_on(4)
  seen = {}
  def merge_fn(strat, value, mirrored):
    seen["strategy"] = strat
    seen["cross_replica"] = jdist.in_cross_replica_context()
    assert isinstance(value, jdist.PerReplica)
    return strat.reduce("sum", value) + mirrored
  def step(x):
    ctx = jdist.get_replica_context()
    local = x * ctx.replica_id_in_sync_group
    return ctx.merge_call(merge_fn, args=(local, x))
  out = strategy.run(step, args=(jnp.float32(1),))
  assert float(out) == 0 + 1 + 2 + 3 + 1
  assert seen["strategy"] == strategy and seen["cross_replica"]


def test_replicate_places_on_every_device():
  strategy = strategy_on(4)
  tree = strategy.replicate({"a": np.ones(3), "b": jnp.zeros(2)})
  for leaf in jax.tree.leaves(tree):
    assert leaf.sharding.is_fully_replicated
    assert leaf.sharding.device_set == set(strategy.devices)


@pytest.mark.parametrize("aggregation,want", [("sum", 6.0), ("mean", 1.5),
                                              ("only_first_replica", 0.0)])
def test_sync_on_read_aggregation(aggregation, want):
  strategy = strategy_on(4)
  sync = strategy.replicate(jdist.SyncOnRead(jnp.float32(0), aggregation))
  assert float(sync.read()) == 0.0  # replicate then read gives the value back
  @strategy.function
  def step(s):
    return s.assign(s.value + jdist.get_replica_context().replica_id_in_sync_group)
  sync = step(sync)
  assert isinstance(sync, jdist.SyncOnRead) and sync.value.shape == (4,)
  assert float(sync.read()) == want
  assert float(jdist.read_value({"s": sync})["s"]) == want


def test_sync_on_read_sum_initial_value_reads_back():
  strategy = strategy_on(4)
  sync = strategy.replicate(jdist.SyncOnRead(jnp.float32(5), "sum"))
  assert float(sync.read()) == 5.0
  # unplaced SyncOnRead passed straight to a step is placed the same way
  out = strategy.run(lambda s: s.assign(s.value + 1),
                     args=(jdist.SyncOnRead(jnp.float32(5), "sum"),))
  assert float(out.read()) == 9.0


def test_values_round_trip_through_jit():
  """Every field of the values survives jit, each in its own place (a
  hand-written flatten that drops or swaps a field fails here)."""
  values = jnp.arange(6.0).reshape(2, 3)
  mask = jnp.array([[True, True, False], [True, False, False]])
  pr = jdist.PerReplica({"a": values}, mask, jnp.int32(3))
  sy = jdist.SyncOnRead(jnp.array([2.0, 5.0]), "mean", per_replica=True)
  pr2, sy2 = jax.jit(lambda a, b: (a, b))(pr, sy)
  assert isinstance(pr2, jdist.PerReplica) and int(pr2.num_valid) == 3
  np.testing.assert_array_equal(pr2.values["a"], values)
  np.testing.assert_array_equal(pr2.mask, mask)
  assert isinstance(sy2, jdist.SyncOnRead)
  assert sy2.aggregation is jdist.VariableAggregation.MEAN and sy2.per_replica
  np.testing.assert_array_equal(sy2.value, [2.0, 5.0])
  assert float(sy2.read()) == 3.5


def test_compute_average_loss_options():
  strategy = strategy_on(2)
  batch = next(iter(strategy.experimental_distribute_dataset([np.ones((4,))])))
  def step(x):
    return {
        "default": jdist.compute_average_loss(x),
        "weighted": jdist.compute_average_loss(x, sample_weight=2.0),
        "explicit": jdist.compute_average_loss(x, global_batch_size=8),
        # TF's pattern: the total varies; its regularization part is counted once
        "total": (jdist.compute_average_loss(x) +
                  jdist.scale_regularization_loss(jnp.float32(1.0))),
    }
  out = strategy.reduce("sum", strategy.run(step, args=(batch,)))
  assert float(out["default"]) == 1.0
  assert float(out["weighted"]) == 2.0
  assert float(out["explicit"]) == 0.5
  assert float(out["total"]) == 2.0  # reg/N on each of N replicas


def test_compute_average_loss_without_a_distributed_batch():
  strategy = strategy_on(2)
  x = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.ones(3, np.float32))
  out = strategy.run(lambda v: jdist.compute_average_loss(v), args=(x,))
  assert float(strategy.reduce("sum", out)) == 1.0  # divides by 3 * 2


def test_example_keys_and_dropout_do_not_depend_on_replicas():
  key = jax.random.key(3)
  x = np.ones((8, 5), np.float32)
  want = jdist.dropout(key, 0.5, x)
  for n in (2, 4):
    strategy = strategy_on(n)
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    out = strategy.run(lambda b, k: jdist.dropout(k, 0.5, b), args=(batch, key))
    np.testing.assert_array_equal(strategy.gather(out), want)
  assert 0 < float(jnp.mean(want == 0)) < 1


def test_input_context():
  ctx = jdist.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                           num_replicas_in_sync=4)
  assert ctx.get_per_replica_batch_size(64) == 16
  with pytest.raises(ValueError, match="does not divide evenly over 4"):
    ctx.get_per_replica_batch_size(10)


def test_one_device_strategy_placement():
  strategy = jdist.OneDeviceStrategy("cpu:2")
  assert strategy.devices == (jax.local_devices()[2],)
  out = strategy.run(lambda x: x + 1, args=(strategy.replicate(jnp.ones(2)),))
  assert out.sharding.device_set == {jax.local_devices()[2]}


def test_static_arguments():
  strategy = strategy_on(2)
  @strategy.function(static_argnames=("mode",), static_argnums=(1,))
  def step(x, times, *, mode):
    out = x
    for _ in range(times):  # a Python int: usable in Python control flow
      out = out * 2 if mode == "double" else out + 1
    return out
  assert float(step(jnp.float32(1), 3, mode="double")) == 8.0
  assert float(step(jnp.float32(1), 3, mode="add")) == 4.0
  assert step.num_compilations == 2


@pytest.mark.parametrize("aggregation,want", [("sum", 6.0), ("mean", 1.5),
                                              ("only_first_replica", 0.0)])
def test_sync_on_read_read_inside_a_step_aggregates(aggregation, want):
  strategy = strategy_on(4)
  sync = strategy.replicate(jdist.SyncOnRead(jnp.float32(0), aggregation))
  def step(s):
    s = s.assign(s.value + jdist.get_replica_context().replica_id_in_sync_group)
    return s, s.read()
  sync, read = strategy.run(step, args=(sync,))
  assert not isinstance(read, jdist.PerReplica)  # the same on every replica
  assert float(read) == want == float(sync.read())
