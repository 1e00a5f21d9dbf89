"""`jdist.CheckpointManager(snapshot_every=N)` in one process: the in-memory
snapshot restores exactly what the persistent checkpoint restores (also onto
another number of devices, with optimizer state split over the replicas),
only the newest snapshot is kept, and a snapshot that cannot be used leaves
the restore to the persistent directory with a line that says why. The jobs
of several processes are in tests/multiprocess/test_snapshot_restarts.py."""

import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import jdist
from conftest import strategy_on
from jdist.examples.models import MLP

MODEL = MLP(hidden=16)


@pytest.fixture
def job(tmp_path, monkeypatch):
  """This process as attempt 0 of a `jdist launch` job whose snapshots go
  under tmp_path/shm; returns the directory they go in."""
  monkeypatch.setenv("JDIST_RUN_ID", "testjob")
  monkeypatch.setenv("JDIST_SNAPSHOT_ROOT", str(tmp_path / "shm"))
  monkeypatch.setenv("JDIST_RESTART_COUNT", "0")
  return tmp_path / "shm"


def _state(strategy, x):
  params = MODEL.init(jax.random.key(0), x[:1])["params"]
  tx = jdist.ShardedOptimizer(optax.adam(1e-2), strategy)
  with strategy.scope():
    return strategy.replicate(train_state.TrainState.create(
        apply_fn=MODEL.apply, params=params, tx=tx))


def _trained(strategy, digits_flat, steps=3):
  x, y = digits_flat
  state = _state(strategy, x)

  @strategy.function
  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

  for batch in strategy.experimental_distribute_dataset(
      [{"x": x[:64], "y": y[:64]}] * steps):
    state = step(state, batch)
  return state


def _parts(job) -> list:
  return sorted(name for _, _, files in os.walk(job) for name in files)


def test_memory_restores_what_disk_restores_onto_other_devices(
    digits_flat, tmp_path, job, capfd, monkeypatch):
  """Saved on 4 devices (adam's state split 4 ways), restored onto 2 (split
  2 ways): the snapshot and the checkpoint of the same step give the same
  bits, and the saved values. A restore from memory never opens the
  persistent directory with orbax (its opening is a barrier of all the
  processes, the slow part of a restore)."""
  saved = _trained(strategy_on(4), digits_flat)
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy_on(4),
                               snapshot_every=10) as manager:
    assert manager.save(10, saved) == str(tmp_path / "ckpt" / "10")
    assert manager.snapshot_step is None  # written at the next save, or close
    assert manager.latest_step == 10  # the checkpoint's
  two = strategy_on(2)
  like = _state(two, digits_flat[0])
  with monkeypatch.context() as m:
    def refused(*args, **kwargs):
      raise AssertionError("orbax opened the checkpoint directory")
    m.setattr(ocp, "CheckpointManager", refused)
    with jdist.CheckpointManager(tmp_path / "ckpt", strategy=two,
                                 snapshot_every=10) as manager:
      assert manager.snapshot_step == 10 and manager.latest_step == 10
      memory = manager.restore(like)
  assert "restored step 10 from the in-memory snapshot" in capfd.readouterr().err
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=two) as manager:
    disk = manager.restore(like)
  assert any(any(l.sharding.spec) for l in jax.tree.leaves(like))  # adam's, split
  for m, d, s, l in zip(jax.tree.leaves(memory), jax.tree.leaves(disk),
                        jax.tree.leaves(saved), jax.tree.leaves(like)):
    assert m.sharding == l.sharding  # split as the target is
    np.testing.assert_array_equal(np.asarray(m), np.asarray(d))
    np.testing.assert_array_equal(np.asarray(m), np.asarray(s))


def test_only_the_newest_snapshot_is_kept_and_disk_saves_are_rarer(
    digits_flat, tmp_path, job):
  strategy = strategy_on(2)
  state = _trained(strategy, digits_flat, steps=1)
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               save_every=20, snapshot_every=5) as manager:
    written = [manager.save(s, state) for s in range(1, 31)]
    assert [w for w in written if w] == [str(tmp_path / "ckpt" / "20")]
    # 30 was taken by the last save; it is written at the next, or at close.
    assert manager.steps == [20] and manager.latest_step == 25
  assert [p.split(".part")[0] for p in _parts(job)] == ["step-000000000030.attempt-0"]


def test_snapshots_written_over_an_old_file_come_back_exact(tmp_path, job):
  """From the third snapshot on, a process writes each over its file of an
  old one (its spare): the values restored are the last snapshot's."""
  strategy = strategy_on(2)
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               save_every=100, snapshot_every=1) as manager:
    for step in range(1, 7):
      state = strategy.replicate({"w": np.arange(6, dtype=np.float32) * step,
                                  "n": np.int32(step)})
      assert manager.save(step, state) is None
    restored = manager.restore(state)
    assert manager.latest_step == 6
  np.testing.assert_array_equal(np.asarray(restored["w"]),
                                np.arange(6, dtype=np.float32) * 6)
  assert int(restored["n"]) == 6


def test_a_smaller_snapshot_over_a_larger_old_file_is_cut_to_its_length(
    tmp_path, job):
  """When the state shrinks (its layout changed), a snapshot written over
  the file of an old, larger one (the spare) cuts that file to its own
  length: no byte of the old snapshot stays at its end, and the restore
  gives the last snapshot's values."""
  strategy = strategy_on(2)

  def newest_size() -> int:
    (path,) = [os.path.join(r, f) for r, _, fs in os.walk(job) for f in fs
               if f.startswith("step-")]
    return os.path.getsize(path)

  sizes = {}
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               save_every=100, snapshot_every=1) as manager:
    for step in range(1, 8):
      n = 4096 if step <= 3 else 6  # 16 KiB of values, then 24 bytes
      state = strategy.replicate({"w": np.arange(n, dtype=np.float32) * step})
      manager.save(step, state)
      if step > 1:
        assert manager.snapshot_step == step - 1  # (the writer has written it)
        sizes[step - 1] = newest_size()
    restored = manager.restore(state)
  # (The header's numbers make sizes of one layout differ by a byte or so.)
  assert all(sizes[s] > 4096 * 4 for s in (1, 2, 3)), sizes
  assert all(sizes[s] < 1024 for s in (4, 5, 6)), sizes
  np.testing.assert_array_equal(np.asarray(restored["w"]),
                                np.arange(6, dtype=np.float32) * 7)


def test_an_unusable_snapshot_leaves_the_restore_to_disk(
    digits_flat, tmp_path, job, capfd):
  """A part that fails its checksum, and a newer snapshot of which a part
  is missing (a process killed while writing it: only its temporary file is
  there): the checkpoint on disk is restored, and the line says why."""
  strategy = strategy_on(2)
  state = _trained(strategy, digits_flat, steps=1)
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               snapshot_every=10) as manager:
    manager.save(10, state)
  (part,) = [os.path.join(r, f) for r, _, fs in os.walk(job) for f in fs]
  with open(part, "r+b") as f:  # one byte of the data changed
    f.seek(-1, os.SEEK_END)
    last = f.read(1)
    f.seek(-1, os.SEEK_END)
    f.write(bytes([last[0] ^ 1]))
  # A newer snapshot that process 1 of 3 never finished (the file of
  # process 0 holds its part and the replica of process 2's).
  folder = os.path.dirname(part)
  with open(os.path.join(folder, "step-000000000020.attempt-0.part-0-of-3.snap"),
            "wb") as f:
    f.write(b"JDSNAP1\n")
  with open(os.path.join(folder, ".tmp-1-999999999.snap"), "wb") as f:
    f.write(b"JDSNAP1\n")
  like = _state(strategy, digits_flat[0])
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               snapshot_every=10) as manager:
    assert manager.snapshot_step == 10
    restored = manager.restore(like)
    err = capfd.readouterr().err
    assert ("the snapshot of step 20 (attempt 0) lacks the parts of processes "
            "[1] of 3" in err), err
    assert ("the in-memory snapshot of step 10 cannot be used: "
            "step-000000000010.attempt-0.part-0-of-1.snap fails its checksum; "
            f"restoring from the checkpoint of step 10 in {tmp_path / 'ckpt'}"
            in err), err
    for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
      np.testing.assert_array_equal(np.asarray(r), np.asarray(s))
    manager.save(20, restored)  # the next snapshot clears what is stale
  assert [p.split(".part")[0] for p in _parts(job)] == ["step-000000000020.attempt-0"]


def test_snapshots_need_a_launched_job(tmp_path, monkeypatch):
  monkeypatch.delenv("JDIST_RUN_ID", raising=False)
  with pytest.raises(ValueError, match="jdist launch"):
    jdist.CheckpointManager(tmp_path, snapshot_every=10)
  with pytest.raises(ValueError, match="snapshot_every=0"):
    jdist.CheckpointManager(tmp_path, snapshot_every=0)


def test_every_kind_of_leaf_comes_back_bit_for_bit(tmp_path, job):
  """bfloat16, integers, booleans, complex, a scalar, an empty array, a PRNG
  key, and int4 (a byte per value in numpy, half a byte on the device) split
  over the devices."""
  strategy = strategy_on(2)
  state = strategy.replicate({
      "bf16": jax.numpy.arange(5, dtype=jax.numpy.bfloat16) / 3,
      "int": jax.numpy.arange(6, dtype=jax.numpy.int32).reshape(2, 3),
      "bool": jax.numpy.array([True, False]), "scalar": jax.numpy.float32(2.5),
      "complex": jax.numpy.array([1 + 2j, -3.5j], jax.numpy.complex64),
      "empty": jax.numpy.zeros((0, 4)), "key": jax.random.key(7)})
  int4 = np.array([-8, -1, 0, 1, 7, 3, -2, 5], jax.numpy.int4)
  state["int4"] = jax.make_array_from_callback(
      (8,), NamedSharding(strategy.mesh, P(strategy.mesh.axis_names[0])),
      lambda i: int4[i])
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               save_every=100, snapshot_every=1) as manager:
    assert manager.save(1, state) is None  # in memory only
    restored = manager.restore(state)  # (it writes the snapshot taken first)
    assert manager.steps == [] and manager.latest_step == 1
  for name in state:
    want, got = state[name], restored[name]
    if name == "key":
      want, got = jax.random.key_data(want), jax.random.key_data(got)
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if name == "int4":
      assert got.sharding == want.sharding  # split as it was
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), name)


def test_a_step_that_donates_its_state_loses_no_snapshot(tmp_path, job, capfd):
  """The snapshot taken at a save is written at the next, after a step that
  donates the state (deletes its arrays): taking it packed a copy, so every
  snapshot is written, with the values it was taken with."""
  strategy = strategy_on(2)
  step = strategy.function(lambda s: jax.tree.map(lambda x: x + 1, s),
                           donate_argnums=0)
  state = strategy.replicate({"w": jax.numpy.zeros(3),
                              "n": jax.numpy.arange(4, dtype=jax.numpy.int8)})
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               save_every=100, snapshot_every=2) as manager:
    for i in range(1, 4):
      state = step(state)
      manager.save(i, state)
    assert manager.snapshot_step == 2  # written at the save of step 3
    restored = manager.restore(jax.eval_shape(lambda: state))
  assert "lost" not in capfd.readouterr().err
  np.testing.assert_array_equal(np.asarray(restored["w"]), [2.0, 2.0, 2.0])
  np.testing.assert_array_equal(np.asarray(restored["n"]), [2, 3, 4, 5])


def test_a_leaf_that_is_not_an_array_is_refused_by_name(tmp_path, job):
  """A Python float (or int) in the state: a TypeError that names it, at
  the save, before anything is written to memory or disk."""
  strategy = strategy_on(2)
  state = {"w": strategy.replicate(jax.numpy.ones(3)), "lr": 0.5, "n": 3}
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               snapshot_every=1) as manager:
    with pytest.raises(TypeError, match=r"lr \(a Python float: 0\.5\), n "
                       r"\(a Python int: 3\)\. .*jnp\.asarray"):
      manager.save(1, state)
    assert manager.latest_step is None
    state = dict(state, lr=jax.numpy.float32(0.5), n=jax.numpy.int32(3))
    manager.save(1, state)
    restored = manager.restore(state)
  assert float(restored["lr"]) == 0.5 and int(restored["n"]) == 3
  assert _parts(job) == ["step-000000000001.attempt-0.part-0-of-1.snap"]


def test_the_writer_threads_error_is_raised_at_the_next_call(tmp_path, job):
  """The part is written by a background thread after the `save` that
  follows the snapshot's: its error (here the snapshot directory replaced
  by a file) comes out of the next `save`, or of `close`, once."""
  strategy = strategy_on(2)
  state = strategy.replicate({"w": jax.numpy.zeros(3)})
  manager = jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                                    save_every=100, snapshot_every=2)
  (folder,) = [os.path.join(r, d) for r, ds, _ in os.walk(job) for d in ds
               if r != str(job)]
  manager.save(2, state)  # taken
  os.rmdir(folder)
  open(folder, "w").close()
  manager.save(3, state)  # handed to the writer, which fails
  with pytest.raises(NotADirectoryError):
    manager.save(4, state)
  manager.save(5, state)  # raised once
  manager.save(6, state)
  manager.save(7, state)  # 6 handed to the writer, which fails
  with pytest.raises(NotADirectoryError):
    manager.close()


def test_a_state_with_nan_is_not_written_and_the_one_before_stays(
    tmp_path, job, capfd):
  """A NaN in one leaf (after leaves of other types, before others of its
  own): that snapshot is not written, a line names the leaf, and the
  restore takes the snapshot before it."""
  strategy = strategy_on(2)
  good = strategy.replicate({"a": jax.numpy.arange(3, dtype=jax.numpy.int32),
                             "b": jax.numpy.ones(4), "c": jax.numpy.ones(2)})
  bad = dict(good, c=strategy.replicate(jax.numpy.array([1.0, np.nan])))
  with jdist.CheckpointManager(tmp_path / "ckpt", strategy=strategy,
                               save_every=100, snapshot_every=1) as manager:
    manager.save(1, good)
    manager.save(2, bad)
    restored = manager.restore(good)
    assert manager.latest_step == 1
  assert ("not writing the in-memory snapshot of step 2: c has NaN or "
          "infinite values" in capfd.readouterr().err)
  np.testing.assert_array_equal(np.asarray(restored["c"]), [1.0, 1.0])
