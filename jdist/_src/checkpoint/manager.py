"""`jdist.CheckpointManager`: checkpoints for custom training loops, with
in-memory snapshots (`snapshots/`) in a `jdist launch` job.

`BackupManager` is the subclass `BackupAndRestore` holds for `Trainer.fit`:
fit's metadata rides in its snapshots as one more leaf.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jdist._src import current
from jdist._src.checkpoint import checkpointer as ckpt_lib
from jdist._src.checkpoint import snapshots as snapshots_lib
from jdist._src.checkpoint.checkpointer import Checkpointer
from jdist._src.core import mesh_context
from jdist._src.errors import CheckpointNotFoundError
from jdist._src.launcher import job_env
from jdist._src.launcher import snapshot_dir


# The leaf that holds the metadata saved with a snapshot (`BackupAndRestore`:
# fit's position, history and data state), as JSON bytes: checksummed with
# the state's blocks, in every process's part. No path name of a state's
# leaf starts with "#" (a `Checkpointer` checkpoint holds it as `meta`).
META_LEAF = "#meta"


def check_steps(name: str, value) -> int | None:
  if value is not None and (isinstance(value, bool) or
                            not isinstance(value, int) or value < 1):
    raise ValueError(f"{name}={value!r}: give a positive number of steps, or "
                     "None.")
  return value


def launched_job(snapshot_every: int | None) -> str | None:
  """This `jdist launch` job's run id, or None.

  Raises:
    ValueError: `snapshot_every` is given outside `jdist launch`.
  """
  run_id = os.environ.get(job_env.ENV_RUN_ID)
  if snapshot_every is not None and not run_id:
    raise ValueError(
        f"snapshot_every={snapshot_every}: in-memory snapshots are kept for "
        "a job of `jdist launch`, which names them (JDIST_RUN_ID) and removes "
        "them when the job ends; this process was not started by it. Run "
        "the program with `jdist launch`, or leave out snapshot_every.")
  return run_id


def _meta_leaf(meta: dict) -> np.ndarray:
  """`meta` as JSON bytes padded to a power of two (at least 4 KiB), so the
  snapshot's layout stays the same while fit's history grows."""
  raw = json.dumps(meta).encode()  # (as a checkpoint holds it: same order)
  size = max(4096, 1 << (len(raw) - 1).bit_length())
  return np.frombuffer(raw.ljust(size), np.uint8)


class CheckpointManager:
  """Saves and restores a custom loop's state (any pytree of arrays).

  TensorFlow's `tf.train.CheckpointManager` with the state passed
  explicitly; any number of devices or processes restores a checkpoint
  (docs/checkpoints.md).

  Args:
    directory: where the checkpoints go (one orbax step directory each).
    max_to_keep: keep only the newest N checkpoints (None: all).
    strategy: whose devices `restore` places the state on (default: those
      of the state given to `restore`, else the strategy in scope).
    save_every: `save` writes only at its multiples (None: at every call).
    snapshot_every: in a `jdist launch` job, `save` also keeps an in-memory
      snapshot at its multiples, which `restore` takes when newest.

  Attributes:
    restored_step: the step the last `restore` restored (None before one).

  Raises:
    ValueError: `snapshot_every` outside `jdist launch`, or a bad count.
    jdist.CheckpointDirectoryError: the directory cannot be written.
    jdist.CheckpointInUseError: another running job writes checkpoints there.

  Example:
    >>> import jdist, jax.numpy as jnp, tempfile
    >>> strategy = jdist.MirroredStrategy()
    >>> state = strategy.replicate({"w": jnp.zeros(3), "step": jnp.int32(0)})
    >>> with jdist.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2,
    ...                              strategy=strategy) as manager:
    ...   for step in range(1, 4):
    ...     state = {"w": state["w"] + 1, "step": jnp.int32(step)}
    ...     _ = manager.save(step, state)
    ...   manager.steps, manager.latest_step
    ...   restored = manager.restore(state)
    ...   manager.restored_step
    ([2, 3], 3)
    3
    >>> restored["w"].tolist()
    [3.0, 3.0, 3.0]
  """

  def __init__(self, directory, max_to_keep: int | None = 5, *,
               strategy=None, save_every: int | None = None,
               snapshot_every: int | None = None):
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or
                                    max_to_keep < 1):
      raise ValueError(f"max_to_keep={max_to_keep!r}: give a positive number "
                       "of checkpoints, or None to keep them all.")
    self._save_every = check_steps("save_every", save_every)
    self._snapshot_every = check_steps("snapshot_every", snapshot_every)
    run_id = launched_job(snapshot_every)
    self.directory = os.path.abspath(os.fspath(directory))
    self._strategy = strategy
    self._ckpt = Checkpointer(self.directory, max_to_keep=max_to_keep,
                              claim=True)
    self._snapshots = None
    self._names = None  # (treedef, names) of the state snapshotted last
    # The step the last `restore` restored (None before one).
    self.restored_step: int | None = None
    if snapshot_every is not None:
      # One directory per manager of the job, named by its checkpoint directory.
      name = hashlib.sha256(self.directory.encode()).hexdigest()[:16]
      try:
        self._snapshots = snapshots_lib.Snapshots(
            os.path.join(snapshot_dir.job_directory(run_id), name),
            attempt=int(os.environ.get(job_env.ENV_RESTART_COUNT, "0")))
        self._agreed_snapshot_step()
      except BaseException:
        self._ckpt.close()  # the directory's claim goes with the manager
        raise

  @property
  def steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first."""
    return self._ckpt.steps()

  @property
  def latest_step(self) -> int | None:
    """The newest step of the checkpoints and the snapshot, or None.

    Steps `restore` found corrupt are left out, so after `restore` it is the
    step restored: a loop reads its start here.
    """
    disk = self._disk_step()
    memory = self.snapshot_step
    if memory is None or (disk is not None and disk > memory):
      return disk
    return memory

  def _disk_step(self) -> int | None:
    """The newest persistent checkpoint not found corrupt, or None."""
    steps = [s for s in self.steps if s not in self._ckpt.corrupt]
    return steps[-1] if steps else None

  @property
  def snapshot_step(self) -> int | None:
    """The newest complete in-memory snapshot's step, or None (waits for the
    one being written)."""
    if self._snapshots is None:
      return None
    self._snapshots.wait()  # the one being written, if any
    if self._snapshots.complete is None:
      return None
    return self._snapshots.complete[0]

  def _agreed_snapshot_step(self) -> None:
    group, note, _ = self._snapshots.agree()
    if note:
      snapshots_lib.say(f"{note}; not using it.")
    self._snapshots.complete = group

  @property
  def latest_checkpoint(self) -> str | None:
    """The newest checkpoint's directory (TensorFlow's name), or None."""
    step = self.latest_step
    return None if step is None else os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any) -> str | None:
    """Writes `state` as checkpoint `step` (every process calls it).

    A state with NaN or infinite values is not written (a warning says so).

    Returns:
      The checkpoint's directory, or None when nothing was written there.

    Raises:
      jdist.CheckpointError: the save failed (earlier ones are intact).
      OSError: writing the previous snapshot failed in the background.
      TypeError: a leaf of `state` is not an array.
      ValueError: the manager was closed.
    """
    step = int(step)
    self._ckpt.check_open(step)
    # A mesh the user set is set aside: the checkpoint's programs run over
    # the state's own devices.
    with mesh_context.set_aside():
      if self._snapshots is not None:
        # The snapshot taken at an earlier call, written in the background.
        self._snapshots.flush(wait=False)
        if step % self._snapshot_every == 0:
          self._snapshot(step, state)
      if self._save_every is not None and step % self._save_every:
        return None
      if not self._ckpt.save(step, state, {}):
        return None
    return os.path.join(self.directory, str(step))

  def _snapshot(self, step: int, state: Any, meta: dict | None = None
                ) -> None:
    """The in-memory snapshot of `state` at `step`, with `meta` if given."""
    names, stored = self._stored(state)
    if meta is not None:
      names, stored = [*names, META_LEAF], [*stored, _meta_leaf(meta)]
    self._snapshots.write(step, names, stored)

  def _stored(self, state: Any) -> tuple:
    """`(names, stored)` of `state`, the names worked out once per structure."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if self._names is not None and self._names[0] == treedef and all(
        isinstance(x, jax.Array) and isinstance(x.dtype, np.dtype)
        for x in leaves):
      return self._names[1], leaves
    names, stored, whole, _ = ckpt_lib.storable_leaves(state)
    if len(whole) == len(leaves) and all(a is b for a, b in zip(whole, leaves)):
      self._names = (treedef, names)  # (flattened in the same order)
    return names, stored

  def restore(self, like: Any, step: int | None = None) -> Any:
    """The newest usable checkpoint (or checkpoint `step`), shaped and placed
    like `like`; sets `restored_step`.

    `like` is the state as this run holds it, or its `jax.eval_shape`.

    Raises:
      jdist.CheckpointNotFoundError: the directory holds no checkpoint.
      jdist.CheckpointMismatchError: the checkpoint holds another state.
      jdist.CheckpointError: every checkpoint there is corrupt.
      TypeError: a leaf of `like` is not an array.
    """
    mesh = self._mesh(like)
    like = self._laid_out(like)
    with mesh_context.set_aside():  # as in save
      if self._snapshots is not None:
        got = self._restore_snapshot(like, mesh, step)
        if got is not None:
          self.restored_step = self._snapshots.complete[0]
          return got
      restored = self._ckpt.restore(like, mesh, step=step)
    if restored is None:
      raise CheckpointNotFoundError(
          f"{self.directory} holds no checkpoint to restore. Check "
          "`manager.latest_step is not None` first, and train from the "
          "initial state when it is None.")
    state, meta = restored
    self.restored_step = int(meta["step"])
    return state

  def _laid_out(self, like: Any) -> Any:
    """`like` with the manager's strategy's layout on the leaves that carry
    none (a `jax.eval_shape` of the state): they restore split as the
    strategy holds them (a LayoutMap's, FSDP's), not whole on every device."""
    if not hasattr(self._strategy, "shardings"):  # none, or no layouts
      return like
    leaves, treedef = jax.tree.flatten(like)
    bare = [not isinstance(getattr(x, "sharding", None), NamedSharding)
            and hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves]
    if not any(bare):
      return like
    targets = jax.tree.leaves(self._strategy.shardings(like),
                              is_leaf=lambda s: isinstance(s, NamedSharding))
    if len(targets) != len(leaves):
      return like
    return treedef.unflatten([
        jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=target)
        if b else x for x, b, target in zip(leaves, bare, targets)])

  def _mesh(self, like: Any):
    """The strategy's mesh, else that of `like`'s leaves or the current one."""
    if self._strategy is not None:
      return self._strategy.mesh
    meshes = {getattr(x.sharding, "mesh", None)
              for x in jax.tree_util.tree_leaves(like)
              if isinstance(x, jax.Array)}
    if len(meshes) == 1 and None not in meshes:
      return meshes.pop()
    return current.get_strategy().mesh

  def _restore_snapshot(self, like, mesh, step: int | None, *,
                        with_meta: bool = False):
    """The state from the newest complete snapshot (`with_meta`: `(state,
    meta)`), or None; every process gets the same answer."""
    self._snapshots.flush()
    group, note, disk = self._snapshots.agree(self._disk_step())
    where = (f"the checkpoint of step {disk} in {self.directory}"
             if disk is not None else f"{self.directory} (no checkpoint there)")
    if group is None or (step is not None and group[0] != step):
      if note:
        snapshots_lib.say(f"{note}; restoring from {where}.")
      if group is None:
        self._snapshots.complete = None
      return None
    if step is None and disk is not None and disk > group[0]:
      return None  # the persistent checkpoint is newer
    names, stored, leaves, treedef = ckpt_lib.storable_leaves(like)
    described = {n: [list(x.shape), str(x.dtype)] for n, x in zip(names, stored)}
    if with_meta:  # its length, as this host's first part of it says
      described[META_LEAF] = [
          self._snapshots.saved_shape(group, META_LEAF) or [0], "uint8"]
    got, problem = self._snapshots.read(group, described)
    if problem:
      snapshots_lib.say(f"the in-memory snapshot of step {group[0]} cannot be "
                        f"used: {problem}; restoring from {where}.")
      self._snapshots.complete = None  # `latest_step` is now the directory's
      return None
    state = ckpt_lib.placed(got[:len(names)], stored, leaves, treedef, mesh)
    self._snapshots.complete = group
    copied = self._snapshots.from_replicas
    replicas = (f" (the parts of processes {copied} of {group[2]} from their "
                "replicas on the processes after them)" if copied else "")
    snapshots_lib.say(f"restored step {group[0]} from the in-memory snapshot "
                      f"in {self._snapshots.directory}{replicas}, not from "
                      f"{where}.")
    if with_meta:
      return state, json.loads(got[-1].tobytes())
    return state

  def close(self) -> None:
    """Writes the last snapshot taken and lets the directory go."""
    self._close()

  def _close(self, *, delete: bool = False) -> None:
    """`close`; with `delete`, deletes the checkpoints and snapshots too."""
    try:
      if self._snapshots is not None:
        self._snapshots.close()  # the last snapshot is written
        if delete:
          self._snapshots.agree()  # every process has written its last part
          self._snapshots.clear()
    finally:
      self._ckpt.close(delete=delete)

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class BackupManager(CheckpointManager):
  """The `CheckpointManager` of `jdist.BackupAndRestore`.

  Its backups carry fit's metadata, and fit takes snapshots from a callback
  (the snapshot copies the arrays the next step donates).
  """

  @property
  def checkpointer(self) -> Checkpointer:
    """The persistent directory's `Checkpointer`."""
    return self._ckpt

  @property
  def snapshot_directory(self) -> str | None:
    """Where this job's in-memory snapshots are (None without them)."""
    return None if self._snapshots is None else self._snapshots.directory

  def take_snapshot(self, step: int, state: Any, meta: dict) -> None:
    """Takes the in-memory snapshot of `state` and `meta` at `step`."""
    self._snapshot(step, state, meta)

  def write_snapshot(self) -> None:
    """Hands the last snapshot taken to the writer thread, as `save` does."""
    if self._snapshots is not None:
      self._snapshots.flush(wait=False)

  def restore_from_memory(self, like: Any) -> tuple | None:
    """`(state, meta)` from the in-memory snapshot when it is at least as new as
    the newest backup, else None (the same answer in every process)."""
    if self._snapshots is None:
      return None
    strategy = self._strategy or current.get_strategy()
    return self._restore_snapshot(self._laid_out(like), strategy.mesh, None,
                                  with_meta=True)

  def close(self, *, delete: bool = False) -> None:
    """`CheckpointManager.close`; with `delete`, deletes them too."""
    self._close(delete=delete)
