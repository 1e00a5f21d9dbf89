"""`jdist.CheckpointManager` in a custom loop, as the multi-worker tutorial
writes one: flax's TrainState, a `strategy.function` step, a save every few
steps, a restart that restores the newest checkpoint and finishes exactly as
an uninterrupted run, on the same or another number of devices."""

import glob
import os
import pathlib
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import jdist
import jdist.testing
from conftest import strategy_on
from jdist.examples.models import MLP

MODEL = MLP(hidden=16)


def _batches(digits_flat, n=12, size=64):
  x, y = digits_flat
  return [{"x": x[i * size:(i + 1) * size], "y": y[i * size:(i + 1) * size]}
          for i in range(n)]


def _initial(strategy, batches, tx=None):
  params = MODEL.init(jax.random.key(0), batches[0]["x"][:1])["params"]
  with strategy.scope():
    return strategy.replicate(train_state.TrainState.create(
        apply_fn=MODEL.apply, params=params,
        tx=tx or optax.sgd(0.1, momentum=0.9)))


def _step(strategy):
  @strategy.function
  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  return step


def _train(strategy, batches, directory=None, stop_at=None):
  """The tutorial's loop: resume if there is a checkpoint, save every 4."""
  state, start = _initial(strategy, batches), 0
  step = _step(strategy)
  manager = directory and jdist.CheckpointManager(directory, max_to_keep=2,
                                                  strategy=strategy)
  if manager and manager.latest_step is not None:
    start = manager.latest_step
    state = manager.restore(state)
    assert int(state.step) == start
  dist = strategy.experimental_distribute_dataset(batches[start:])
  for i, batch in enumerate(dist, start):
    if i == stop_at:
      manager.close()  # the job ends here (its process would exit)
      return None
    state, _ = step(state, batch)
    if manager and (i + 1) % 4 == 0:
      manager.save(i + 1, state)
  if manager:
    manager.close()
  return jax.device_get((state.params, state.opt_state))


@pytest.mark.parametrize("saved_on,resumed_on", [(4, 4), (4, 2), (2, 1)])
def test_a_restarted_loop_finishes_as_an_uninterrupted_one(
    digits_flat, tmp_path, saved_on, resumed_on):
  batches = _batches(digits_flat)
  reference = _train(strategy_on(4), batches)
  assert _train(strategy_on(saved_on), batches, tmp_path, stop_at=10) is None
  assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [4, 8]
  resumed = _train(strategy_on(resumed_on), batches, tmp_path)
  problems = jdist.testing.compare_trees(reference, resumed, rtol=1e-5,
                                         atol=1e-6, names=("uninterrupted",
                                                           "resumed"))
  assert not problems, "\n".join(problems)


def test_the_manager_says_what_it_holds_and_what_is_wrong(digits_flat,
                                                           tmp_path):
  strategy = strategy_on(2)
  batches = _batches(digits_flat, n=1)
  state = _initial(strategy, batches)
  with jdist.CheckpointManager(tmp_path, strategy=strategy) as manager:
    assert manager.latest_step is None and manager.latest_checkpoint is None
    with pytest.raises(jdist.CheckpointNotFoundError, match="latest_step"):
      manager.restore(state)
    assert manager.save(7, state) == str(tmp_path / "7")
    assert manager.latest_checkpoint == str(tmp_path / "7")
    # A second job on the same directory is refused, not interleaved.
    with pytest.raises(jdist.CheckpointInUseError):
      jdist.CheckpointManager(tmp_path)
    # Another model's state: the differing leaves are named.
    other = _initial(strategy, batches, tx=optax.adam(1e-3))
    with pytest.raises(jdist.CheckpointMismatchError, match=r"opt_state/0/mu"):
      manager.restore(other)
  with pytest.raises(ValueError, match="max_to_keep=0"):
    jdist.CheckpointManager(tmp_path, max_to_keep=0)


def test_a_save_a_killed_job_left_half_written_is_removed(digits_flat,
                                                           tmp_path):
  strategy = strategy_on(2)
  state = _initial(strategy, _batches(digits_flat, n=1))
  with jdist.CheckpointManager(tmp_path, strategy=strategy) as manager:
    manager.save(4, state)
  left = tmp_path / "8.orbax-checkpoint-tmp"
  (left / "state").mkdir(parents=True)  # what a kill -9 during a save leaves
  with jdist.CheckpointManager(tmp_path, strategy=strategy) as manager:
    assert manager.steps == [4]
    restored = manager.restore(state)
    manager.save(12, restored)  # the next save waits for the clean-up too
  assert sorted(os.listdir(tmp_path)) == ["12", "4"]
  assert int(restored.step) == 0


def test_a_state_restores_from_its_shapes_alone(digits_flat, tmp_path):
  """`restore(jax.eval_shape(make_state))`: a restarted job need not compute
  an initial state to restore into; the state comes back mirrored on the
  manager's strategy."""
  batches = _batches(digits_flat)
  saved = _initial(strategy_on(4), batches)
  with jdist.CheckpointManager(tmp_path, strategy=strategy_on(4)) as manager:
    manager.save(1, saved)
  three = strategy_on(3)
  with jdist.CheckpointManager(tmp_path, strategy=three) as manager:
    restored = manager.restore(jax.eval_shape(lambda: saved))
  assert restored.params["Dense_0"]["kernel"].sharding.mesh == three.mesh
  problems = jdist.testing.compare_trees(jax.device_get(saved),
                                         jax.device_get(restored), rtol=0, atol=0)
  assert not problems, "\n".join(problems)


def test_shapes_alone_restore_split_as_the_managers_model_parallel_strategy(
    tmp_path):
  """`restore(jax.eval_shape(...))` under a `ModelParallelStrategy`: each
  leaf comes back split as the strategy's LayoutMap lays it out (as a fresh
  `strategy.init` would hold it), not whole on every device."""
  layout_map = jdist.LayoutMap(jdist.DeviceMesh((2, 2), ("data", "model")))
  layout_map["kernel"] = (None, "model")
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map)
  state = strategy.init(lambda: {"kernel": jnp.arange(32.0).reshape(4, 8),
                                 "bias": jnp.ones((8,))})
  with jdist.CheckpointManager(tmp_path, strategy=strategy) as manager:
    manager.save(1, state)
    restored = manager.restore(jax.eval_shape(lambda: state))
  assert restored["kernel"].sharding.spec == P(None, "model")
  assert restored["kernel"].addressable_shards[0].data.shape == (4, 4)
  np.testing.assert_array_equal(restored["kernel"], state["kernel"])
  np.testing.assert_array_equal(restored["bias"], state["bias"])


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_prng_key_restores_from_its_shapes_alone(tmp_path, monkeypatch,
                                                   in_memory):
  """A state that carries a PRNG key (dropout's) restores into its shapes
  alone, from disk and from an in-memory snapshot: the key comes back a
  key, of its implementation, with its bits."""
  kwargs = {}
  if in_memory:  # as a process of a `jdist launch` job
    monkeypatch.setenv("JDIST_RUN_ID", "testjob")
    monkeypatch.setenv("JDIST_SNAPSHOT_ROOT", str(tmp_path / "shm"))
    monkeypatch.setenv("JDIST_RESTART_COUNT", "0")
    kwargs = {"snapshot_every": 1}
  strategy = strategy_on(2)
  saved = strategy.replicate({"w": jnp.arange(4.0),
                              "dropout": jax.random.key(7, impl="rbg")})
  with jdist.CheckpointManager(tmp_path / "c", strategy=strategy,
                               **kwargs) as m:
    m.save(1, saved)
  if in_memory:  # the persistent checkpoint gone: only the snapshot is left
    shutil.rmtree(tmp_path / "c" / "1")
  with jdist.CheckpointManager(tmp_path / "c", strategy=strategy,
                               **kwargs) as m:
    restored = m.restore(jax.eval_shape(lambda: saved))
  assert restored["dropout"].dtype == saved["dropout"].dtype
  np.testing.assert_array_equal(jax.random.key_data(restored["dropout"]),
                                jax.random.key_data(saved["dropout"]))
  np.testing.assert_array_equal(restored["w"], saved["w"])


def _split(strategy, x):
  """`x` split over the strategy's replicas (as a ShardedOptimizer's state)."""
  return jax.device_put(x, NamedSharding(strategy.mesh, P("replica")))


def test_no_flipped_bit_in_the_newest_checkpoint_is_restored(tmp_path):
  """30 single-bit flips in the file that holds the newest checkpoint's
  arrays (orbax reads it all the same): each restore skips it with the
  warning and returns the checkpoint before it, or raises, or (a bit of the
  file that no read uses) returns the newest bit for bit; never other
  values. Saved on 4 devices (a leaf split over them), restored onto 2: the
  content hash is verified on another mesh than the one that made it."""
  rng = np.random.default_rng(0)
  four, two = strategy_on(4), strategy_on(2)
  values = {"w": rng.normal(size=(48, 32)).astype(np.float32),
            "split": rng.normal(size=(16, 8)).astype(np.float32),
            "step": np.int32(0)}
  place = lambda s, v: {**s.replicate({"w": v["w"], "step": v["step"]}),
                        "split": _split(s, v["split"])}
  newer = jax.tree.map(lambda x: x + 1, values)
  with jdist.CheckpointManager(tmp_path, strategy=four) as manager:
    manager.save(1, place(four, values))
    manager.save(2, place(four, newer))
  files = glob.glob(str(tmp_path / "2" / "state" / "**" / "d" / "*"),
                    recursive=True)
  array_file = pathlib.Path(max(files, key=os.path.getsize))  # (6 KiB+)
  raw = array_file.read_bytes()
  like = place(two, jax.tree.map(np.zeros_like, values))
  outcomes = []
  with jdist.CheckpointManager(tmp_path, strategy=two) as manager:
    for bit in np.random.default_rng(1).choice(len(raw) * 8, 30, replace=False):
      flipped = bytearray(raw)
      flipped[bit // 8] ^= 1 << (bit % 8)
      array_file.write_bytes(bytes(flipped))
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
          got = manager.restore(like)
        except jdist.CheckpointError:
          outcomes.append("raised")
          continue
      step = manager.restored_step
      assert manager.latest_step == step
      warned = [str(w.message) for w in caught
                if "/2 is corrupt: its arrays" in str(w.message)]
      assert (step == 1) == bool(warned), (bit, step, warned)
      problems = jdist.testing.compare_trees(values if step == 1 else newer,
                                             jax.device_get(got), rtol=0,
                                             atol=0)
      assert not problems, (bit, step, problems)
      outcomes.append("previous" if step == 1 else "newest, unchanged")
    assert got["split"].sharding.spec == P("replica")
  assert outcomes.count("previous") + outcomes.count("raised") >= 24, outcomes


def _documented_loop() -> str:
  """The custom loop that checkpoints, as docs/custom_loops.md prints it."""
  page = pathlib.Path(__file__).resolve().parent.parent / "docs" / \
      "custom_loops.md"
  for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
    if "jdist.CheckpointManager(" in block and "def job(" in block:
      return block
  raise AssertionError("docs/custom_loops.md prints no checkpointing loop")


def test_the_documented_loop_resumes_past_a_truncated_checkpoint(
    tmp_path, monkeypatch, capsys):
  """The documentation's loop, run as printed (a job stopped after step 6,
  restarted, and one never stopped: equal), then its job run again after
  the newest checkpoint of the restarted one (step 8) was truncated: it
  resumes from the step `restore` used, 4, and ends as the uninterrupted
  job did."""
  program = compile(_documented_loop(), "docs/custom_loops.md", "exec")
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__main__"}
  exec(program, namespace)
  assert capsys.readouterr().out == "resumed at step 4\nequal: True\n"
  assert sorted(os.listdir("ckpt")) == ["4", "8"]
  for path in glob.glob("ckpt/8/state/**/d/*", recursive=True):
    os.truncate(path, os.path.getsize(path) // 2)
  with pytest.warns(UserWarning, match=r"ckpt/8 is corrupt: its arrays"):
    resumed = namespace["job"]("ckpt")
  assert capsys.readouterr().out == "resumed at step 4\n"
  np.testing.assert_allclose(resumed, namespace["uninterrupted"], atol=1e-6)


def test_a_step_saved_again_is_replaced_and_a_closed_manager_saves_nothing(
    tmp_path):
  """A second `save(1, ...)` replaces step 1 (it used to be dropped while
  reported written); a replacement that a killed job left between its two
  renames is put in place by the next manager; `save` after `close` raises
  instead of writing without the directory's lock."""
  strategy = strategy_on(2)
  old, new = (strategy.replicate({"w": jnp.full(3, v)}) for v in (1.0, 2.0))
  directory = tmp_path / "ckpt"
  manager = jdist.CheckpointManager(directory, strategy=strategy)
  manager.save(1, old)
  manager.save(2, old)
  assert manager.save(1, new) == str(directory / "1")
  assert manager.steps == [1, 2]
  assert manager.restore(old, step=1)["w"].tolist() == [2.0] * 3
  manager.close()
  with pytest.raises(ValueError, match=r"Cannot save step 3 .* was closed, "
                     r"and with it the lock"):
    manager.save(3, new)
  assert sorted(os.listdir(directory)) == ["1", "2"]  # no lock, no step 3
  # Killed between the renames: step 2 moved out, its replacement complete.
  with jdist.CheckpointManager(tmp_path / "elsewhere") as other:
    other.save(2, new)
  os.makedirs(directory / ".jdist-replacing")
  os.rename(directory / "2", directory / ".jdist-replacing" / "old-2")
  os.rename(tmp_path / "elsewhere" / "2", directory / ".jdist-replacing" / "2")
  with jdist.CheckpointManager(directory, strategy=strategy) as manager:
    assert manager.steps == [1, 2]
    assert manager.restore(old)["w"].tolist() == [2.0] * 3
    assert manager.restored_step == 2
  assert sorted(os.listdir(directory)) == ["1", "2"]
