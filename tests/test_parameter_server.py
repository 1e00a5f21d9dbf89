"""ParameterServerStrategy and ClusterCoordinator, threads backend.

Programs in the shape of TensorFlow's parameter-server tutorial (per-worker
datasets, `coordinator.schedule(step_fn, args=(iterator,))`, `join()`), and
jdist's synchronous step run unchanged on the workers. The Ray backend runs
the same programs in tests/test_parameter_server_ray.py.
"""

import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP
from jdist.examples.steps import classifier_step

from conftest import Interrupt

Local = jdist.cluster_resolver.LocalClusterResolver
MODEL = MLP(hidden=32)
apply_fn = lambda p, x: MODEL.apply({"params": p}, x)


@pytest.fixture(scope="module")
def digits_split(digits_flat):
  x, y = digits_flat
  return (x[:1400], y[:1400]), (x[1400:], y[1400:])


@pytest.fixture(scope="module")
def batches(digits_split):
  (x, y), _ = digits_split
  rng = np.random.default_rng(0)
  return [{"x": x[i], "y": y[i]}
          for i in (rng.choice(len(x), 32, replace=False) for _ in range(400))]


def accuracy(params, split) -> float:
  _, (x, y) = split
  return float(np.mean(np.argmax(apply_fn(params, x), -1) == y))


def init_params():
  return MODEL.init(jax.random.key(0), np.zeros((1, 64), np.float32))["params"]


def train_sync(batches, tx):
  """The reference: one device, one step per batch, in order."""
  strategy = jdist.OneDeviceStrategy()
  step = strategy.function(classifier_step(apply_fn, tx))
  params = init_params()
  state = strategy.replicate((params, tx.init(params)))
  for batch in strategy.experimental_distribute_dataset(batches):
    state, _ = step(state, batch)
  return jax.tree.map(np.asarray, state)


@pytest.fixture
def no_thread_left():
  before = set(threading.enumerate())
  yield
  time.sleep(0.05)
  left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
  assert not left, f"threads left behind: {left}"


def make(num_workers=2, num_ps=1, **kwargs):
  return jdist.ParameterServerStrategy(Local(num_workers, num_ps), **kwargs)


# --- the TensorFlow tutorial's shape ------------------------------------------------


def test_tutorial_loop_trains_and_leaves_nothing_behind(batches, digits_split,
                                                        no_thread_left):
  strategy = make(num_workers=2)
  tx = optax.sgd(0.1)
  train_step = strategy.function(classifier_step(apply_fn, tx))
  params = init_params()
  with jdist.ClusterCoordinator(strategy) as coordinator:
    state = strategy.replicate((params, tx.init(params)))
    (x, y), _ = digits_split

    def dataset_fn(ctx):
      # Each worker reads its own shard of the examples, repeated forever.
      rng = np.random.default_rng(ctx.input_pipeline_id)
      mine = np.arange(ctx.input_pipeline_id, len(x), ctx.num_input_pipelines)
      while True:
        i = rng.choice(mine, 32, replace=False)
        yield {"x": x[i], "y": y[i]}

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(iterator):
      _, loss = train_step(state, next(iterator))
      return strategy.reduce("sum", loss)

    losses = [coordinator.schedule(step_fn, args=(iterator,))
              for _ in range(300)]
    assert not all(r.done() for r in losses)  # schedule returned at once
    coordinator.join()
    assert coordinator.done()
    first, last = coordinator.fetch((losses[:20], losses[-20:]))
    assert np.mean(last) < np.mean(first) / 2
    assert state.version() == {0: 300}  # every update applied once
    assert accuracy(coordinator.fetch(state)[0], digits_split) > 0.8


def test_one_worker_is_the_same_as_one_device(batches):
  tx = optax.adam(3e-3)
  expected = train_sync(batches[:60], tx)
  strategy = make(num_workers=1)
  step = strategy.function(classifier_step(apply_fn, tx))
  params = init_params()
  state = strategy.replicate((params, tx.init(params)))
  for batch in strategy.experimental_distribute_dataset(batches[:60]):
    state, loss = step(state, batch)  # scheduled: returns at once
  assert isinstance(state, jdist.ServerVariables)
  assert isinstance(loss, jdist.RemoteValue)
  got = state.read()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                       atol=1e-7),
               got, expected)
  strategy.coordinator.shutdown()


def test_zero_staleness_is_sequential_training(batches):
  """max_staleness=0: every update is applied to the values it read, so the
  run equals one-device training over the batches in the order applied."""
  tx = optax.sgd(0.1)
  strategy = make(num_workers=4, max_staleness=0)
  inner = classifier_step(apply_fn, tx)

  def step(state, batch):
    new, loss = inner(state["model"], batch)
    # The counter read is the update's position: each update adds one.
    return {"model": new, "count": state["count"] + 1}, state["count"]

  params = init_params()
  state = strategy.replicate({"model": (params, tx.init(params)),
                              "count": jnp.int32(0)})
  positions = []
  for batch in strategy.experimental_distribute_dataset(batches[:80]):
    state, position = strategy.run(step, args=(state, batch))
    positions.append(position)
  order = np.argsort([int(p.fetch()) for p in positions])
  assert sorted(int(p.fetch()) for p in positions) == list(range(80))
  expected = train_sync([batches[i] for i in order], tx)
  got = state.read()
  assert int(got["count"]) == 80
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               got["model"], expected)
  strategy.coordinator.shutdown()


@pytest.mark.parametrize("num_workers", [2, 4])
def test_async_accuracy_matches_sync_for_the_same_examples(
    num_workers, batches, digits_split):
  tx = optax.sgd(0.1)
  sync = accuracy(train_sync(batches, tx)[0], digits_split)
  strategy = make(num_workers=num_workers)
  step = strategy.function(classifier_step(apply_fn, tx))
  params = init_params()
  state = strategy.replicate((params, tx.init(params)))
  for batch in strategy.experimental_distribute_dataset(batches):
    state, _ = step(state, batch)
  got = accuracy(state.read()[0], digits_split)
  assert state.version() == {0: len(batches)}
  # Stale updates cost a little accuracy; both runs learned.
  assert sync > 0.85 and abs(got - sync) <= 0.03, (got, sync)
  strategy.coordinator.shutdown()


# --- variables ------------------------------------------------------------------------


def test_partitioned_variables_spread_over_servers():
  strategy = make(num_workers=1, num_ps=2,
                  variable_partitioner=jdist.FixedShardsPartitioner(4))
  tree = {"table": np.arange(30, dtype=np.float32).reshape(10, 3),
          "bias": np.arange(3, dtype=np.float32), "scale": np.float32(2)}
  v = strategy.replicate(tree)
  where = v.placement()
  # Div partitions (10 rows in 4: 3, 3, 2, 2) round-robin over 2 servers; the
  # scalar is never split.
  assert where["table"] == [(0, (0, 3)), (1, (3, 6)), (0, (6, 8)), (1, (8, 10))]
  assert where["bias"] == [(0, (0, 1)), (1, (1, 2)), (0, (2, 3))]
  assert where["scale"] == [(1, None)]
  jax.tree.map(np.testing.assert_array_equal, v.read(), tree)

  def step(w, x):  # every piece is updated, each on its own server
    return jax.tree.map(lambda a: a + x, w), jnp.sum(w["table"])

  v, total = strategy.run(step, args=(v, np.float32(1)))
  assert float(total.fetch()) == 435.0
  jax.tree.map(np.testing.assert_array_equal, v.read(),
               jax.tree.map(lambda a: a + 1, tree))
  assert v.version() == {0: 1, 1: 1}
  strategy.coordinator.shutdown()


def test_size_partitioners_follow_tensorflow():
  f32 = np.float32
  assert jdist.MinSizePartitioner(4, max_shards=2)((6, 1), f32) == [2, 1]
  assert jdist.MinSizePartitioner(4, max_shards=10)((6, 1), f32) == [6, 1]
  assert jdist.MinSizePartitioner()((1024, 1024), f32) == [1, 1]
  assert jdist.MinSizePartitioner(max_shards=32)((1024, 1024), f32) == [16, 1]
  assert jdist.MaxSizePartitioner(4)((6, 1), f32) == [6, 1]
  assert jdist.MaxSizePartitioner(4, max_shards=2)((6, 1), f32) == [2, 1]
  assert jdist.MaxSizePartitioner(1024)((6, 1), f32) == [1, 1]
  assert jdist.MaxSizePartitioner(100)((10, 5), f32) == [2, 1]
  with pytest.raises(ValueError, match="max_shards must be a positive"):
    jdist.MinSizePartitioner(max_shards=0)
  strategy = make(num_workers=1, num_ps=2,
                  variable_partitioner=jdist.MaxSizePartitioner(100))
  v = strategy.replicate({"w": np.ones((10, 5), np.float32)})  # 200 bytes
  assert v.placement()["w"] == [(0, (0, 5)), (1, (5, 10))]
  strategy.coordinator.shutdown()


def test_counters_flags_and_keys_update_by_their_kind():
  """Numbers add the worker's change, booleans and keys take its value."""
  strategy = make(num_workers=1)
  state = strategy.replicate({"n": jnp.int32(0), "done": jnp.bool_(False),
                              "key": jax.random.key(1),
                              "x": jnp.float32(0.5)})

  def step(state, _):
    key, sub = jax.random.split(state["key"])
    return {"n": state["n"] + 1, "done": state["n"] >= 2, "key": key,
            "x": state["x"] + jax.random.uniform(sub)}, state["x"]

  expected = {"n": jnp.int32(0), "done": jnp.bool_(False),
              "key": jax.random.key(1), "x": jnp.float32(0.5)}
  for _ in range(4):
    state, _ = strategy.run(step, args=(state, np.zeros((1,), np.float32)))
    expected, _ = step(expected, None)
  got = state.read()
  assert int(got["n"]) == 4 and bool(got["done"])
  np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                jax.random.key_data(expected["key"]))
  np.testing.assert_allclose(got["x"], expected["x"], rtol=1e-6)
  strategy.coordinator.shutdown()


def test_assign_and_read_on_the_coordinator():
  strategy = make(num_workers=1)
  v = strategy.replicate({"w": np.zeros(3, np.float32)})
  v.assign({"w": np.ones(3, np.float32)})
  np.testing.assert_array_equal(v.read()["w"], np.ones(3))
  with pytest.raises(ValueError, match="structure the variables were made"):
    v.assign({"b": np.ones(3, np.float32)})
  with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(4,\)"):
    v.assign({"w": np.ones(4, np.float32)})
  strategy.coordinator.shutdown()


def test_a_step_returning_other_shapes_is_a_clear_error():
  strategy = make(num_workers=1)
  v = strategy.replicate(jnp.zeros(3))
  coordinator = strategy.coordinator
  result = coordinator.schedule(
      lambda: strategy.run(lambda w: (jnp.zeros(4), 0.0), args=(v,)))
  with pytest.raises(jdist.VaryingStateError,
                     match=r"returned float32\[4\] for the variable <value>, "
                           r"which is float32\[3\]"):
    coordinator.join()
  with pytest.raises(jdist.VaryingStateError):
    result.fetch()
  coordinator.shutdown()


# --- the coordinator's contract ----------------------------------------------------------


def test_fetch_before_done_blocks_then_returns():
  strategy = make(num_workers=1)
  coordinator = jdist.ClusterCoordinator(strategy)
  assert jdist.ClusterCoordinator(strategy) is coordinator  # one per strategy
  gate = threading.Event()
  result = coordinator.schedule(lambda x: (gate.wait(10), x * 2)[1],
                                args=(np.float32(21),))
  assert not result.done() and not coordinator.done()
  threading.Timer(0.2, gate.set).start()
  start = time.monotonic()
  assert result.fetch() == 42.0
  assert 0.1 < time.monotonic() - start < 5
  coordinator.join()
  assert coordinator.done()
  coordinator.shutdown()


def test_an_error_reaches_join_and_cancels_what_is_queued(no_thread_left):
  strategy = make(num_workers=1)
  coordinator = jdist.ClusterCoordinator(strategy)
  gate = threading.Event()

  def boom():
    gate.wait(10)
    raise ZeroDivisionError("on the worker")

  failing = coordinator.schedule(boom)
  queued = [coordinator.schedule(lambda: 1) for _ in range(3)]
  gate.set()
  with pytest.raises(ZeroDivisionError, match="on the worker"):
    coordinator.join()
  with pytest.raises(ZeroDivisionError):
    failing.fetch()
  for r in queued:
    with pytest.raises(jdist.CancelledError, match="Schedule it again"):
      r.fetch()
  # The error was raised once; the coordinator goes on.
  assert coordinator.schedule(lambda: 7).fetch() == 7
  coordinator.join()
  coordinator.shutdown()


def test_dataset_fn_error_reaches_join_with_its_traceback():
  strategy = make(num_workers=2)
  coordinator = jdist.ClusterCoordinator(strategy)

  def dataset_fn():
    raise FileNotFoundError("no such file: /data/train-*.tfrecord")

  iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
  coordinator.schedule(lambda it: next(it), args=(iterator,))
  with pytest.raises(FileNotFoundError, match="train-") as info:
    coordinator.join()
  assert "dataset_fn" in "".join(traceback.format_tb(info.value.__traceback__))
  coordinator.shutdown()


def test_exhausted_per_worker_data_is_out_of_range():
  strategy = make(num_workers=1)
  coordinator = jdist.ClusterCoordinator(strategy)
  iterator = iter(coordinator.create_per_worker_dataset(
      lambda: [np.ones((2, 1), np.float32)]))
  results = [coordinator.schedule(lambda it: next(it), args=(iterator,))
             for _ in range(2)]
  with pytest.raises(jdist.OutOfRangeError, match="Repeat the per-worker"):
    coordinator.join()
  assert isinstance(results[0].fetch(), jdist.PerReplica)
  coordinator.shutdown()


def test_bad_input_is_a_clear_error():
  strategy = make(num_workers=1)
  coordinator = jdist.ClusterCoordinator(strategy)
  with pytest.raises(TypeError, match="needs a function to run on a worker, "
                     "got int"):
    coordinator.schedule(3)
  with pytest.raises(TypeError, match=r"must be a tuple of arguments"):
    coordinator.schedule(lambda x: x, args=np.ones(2))
  with pytest.raises(TypeError, match=r"kwargs=\.\.\.\) must be a dict.*got list"):
    coordinator.schedule(lambda x: x, kwargs=[1])
  rv = coordinator.schedule(lambda: 1)
  with pytest.raises(TypeError, match="A RemoteValue cannot be an argument"):
    coordinator.schedule(lambda x: x, args=(rv,))
  iterator = iter(coordinator.create_per_worker_dataset(lambda: [1]))
  with pytest.raises(TypeError, match="not iterated on the coordinator"):
    next(iterator)
  with pytest.raises(ValueError, match="options=.*create_per_worker_dataset"):
    strategy.distribute_datasets_from_function(lambda ctx: [],
                                               options=jdist.InputOptions())
  with pytest.raises(TypeError, match="per-worker batch is taken on a worker"):
    next(iter(strategy.distribute_datasets_from_function(
        lambda ctx: []))).distribute(strategy)
  with pytest.raises(TypeError, match="works with jdist.ParameterServerStrategy"):
    jdist.ClusterCoordinator(jdist.MirroredStrategy())
  coordinator.shutdown()
  with pytest.raises(RuntimeError, match="shut down"):
    coordinator.schedule(lambda: 1)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1.0])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(timeout):
  with pytest.raises(ValueError, match="timeout_seconds must be a positive "
                     "finite number"):
    make(num_workers=1, timeout_seconds=timeout)


@pytest.mark.parametrize("answer", [None, [2.5, 1], [True, 1], 3])
def test_a_partitioner_answer_that_is_not_counts_is_a_clear_error(answer):
  strategy = make(num_workers=1, num_ps=2,
                  variable_partitioner=lambda shape, dtype: answer)
  with pytest.raises(ValueError, match=r"variable_partitioner returned "
                     r".*must return a list of whole numbers"):
    strategy.replicate({"w": jnp.zeros((4, 2))})
  if strategy.attached_coordinator is not None:
    strategy.attached_coordinator.shutdown()


def test_cluster_without_parameter_servers_is_a_clear_error(monkeypatch):
  with pytest.raises(jdist.ClusterError, match="has no 'ps' tasks"):
    jdist.ParameterServerStrategy(Local(num_workers=2, num_ps=0))
  tf_config = {"cluster": {"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]},
               "task": {"type": "chief", "index": 0}}
  monkeypatch.setenv("TF_CONFIG", __import__("json").dumps(tf_config))
  with pytest.raises(jdist.ClusterError, match=r"has no 'ps' tasks \(from "
                     "TF_CONFIG\\)"):
    jdist.ParameterServerStrategy(None)
  with pytest.raises(TypeError, match="needs a cluster resolver"):
    jdist.ParameterServerStrategy("grpc://localhost:2222")


def test_tf_config_with_parameter_servers(monkeypatch):
  cluster = {"chief": ["h0:1"], "worker": ["h1:1", "h2:1", "h3:1"],
             "ps": ["h4:1", "h5:1"]}
  monkeypatch.setenv("TF_CONFIG", __import__("json").dumps(
      {"cluster": cluster, "task": {"type": "chief", "index": 0}}))
  strategy = jdist.ParameterServerStrategy(
      jdist.cluster_resolver.TFConfigClusterResolver())
  assert (strategy.num_workers, strategy.num_ps) == (3, 2)
  assert strategy.cluster_spec.ps == ("h4:1", "h5:1")
  # The synchronous strategies keep refusing parameter servers.
  with pytest.raises(jdist.ClusterError, match="Parameter servers belong to "
                     "ParameterServerStrategy"):
    jdist.cluster_resolver.TFConfigClusterResolver().resolve()
  for role in ("worker", "ps"):
    resolver = jdist.cluster_resolver.TFConfigClusterResolver(
        {"cluster": cluster, "task": {"type": role, "index": 1}})
    with pytest.raises(jdist.ClusterError, match=f"TF_CONFIG's '{role}' 1.*"
                       "only the chief runs"):
      jdist.ParameterServerStrategy(resolver)


# --- failures --------------------------------------------------------------------------


def test_worker_failure_reschedules_and_rebuilds_its_dataset(
    batches, digits_split, no_thread_left):
  tx = optax.sgd(0.1)
  strategy = make(num_workers=2)
  train_step = strategy.function(classifier_step(apply_fn, tx))
  built = []  # (worker, incarnation) of every per-worker dataset built
  params = init_params()
  with jdist.ClusterCoordinator(strategy) as coordinator:
    state = strategy.replicate((params, tx.init(params)))

    def dataset_fn(ctx):
      built.append(ctx.input_pipeline_id)
      while True:
        for b in batches:
          yield b

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    calls = iter(range(10**6))

    def step_fn(iterator):
      batch = next(iterator)
      if next(calls) in (30, 31, 200):  # a worker dies mid-step
        raise jdist.WorkerFailedError("preempted")
      _, loss = train_step(state, batch)
      return strategy.reduce("sum", loss)

    results = [coordinator.schedule(step_fn, args=(iterator,))
               for _ in range(400)]
    coordinator.join()
    assert all(np.isfinite(r.fetch()) for r in results)  # every one ran
    assert state.version()[0] >= 400
    # Three failures: three datasets rebuilt, on top of one per worker.
    assert len(built) == 2 + 3
    sync = accuracy(train_sync(batches, tx)[0], digits_split)
    got = accuracy(state.read()[0], digits_split)
    assert sync > 0.85 and abs(got - sync) <= 0.03, (got, sync)


def test_a_function_that_kills_every_worker_fails_in_the_end():
  strategy = make(num_workers=2)
  coordinator = jdist.ClusterCoordinator(strategy)

  def doomed():
    raise jdist.WorkerFailedError("always")

  result = coordinator.schedule(doomed)
  with pytest.raises(jdist.WorkerFailedError, match="started 6 times"):
    coordinator.join()
  with pytest.raises(jdist.WorkerFailedError):
    result.fetch()
  coordinator.shutdown()


def test_parameter_server_failure_is_raised_from_then_on():
  strategy = make(num_workers=2)
  coordinator = jdist.ClusterCoordinator(strategy)
  v = strategy.replicate(jnp.zeros(2))

  def lost():
    raise jdist.ParameterServerError("parameter server 0 is unavailable")

  coordinator.schedule(lost)
  with pytest.raises(jdist.ParameterServerError):
    coordinator.join()
  for call in (coordinator.join, coordinator.done,
               lambda: coordinator.schedule(lambda: 1)):
    with pytest.raises(jdist.ParameterServerError):
      call()
  coordinator.shutdown()
  with pytest.raises(jdist.ParameterServerError, match="shut down"):
    v.read(wait=False)


# --- Keras-style training ----------------------------------------------------------------


def make_trainer(strategy, model=None, **kwargs):
  with strategy.scope():
    return jdist.Trainer(model or MLP(hidden=32), optimizer=kwargs.pop(
        "optimizer", optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], **kwargs)


def test_fit_with_one_worker_matches_one_device(digits_split):
  (x, y), val = digits_split
  runs = {}
  for name, strategy in (("one", jdist.OneDeviceStrategy()),
                         ("ps", make(num_workers=1))):
    trainer = make_trainer(strategy)
    history = trainer.fit(x[:600], y[:600], batch_size=32, epochs=2,
                          validation_data=val, verbose=0)
    runs[name] = (trainer, history.history)
  (one, h1), (ps, h2) = runs["one"], runs["ps"]
  assert sorted(h2) == ["accuracy", "loss", "val_accuracy", "val_loss"]
  for key in h1:
    np.testing.assert_allclose(h2[key], h1[key], rtol=1e-5, err_msg=key)
  assert isinstance(ps.state, jdist.ServerVariables)
  assert ps.global_step == one.global_step == 2 * 19
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               ps.params, one.params)
  ps.strategy.coordinator.shutdown()


def test_fit_on_workers_evaluates_inline_and_exactly(digits_split):
  (x, y), (vx, vy) = digits_split
  strategy = make(num_workers=2)
  trainer = make_trainer(strategy)
  sync = make_trainer(jdist.OneDeviceStrategy())
  history = trainer.fit(x, y, batch_size=32, epochs=3, validation_data=(vx, vy),
                        verbose=0).history
  sync_history = sync.fit(x, y, batch_size=32, epochs=3,
                          validation_data=(vx, vy), verbose=0).history
  got, want = history["val_accuracy"][-1], sync_history["val_accuracy"][-1]
  assert want > 0.85 and abs(got - want) <= 0.03, (got, want)
  assert history["loss"][-1] < history["loss"][0] / 2
  # Evaluation and prediction run on the workers; every example counts once.
  logits = np.asarray(apply_fn(trainer.params, vx))
  for batch_size in (32, 50):  # 397 examples: short last batches
    got = trainer.evaluate(vx, vy, batch_size=batch_size)
    assert got["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == vy))
    assert got["loss"] == pytest.approx(float(np.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, vy))), rel=1e-5)
    pred = trainer.predict(vx, batch_size=batch_size)
    assert pred.shape == (397, 10)
    np.testing.assert_allclose(pred, logits, rtol=1e-5, atol=1e-5)
  trainer.learning_rate = 1e-4
  assert trainer.learning_rate == pytest.approx(1e-4)
  strategy.coordinator.shutdown()


def test_fit_an_endless_generator_with_steps_per_epoch(digits_split):
  (x, y), _ = digits_split
  strategy = make(num_workers=2)
  trainer = make_trainer(strategy)

  def forever():
    rng = np.random.default_rng(0)
    while True:
      i = rng.choice(len(x), 32, replace=False)
      yield x[i], y[i]

  history = trainer.fit(forever(), steps_per_epoch=25, epochs=2, verbose=0)
  assert history.epoch == [0, 1] and trainer.global_step == 50
  assert int(trainer.state.read().step) == 50
  strategy.coordinator.shutdown()


def test_fit_an_nnx_module(digits_split):
  from flax import nnx
  (x, y), (vx, vy) = digits_split

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(64, 32, rngs=rngs)
      self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
      return self.out(nnx.relu(self.hidden(x)))

  net = Net(nnx.Rngs(0))
  strategy = make(num_workers=2)
  trainer = make_trainer(strategy, model=net)
  trainer.fit(x, y, batch_size=32, epochs=2, verbose=0)
  # fit wrote the trained weights back into the module, as Keras does.
  assert np.mean(np.argmax(net(vx), -1) == vy) > 0.8
  strategy.coordinator.shutdown()


def test_backup_and_restore_resumes_on_new_servers(digits_split, tmp_path):
  """The recovery TensorFlow prescribes for a lost server: a new cluster, the
  variables restored from the last backup. One worker: exactly the same run."""
  (x, y), val = digits_split
  x, y = x[:640], y[:640]

  def run(callbacks):
    strategy = make(num_workers=1)
    trainer = make_trainer(strategy)
    try:
      history = trainer.fit(x, y, batch_size=64, epochs=3, validation_data=val,
                            callbacks=callbacks, verbose=0)
      return trainer.params, trainer.global_step, history.history
    finally:
      strategy.coordinator.shutdown()  # the cluster (and servers) go

  reference, _, ref_history = run([])
  with pytest.raises(KeyboardInterrupt):
    run([Interrupt(17), jdist.BackupAndRestore(tmp_path, save_freq=5)])
  backup = jdist.BackupAndRestore(tmp_path, save_freq=5)
  params, step, history = run([backup])
  assert backup.restored_step == 15 and step == 30
  for key, values in ref_history.items():
    np.testing.assert_allclose(history[key], values, rtol=1e-5, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
               params, reference)


class ScriptedValLoss(jdist.Callback):
  """Replaces val_loss by scripted scores (callbacks share one logs dict, as
  in Keras) and keeps each epoch's parameters as read then."""

  def __init__(self, scores):
    super().__init__()
    self.scores, self.params_at = scores, []

  def on_epoch_end(self, epoch, logs=None):
    logs["val_loss"] = self.scores[epoch]
    self.params_at.append(jax.device_get(self.model.params))


def test_model_checkpoint_and_early_stopping_read_the_servers(digits_split,
                                                             tmp_path):
  (x, y), val = digits_split
  strategy = make(num_workers=2)
  trainer = make_trainer(strategy)
  # Best at epoch 1, worse at epoch 2: patience 1 stops there and restores
  # epoch 1's parameters, which are not the last ones.
  script = ScriptedValLoss([0.9, 0.5, 0.7, 0.8])
  stop = jdist.EarlyStopping(monitor="val_loss", patience=1,
                             restore_best_weights=True)
  history = trainer.fit(x[:640], y[:640], batch_size=64, epochs=4,
                        validation_data=val, verbose=0, callbacks=[
                            script, jdist.ModelCheckpoint(tmp_path), stop])
  assert (stop.best_epoch, stop.stopped_epoch) == (1, 2)
  assert history.history["val_loss"] == [0.9, 0.5, 0.7]
  # The best weights are a copy taken then, not the live variables.
  assert isinstance(stop.best_state.params["Dense_0"]["kernel"], np.ndarray)
  best, last = script.params_at[1], script.params_at[2]
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(best), jax.tree.leaves(last)))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params),
               best)
  # The checkpoint of the servers' variables (the last epoch's) loads into a
  # new cluster.
  other = make(num_workers=1)
  loaded = make_trainer(other)
  loaded.build(x[:1])
  assert loaded.load_checkpoint(tmp_path) == trainer.global_step
  np.testing.assert_allclose(loaded.predict(val[0]),
                             np.asarray(apply_fn(last, val[0])), rtol=1e-5,
                             atol=1e-6)
  strategy.coordinator.shutdown()
  other.coordinator.shutdown()


def test_flax_train_state_keeps_jax_dtypes_on_the_servers():
  """TrainState.create stores step as the Python int 0: the servers keep it as
  JAX would (int32 with x64 off), so the step's step + 1 fits it."""
  from flax.training import train_state
  tx = optax.sgd(0.1, momentum=0.9)
  loss_fn = lambda p, x: jnp.mean(jnp.sum((p["w"] - x) ** 2, -1))

  def step(state, x):
    grads = jax.grad(loss_fn)(state.params, x)
    grads = jdist.get_replica_context().all_reduce("mean", grads)
    return state.apply_gradients(grads=grads), state.step

  strategy = make(num_workers=1)
  state = strategy.replicate(train_state.TrainState.create(
      apply_fn=None, params={"w": jnp.zeros(2)}, tx=tx))
  ps_step = strategy.function(step)
  for _ in range(5):
    state, _ = ps_step(state, np.ones((4, 2), np.float32))
  w, trace = np.zeros(2), np.zeros(2)  # SGD with momentum in numpy
  for _ in range(5):
    trace = 0.9 * trace + 2 * (w - 1)
    w = w - 0.1 * trace
  got = state.read()
  assert got.step.dtype == jnp.int32 and int(got.step) == 5
  np.testing.assert_allclose(got.params["w"], w, rtol=1e-6)
  strategy.coordinator.shutdown()
