"""Bad input fails with a message that says what was wrong and what to do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist

from conftest import strategy_on


def _loss_grad(w, x):
  return jax.grad(lambda w: jdist.compute_average_loss((x @ w) ** 2))(w)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_double_reduction_of_gradients_is_an_error(n):
  """ARCHITECTURE.md, "Gradients": gradients are already summed; summing again is refused,
  on one device too (the mesh axis is still typed as varying there)."""
  strategy = strategy_on(n)
  w = strategy.replicate(jnp.ones(3))
  batch = next(iter(strategy.experimental_distribute_dataset([np.ones((4, 3))])))

  def step(w, x):
    return jdist.get_replica_context().all_reduce("sum", {"w": _loss_grad(w, x)})

  with pytest.raises(jdist.DoubleReductionError,
                     match=r"\['w'\].*already the same on every replica.*"
                     r"arrive already summed"):
    strategy.run(step, args=(w, batch))


def test_mean_of_gradients_is_the_gradient():
  strategy = strategy_on(4)
  w = strategy.replicate(jnp.ones(3))
  batch = next(iter(strategy.experimental_distribute_dataset([np.ones((4, 3))])))
  g, g_mean = strategy.run(
      lambda w, x: (_loss_grad(w, x),
                    jdist.all_reduce("mean", _loss_grad(w, x))), args=(w, batch))
  np.testing.assert_allclose(g, g_mean)
  np.testing.assert_allclose(g, np.full(3, 6.0))  # d/dw mean((sum w)^2) = 2*3


def test_reduce_sum_of_a_mirrored_value_is_an_error():
  strategy = strategy_on(2)
  w = strategy.replicate(jnp.ones(3))
  with pytest.raises(jdist.DoubleReductionError, match="mirrored value"):
    strategy.reduce("sum", w)
  assert float(strategy.reduce("mean", w, axis=0)) == 1.0


def test_unknown_reduce_op():
  strategy = strategy_on(2)
  v = strategy.experimental_distribute_values_from_function(lambda c: np.float32(1))
  with pytest.raises(ValueError, match=r"Unknown reduce op 'avg'.*SUM, MEAN, MAX"):
    strategy.reduce("avg", v)


@pytest.mark.parametrize("devices,match", [
    (["cpu:0", "cpu:9"], r"Unknown device 'cpu:9'.*4 cpu devices"),
    (["cpu:1", "cpu:1"], r"'cpu:1'.*appears twice"),
    (["tpu:0"], r"Unknown device 'tpu:0'"),
    ([object()], r"Cannot understand the device"),
    ([], r"empty"),
])
def test_bad_device_lists(devices, match):
  with pytest.raises(ValueError, match=match):
    jdist.MirroredStrategy(devices)


def test_varying_state_is_an_error_naming_the_fix():
  strategy = strategy_on(2)
  state = strategy.replicate({"w": jnp.ones(2), "stats": jnp.zeros(2)})
  batch = next(iter(strategy.experimental_distribute_dataset([np.ones((4, 2))])))

  def step(state, x):  # batch statistics from the local batch only
    return {"w": state["w"], "stats": jnp.mean(x, 0)}, jnp.sum(x)

  with pytest.raises(jdist.VaryingStateError,
                     match=r"\['stats'\].*all_reduce\(jdist.ReduceOp.MEAN.*"
                     r"jdist.SyncOnRead"):
    strategy.run(step, args=(state, batch))

  # Either fix works.
  def synced(state, x):
    return {"w": state["w"], "stats": jdist.all_reduce("mean", jnp.mean(x, 0))}, 0.0
  strategy.run(synced, args=(state, batch))
  ok = strategy.function(step, check_state=False)(state, batch)
  assert isinstance(ok[0]["stats"], jdist.PerReplica)


def test_per_replica_value_from_another_strategy():
  two, four = strategy_on(2), strategy_on(4)
  batch = next(iter(two.experimental_distribute_dataset([np.ones((4, 2))])))
  with pytest.raises(jdist.StrategyMismatchError,
                     match=r"leading axis of 2.*4 replicas.*different strategy"):
    four.run(lambda x: x, args=(batch,))
  other_two = jdist.MirroredStrategy(["cpu:2", "cpu:3"])
  with pytest.raises(jdist.StrategyMismatchError, match=r"other devices"):
    other_two.run(lambda x: x, args=(batch,))


def test_step_of_one_strategy_inside_scope_of_another():
  two, four = strategy_on(2), strategy_on(4)
  step = two.function(lambda x: x)
  with four.scope():
    with pytest.raises(jdist.StrategyMismatchError, match="scope of"):
      step(jnp.ones(2))
    with pytest.raises(jdist.StrategyMismatchError, match="Leave the outer scope"):
      with two.scope():
        pass


def test_collectives_outside_a_step():
  strategy = strategy_on(2)
  with strategy.scope():
    with pytest.raises(jdist.ReplicaContextError,
                       match="outside a step.*strategy.reduce"):
      jdist.all_reduce("sum", jnp.ones(2))


def test_nested_steps_and_scopes_in_steps_are_errors():
  strategy = strategy_on(2)
  inner = strategy.function(lambda x: x)
  with pytest.raises(jdist.ReplicaContextError, match="inside another step"):
    strategy.run(lambda x: inner(x), args=(jnp.ones(2),))

  def enters_scope(x):
    with strategy.scope():
      return x
  with pytest.raises(jdist.ReplicaContextError, match="scope.*inside a step"):
    strategy.run(enters_scope, args=(jnp.ones(2),))


def test_every_error_is_a_jdist_error_and_keeps_its_builtin_base():
  builtin = {
      jdist.DistributionError: ValueError, jdist.DoubleReductionError: ValueError,
      jdist.MemoryBudgetError: ValueError,
      jdist.VaryingStateError: ValueError, jdist.StrategyMismatchError: ValueError,
      jdist.LossScalingError: ValueError,
      jdist.ProgramMismatchError: ValueError, jdist.ShardingError: ValueError,
      jdist.CheckpointMismatchError: ValueError,
      jdist.ReplicaContextError: RuntimeError, jdist.ClusterError: RuntimeError,
      jdist.CollectiveTimeoutError: RuntimeError,
      jdist.PeerFailureError: RuntimeError, jdist.CheckpointError: RuntimeError,
      jdist.CheckpointNotFoundError: FileNotFoundError,
      jdist.WorkerFailedError: RuntimeError,
      jdist.ParameterServerError: RuntimeError,
      jdist.CancelledError: RuntimeError, jdist.OutOfRangeError: IndexError,
      jdist.CheckpointDirectoryError: OSError,
      jdist.CheckpointInUseError: OSError,
  }
  exported = {getattr(jdist, n) for n in jdist.__all__
              if isinstance(getattr(jdist, n), type) and
              issubclass(getattr(jdist, n), BaseException)}
  assert exported == set(builtin) | {jdist.Error}
  for error, base in builtin.items():
    assert issubclass(error, jdist.Error) and issubclass(error, base), error
    assert repr(error("x")).startswith(error.__name__)
    assert error.__module__ == "jdist"  # tracebacks show jdist.<Name>


def test_scalar_loss_to_compute_average_loss():
  with pytest.raises(ValueError, match="needs per-example losses"):
    jdist.compute_average_loss(jnp.float32(1.0))


def test_sync_on_read_bad_aggregation():
  with pytest.raises(ValueError, match="ONLY_FIRST_REPLICA"):
    jdist.SyncOnRead(jnp.zeros(()), "median")
