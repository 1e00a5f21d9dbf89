"""`jdist.CheckpointManager`: checkpoints for custom training loops.

The piece of the Trainer's checkpointing a `strategy.function` loop can use,
in the manner of TensorFlow's `tf.train.CheckpointManager` (save, restore,
the latest checkpoint, `max_to_keep`), with state passed explicitly as JAX
code passes it. It keeps the Trainer's guarantees: the directory is claimed
for this job (another running job writing there is an error, and saves that
a killed job left half-written are removed), each checkpoint's metadata and
arrays are checksummed (a corrupt newest checkpoint is skipped with a
warning), and a checkpoint restores onto any number of devices or processes
in the layout of the state it is restored into.
"""

from __future__ import annotations

import os
from typing import Any

from jdist._src import current
from jdist._src.checkpoint.checkpointer import Checkpointer
from jdist._src.errors import CheckpointNotFoundError


class CheckpointManager:
  """Saves and restores a custom loop's state (any pytree of arrays).

  Args:
    directory: where the checkpoints go (one orbax step directory each).
    max_to_keep: keep only the newest N checkpoints (None: all).
    strategy: whose devices `restore` places the state on (default: the
      strategy in scope when `restore` is called).

  Raises:
    jdist.CheckpointDirectoryError: the directory is a file or cannot be
      written.
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
    ([2, 3], 3)
    >>> restored["w"].tolist()
    [3.0, 3.0, 3.0]
  """

  def __init__(self, directory, max_to_keep: int | None = 5, *,
               strategy=None):
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or
                                    max_to_keep < 1):
      raise ValueError(f"max_to_keep={max_to_keep!r}: give a positive number "
                       "of checkpoints, or None to keep them all.")
    self.directory = os.path.abspath(os.fspath(directory))
    self._strategy = strategy
    self._ckpt = Checkpointer(self.directory, max_to_keep=max_to_keep,
                              claim=True)

  @property
  def steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first."""
    return self._ckpt.steps()

  @property
  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None when there is none."""
    steps = self.steps
    return steps[-1] if steps else None

  @property
  def latest_checkpoint(self) -> str | None:
    """The newest checkpoint's directory (TensorFlow's name), or None."""
    step = self.latest_step
    return None if step is None else os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any) -> str | None:
    """Writes `state` as checkpoint `step` (every process calls it).

    A state with NaN or infinite values is not written (a warning says so),
    so that `max_to_keep` never rotates the last good checkpoints away.

    Returns:
      The checkpoint's directory, or None when it was not written.

    Raises:
      jdist.CheckpointError: the save failed (a full disk); the checkpoints
        written before it are intact.
    """
    if not self._ckpt.save(int(step), state, {}):
      return None
    return os.path.join(self.directory, str(int(step)))

  def restore(self, like: Any, step: int | None = None) -> Any:
    """The newest usable checkpoint (or checkpoint `step`), shaped and
    placed like `like`.

    `like` is the state as this run holds it (freshly initialised, on this
    run's devices): leaves split over the replicas (a `jdist.Sharded`
    optimizer state) are restored split the same way, the others whole on
    every device. It may also be the state's shapes only (`jax.eval_shape`
    of the function that makes it), which a restarted job gets without
    computing an initial state: every leaf is then restored whole on every
    device. A checkpoint saved on another number of devices or processes
    restores all the same.

    Raises:
      jdist.CheckpointNotFoundError: the directory holds no checkpoint.
      jdist.CheckpointMismatchError: the checkpoint holds another state
        (its leaves, shapes or dtypes differ; they are named).
      jdist.CheckpointError: every checkpoint there is corrupt.
    """
    strategy = self._strategy or current.get_strategy()
    restored = self._ckpt.restore(like, strategy.mesh, step=step)
    if restored is None:
      raise CheckpointNotFoundError(
          f"{self.directory} holds no checkpoint to restore. Check "
          "`manager.latest_step is not None` first, and train from the "
          "initial state when it is None.")
    return restored[0]

  def close(self) -> None:
    """Lets the directory go (another job may then use it)."""
    self._ckpt.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
