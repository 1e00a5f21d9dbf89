"""`Trainer.load_checkpoint`: a checkpoint's weights into held train state.
A weights-only checkpoint sets the parameters and model state and keeps the
optimizer's and the step, as Keras' `load_weights`; a full one replaces all.
"""

from __future__ import annotations

from typing import Any

from jdist._src.checkpoint.checkpointer import Checkpointer
from jdist._src.errors import CheckpointNotFoundError


def load(directory, held: Any, strategy, *, step: int | None = None
         ) -> tuple[Any, int]:
  """`(held state, step)` after loading checkpoint `step` (default: the
  newest) of `directory` into `held`, as `strategy` holds it. Raises
  `jdist.CheckpointNotFoundError`, `CheckpointMismatchError` (another
  model) or `CheckpointError` (every checkpoint corrupt)."""
  placement = strategy.state_placement
  ckpt = Checkpointer(directory)
  try:
    weights_only = _weights_only(ckpt, step)
    current = placement.read(held)
    target = current.replace(opt_state=()) if weights_only else current
    restored = ckpt.restore(target, strategy.mesh, step=step)
  finally:
    ckpt.close()
  if restored is None:
    raise CheckpointNotFoundError(
        f"No checkpoint in {ckpt.directory}. Point load_checkpoint at the "
        "directory a ModelCheckpoint or BackupAndRestore wrote.")
  state, meta = restored
  if weights_only:  # Keras' load_weights: the optimizer and step stay
    state = current.replace(params=state.params,
                            model_state=state.model_state)
  return placement.write(held, state, strategy.mesh), int(meta["step"])


def _weights_only(ckpt: Checkpointer, step: int | None) -> bool:
  """Whether the checkpoint `load` will read holds weights only."""
  steps = [step] if step is not None else ckpt.steps()[-1:]
  if not steps:
    return False
  try:
    return bool(ckpt.read_meta(steps[-1]).get("weights_only"))
  except Exception:  # unreadable: restore reports it, with the fallback
    return False
