"""Checkpoints of a train state with orbax-checkpoint: saving, restoring,
replacing (the format and its checks: docs/checkpoints.md).

A checkpoint is an orbax step directory with two items, `state` (the arrays
nested by their paths) and `meta` (`metadata.py`). Arrays are restored with
the target's shardings, so any device or process count restores any
checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jdist._src.core import kinds
from jdist._src.errors import CheckpointError, CheckpointMismatchError
from jdist._src.checkpoint import content_hash
from jdist._src.checkpoint import directory_claim
from jdist._src.checkpoint import metadata
from jdist._src.checkpoint import orbax_errors
from jdist._src.checkpoint.metadata import FORMAT, FORMATS
from jdist._src.checkpoint.metadata import NESTED_FORMAT as _NESTED_FORMAT
from jdist._src.checkpoint.metadata import UNCHECKED_FORMAT as _UNCHECKED_FORMAT
from jdist._src.runtime import runtime as runtime_lib

_STEP = re.compile(r"\d+")  # orbax's name of a complete step directory
# Where a save of a step that exists is written before it replaces the step.
_REPLACING = ".jdist-replacing"


def _name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _paths(tree, fmt: str) -> list:
  """`(path, leaf)` of every leaf of `tree`, in its flattening order.

  A `jdist.Sharded` adds no level to the paths (from format 3 on), so sharded
  and mirrored optimizer state load into each other.
  """
  if fmt in (_NESTED_FORMAT, _UNCHECKED_FORMAT):
    return jax.tree_util.tree_flatten_with_path(tree)[0]
  pairs = []
  for path, x in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=kinds.is_named_as_payload)[0]:
    inner = jax.tree_util.tree_flatten_with_path(
        kinds.kind_of(x).payload(x))[0] \
        if kinds.is_named_as_payload(x) else [((), x)]
    pairs.extend((path + sub, leaf) for sub, leaf in inner)
  return pairs


def _flatten(tree, fmt: str = FORMAT) -> tuple[list[str], list, Any]:
  """Leaves of `tree` with '/'-joined path names, as `fmt` names them."""
  with_path = _paths(tree, fmt)
  treedef = jax.tree_util.tree_structure(tree)
  names = ["/".join(_name(e) for e in path) for path, _ in with_path]
  if len(set(names)) != len(names):
    raise ValueError("Two leaves of the train state have the same path name; "
                     "rename the colliding modules or dict keys.")
  return names, [leaf for _, leaf in with_path], treedef


def _nest(names, leaves) -> dict:
  out: dict = {}
  for name, leaf in zip(names, leaves):
    node = out
    *parents, last = name.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf
  return out


def _unnest(names, nested) -> list:
  leaves = []
  for name in names:
    node = nested
    for part in name.split("/"):
      node = node[part]
    leaves.append(node)
  return leaves


def nonfinite_leaves(state) -> list[str]:
  """Names of the leaves of `state` that hold NaN or infinite values."""
  names, leaves, _ = _flatten(state)
  _, finite = content_hash.digests(_storable(leaves))
  return [n for n, ok in zip(names, finite) if not ok]


def _storable(leaves) -> list:
  """The leaves as stored: PRNG keys as their key data."""
  return [(jax.random.key_data(x) if isinstance(x, jax.Array) else
           jax.eval_shape(jax.random.key_data, x)) if _is_key(x) else x
          for x in leaves]


def _arrays_only(names, leaves) -> None:
  """Raises TypeError naming the leaves that are not arrays."""
  bad = [f"{n} (a {type(x).__module__.replace('builtins', 'Python')} "
         f"{type(x).__name__}: {x!r:.40})"
         for n, x in zip(names, leaves)
         if not (hasattr(x, "dtype") and hasattr(x, "shape"))]
  if bad:
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise TypeError(
        f"The state to checkpoint has leaves that are not arrays: "
        f"{', '.join(bad[:3])}{more}. A checkpoint holds arrays, with their "
        "shapes and dtypes: make these arrays (jnp.asarray(x), or "
        "strategy.replicate(state)), or keep them out of the saved state.")


def storable_leaves(tree) -> tuple[list[str], list, list, Any]:
  """`(names, stored, leaves, treedef)` of `tree` (stored: keys as data).

  Raises:
    TypeError: a leaf is not an array (a Python float or int).
  """
  names, leaves, treedef = _flatten(tree)
  _arrays_only(names, leaves)
  return names, _storable(leaves), leaves, treedef


def placed(wholes: list, stored: list, leaves: list, treedef, mesh) -> Any:
  """The tree of `wholes` (host arrays) placed on `mesh` as the target's
  leaves are: split where they are split over this mesh, else whole."""
  replicated = NamedSharding(mesh, P())
  out = []
  for whole, like, target in zip(wholes, stored, leaves):
    a = jax.make_array_from_callback(
        whole.shape, _target_sharding(like, replicated),
        lambda index, w=whole: w[index])
    out.append(jax.random.wrap_key_data(a, dtype=target.dtype)
               if _is_key(target) else a)
  return jax.tree_util.tree_unflatten(treedef, out)


def _target_sharding(leaf, replicated: NamedSharding) -> NamedSharding:
  """Where a leaf is restored: split as the target's leaf, else replicated."""
  sharding = getattr(leaf, "sharding", None)
  if (isinstance(sharding, NamedSharding) and
      sharding.mesh == replicated.mesh and any(sharding.spec)):
    return sharding
  return replicated


def _swap_in(directory: str, step: int) -> None:
  """Puts `_REPLACING/<step>` (complete) in the place of `<step>`."""
  side = os.path.join(directory, _REPLACING)
  old = os.path.join(side, f"old-{step}")
  os.rename(os.path.join(directory, str(step)), old)
  os.rename(os.path.join(side, str(step)), os.path.join(directory, str(step)))
  shutil.rmtree(side)


def _finish_replacing(directory: str) -> None:
  """Completes or drops a replacement a killed job left (run by the owner)."""
  side = os.path.join(directory, _REPLACING)
  try:
    entries = os.listdir(side)
  except (FileNotFoundError, NotADirectoryError):
    return
  for entry in entries:
    if _STEP.fullmatch(entry) and not os.path.exists(
        os.path.join(directory, entry)):
      os.rename(os.path.join(side, entry), os.path.join(directory, entry))
  shutil.rmtree(side, ignore_errors=True)


class Checkpointer:
  """Saves and restores train states in `directory` with orbax, keeping
  `max_to_keep` newest; with `claim`, the directory is claimed for this job
  until `close` (`directory_claim.py`: writers claim, readers do not)."""

  def __init__(self, directory, *, max_to_keep: int | None = None,
               claim: bool = False):
    self.directory = os.path.abspath(os.fspath(directory))
    self._max_to_keep = max_to_keep
    self._claim = directory_claim.claim(
        self.directory, tidy=_finish_replacing) if claim else None
    self._ocp, self._opened = None, None
    self._closed = False
    # The steps `restore` found corrupt (and skipped), until saved again.
    self.corrupt: set[int] = set()

  @property
  def _manager(self):
    """orbax's CheckpointManager, opened at first use: opening it is a barrier
    of every process, which a resume from memory never needs."""
    if self._opened is None:
      import orbax.checkpoint as ocp  # slow to import: only when checkpointing
      # The owner removes what saves that died left behind (a reader must
      # not: they may be another job's saves in progress).
      options = ocp.CheckpointManagerOptions(
          max_to_keep=self._max_to_keep, create=True,
          cleanup_tmp_directories=self._claim is not None,
          enable_async_checkpointing=False)
      self._opened = ocp.CheckpointManager(
          self.directory, options=options, item_names=("state", "meta"))
      self._ocp = ocp
    return self._opened

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first (without orbax)."""
    try:
      entries = os.scandir(self.directory)
    except (FileNotFoundError, NotADirectoryError):
      return []
    with entries:
      return sorted(int(e.name) for e in entries
                    if _STEP.fullmatch(e.name) and e.is_dir())

  def save(self, step: int, state, meta: dict) -> bool:
    """Writes `state` and `meta` as checkpoint `step` (all processes call it),
    replacing one there; returns whether it is now checkpoint `step` (a state
    with NaN or infinite values is not written, with a warning, so
    `max_to_keep` never rotates the last good checkpoints away).

    Raises:
      ValueError: the checkpointer was closed.
      jdist.CheckpointError: the save failed (a full disk).
    """
    self.check_open(step)
    if self._claim is not None:
      self._claim.check()
    names, leaves, _ = _flatten(state)
    _arrays_only(names, leaves)
    leaves = _storable(leaves)
    digests, finite = content_hash.digests(leaves)
    bad = [n for n, ok in zip(names, finite) if not ok]
    if bad:
      self._refuse_nonfinite(step, bad)
      return False
    meta = metadata.seal(dict(meta, format=FORMAT, step=int(step),
                              leaves=metadata.describe(names, leaves),
                              hash=content_hash.NAME,
                              digests=dict(zip(names, digests))))
    manager, ocp = self._manager, self._ocp
    args = ocp.args.Composite(state=ocp.args.StandardSave(_nest(names, leaves)),
                              meta=ocp.args.JsonSave(meta))
    try:
      with orbax_errors.summarised():
        if step in manager.all_steps():
          self._replace(step, args)
        else:
          manager.save(step, args=args, force=True)
          manager.wait_until_finished()
    except Exception as e:
      raise self._save_failed(step, e) from None  # e stays as __context__
    self.corrupt.discard(step)
    return True

  def check_open(self, step: int) -> None:
    """Raises ValueError once `close` ran (the claim went with it)."""
    if self._closed:
      raise ValueError(
          f"Cannot save step {step} to {self.directory}: its checkpoint "
          "manager was closed, and with it the lock on the directory (another "
          "job may be writing there now). Save before closing it, or make a "
          "new jdist.CheckpointManager to write there again.")

  def _refuse_nonfinite(self, step: int, bad: list[str]) -> None:
    newest = self._manager.latest_step()
    kept = (f"The newest checkpoint there, step {newest}, is kept."
            if newest is not None else "No checkpoint is written.")
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    warnings.warn(
        f"Not saving step {step} to {self.directory}: the train state has "
        f"NaN or infinite values (in {', '.join(bad[:3])}{more}). {kept} "
        "Add jdist.TerminateOnNaN() to the callbacks to stop training when "
        "the loss becomes NaN.", UserWarning, stacklevel=4)

  def _replace(self, step: int, args) -> None:
    """Writes checkpoint `step` over the one there (every process calls it).

    orbax writes it whole aside; process 0 then renames the old one away and
    the new one in, so a reader never sees a mix of the two.
    """
    side = os.path.join(self.directory, _REPLACING)
    self._ocp.Checkpointer(self._ocp.CompositeCheckpointHandler()).save(
        os.path.join(side, str(step)), args=args, force=True)
    problem = ""
    if jax.process_index() == 0:
      try:
        _swap_in(self.directory, step)
      except OSError as e:
        problem = f"{type(e).__name__}: {e}"
    runtime = runtime_lib.current()
    problems = runtime.exchange(
        f"jdist/checkpoint_replace/{runtime.next_sequence('ckpt_replace')}/",
        problem, timeout=None, what=f"replacing checkpoint step {step}")
    self._manager.reload()
    if problems.get(0):
      raise OSError(problems[0])

  def _save_failed(self, step: int, e: Exception) -> CheckpointError:
    newest = self._manager.latest_step()
    # In a job of several processes, a save also fails when another process
    # dies during it: its own error (or its exit) is the cause to look at.
    peers = (" (or, in this job of several processes, see why another "
             "process failed)" if jax.process_count() > 1 else "")
    kept = (f"The checkpoints written before it are intact (the newest is "
            f"step {newest}); free space or fix the directory{peers}, and "
            "relaunch to resume from it." if newest is not None else
            "No checkpoint was written before it.")
    return CheckpointError(f"Could not save checkpoint step {step} to "
                           f"{self.directory}: {orbax_errors.reason(e)}. {kept}")

  def read_meta(self, step: int) -> dict:
    manager = self._manager
    ocp = self._ocp
    with orbax_errors.summarised(f"{self.directory}/{step}/"):
      return manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, target, mesh, *, step: int | None = None):
    """`(state, meta)` of the newest usable checkpoint (or `step`) onto `mesh`,
    shaped like `target`; None when there is none.

    Raises:
      CheckpointMismatchError: the checkpoint holds another model.
      jdist.CheckpointError: no checkpoint in the directory can be read.
    """
    candidates = [step] if step is not None else self.steps()[::-1]
    if not candidates:
      return None
    problems = []
    for s in candidates:
      try:
        meta = self.read_meta(s)
      except Exception as e:  # unreadable: corrupt or half-deleted
        problems.append(self._skip(s, "its metadata cannot be read "
                                   f"({orbax_errors.reason(e)})"))
        continue
      meta, problem = metadata.unseal(meta)
      if problem:
        problems.append(self._skip(s, problem))
        continue
      if meta.get("format") not in FORMATS:
        raise CheckpointMismatchError(
            f"{self.directory}/{s} is not a jdist.Trainer checkpoint (format "
            f"{meta.get('format')!r}). Use another directory.")
      got, problem = self._read_state(s, meta, target, mesh)
      if problem:
        problems.append(self._skip(s, problem))
        continue
      self.corrupt.discard(s)
      return got, meta
    raise CheckpointError(
        f"No checkpoint in {self.directory} can be restored:\n" +
        "\n".join(problems) + "\nDelete the directory to start over.")

  def _read_state(self, s: int, meta: dict, target, mesh):
    """`(state, None)` read from checkpoint `s`, or `(None, problem)`.

    Raises:
      CheckpointMismatchError: the checkpoint holds another model.
    """
    names, leaves, treedef = _flatten(target, meta["format"])
    _arrays_only(names, leaves)
    stored = _storable(leaves)
    saved = meta.get("leaves", {})
    diff = metadata.mismatch(saved, metadata.describe(names, stored))
    if diff:
      shown = "\n".join(metadata.policy_change(saved, names) + diff[:10])
      more = f"\n  ... and {len(diff) - 10} more" if len(diff) > 10 else ""
      raise CheckpointMismatchError(
          f"The checkpoint {self.directory}/{s} was saved from a different "
          f"model or optimizer:\n{shown}{more}\nPoint the callback at a new "
          "directory, or delete this one to start over.")
    replicated = NamedSharding(mesh, P())
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                     sharding=_target_sharding(x, replicated))
                for x in stored]
    try:
      with orbax_errors.summarised(f"{self.directory}/{s}/"):
        restored = self._manager.restore(s, args=self._ocp.args.Composite(
            state=self._ocp.args.StandardRestore(_nest(names, abstract))))
      got = _unnest(names, restored["state"])
    except Exception as e:
      return None, f"its arrays cannot be read ({orbax_errors.reason(e)})"
    changed = metadata.changed(names, got, meta)
    if changed:
      more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
      return None, (f"its arrays fail their checksums ({', '.join(changed[:3])}"
                    f"{more})")
    got = [jax.random.wrap_key_data(g, dtype=t.dtype)
           if _is_key(t) else g for g, t in zip(got, leaves)]
    return jax.tree_util.tree_unflatten(treedef, got), None

  def _skip(self, step: int, why: str) -> str:
    self.corrupt.add(step)
    msg = (f"Checkpoint {self.directory}/{step} is corrupt: {why}. Using the "
           "checkpoint before it.")
    warnings.warn(msg, UserWarning, stacklevel=3)
    return f"  step {step}: {why}"

  def close(self, *, delete: bool = False) -> None:
    """Lets the directory go; with `delete`, deletes it first."""
    self._closed = True
    if self._opened is not None:
      self._opened.close()
    if self._claim is None:
      if delete and jax.process_index() == 0:
        shutil.rmtree(self.directory, ignore_errors=True)
    elif delete:
      self._claim.remove_directory()
    else:
      self._claim.release()
