"""Checkpoints of a `TrainState` with orbax-checkpoint, and their metadata.

Each checkpoint is an orbax step directory with two items: `state` (the
train state's arrays as a nested dict named by their paths) and `meta` (JSON:
the training position, the history so far, the shape of every leaf, and a
checksum of every leaf). orbax writes a step into a temporary directory and
renames it when complete, so a crash mid-save leaves the previous checkpoints
as they were. On restore, a checkpoint whose files cannot be read or whose
checksums disagree is skipped with a warning and the one before it is used; a
checkpoint of a different model is an error.

Arrays are restored with the target's sharding on the current mesh
(replicated, or split over the replicas for a `jdist.ShardedOptimizer`'s
state), so a checkpoint saved on 4 devices (or 2 processes) restores onto 2
devices (or 1 process) and back.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jdist._src.core import kinds
from jdist._src.core import placement
from jdist._src.errors import CheckpointError, CheckpointMismatchError
from jdist._src.checkpoint import directory_claim
from jdist._src.checkpoint import orbax_errors

FORMAT = "jdist.Trainer/3"
_STEP = re.compile(r"\d+")  # orbax's name of a complete step directory
# Version 2 named the leaves of sharded optimizer state with one more level
# (the `jdist.Sharded` around it), so sharded and mirrored checkpoints did not
# load into each other; version 1 had no checksum of its metadata. Both load.
_NESTED_FORMAT = "jdist.Trainer/2"
_UNCHECKED_FORMAT = "jdist.Trainer/1"
_FORMATS = (FORMAT, _NESTED_FORMAT, _UNCHECKED_FORMAT)


def _name(entry) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _is_key(x) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _paths(tree, fmt: str) -> list:
  """`(path, leaf)` of every leaf of `tree`, in its flattening order.

  A `jdist.Sharded` adds no level to the paths (from format 3 on): sharded
  optimizer state has the names of the mirrored state it equals, leaf for
  leaf, so either checkpoint loads into the other.
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
  """Leaves of `tree` with stable '/'-joined path names (as `fmt` names
  them)."""
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


def _describe(names, leaves) -> dict:
  return {n: [list(np.shape(x)), str(x.dtype)] for n, x in zip(names, leaves)}


@jax.jit
def _sums(leaves):
  return jnp.stack([jnp.sum(jnp.asarray(x).astype(jnp.float32)) for x in leaves])


def _checksums(leaves) -> list[float]:
  if not leaves:
    return []
  return [float(v) for v in placement.to_host(_sums(leaves))]


def _nonfinite(names, checksums) -> list[str]:
  # A leaf's sum is NaN or inf when one of its values is: the check is free.
  return [n for n, c in zip(names, checksums) if not np.isfinite(c)]


def nonfinite_leaves(state) -> list[str]:
  """Names of the leaves of `state` that hold NaN or infinite values."""
  names, leaves, _ = _flatten(state)
  return _nonfinite(names, _checksums(_storable(leaves)))


def _storable(leaves) -> list:
  """The leaves as stored: PRNG keys as their data (abstract keys, a
  `jax.eval_shape` target's, as abstract data)."""
  return [(jax.random.key_data(x) if isinstance(x, jax.Array) else
           jax.eval_shape(jax.random.key_data, x)) if _is_key(x) else x
          for x in leaves]


def _arrays_only(names, leaves) -> None:
  """Raises TypeError, naming them, for leaves that are not arrays (a
  Python float or int: no dtype or shape of its own to save and check)."""
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
  """`(names, stored, leaves, treedef)` of `tree`: its leaves' path names,
  the leaves as stored (PRNG keys as their data), the leaves, its treedef.

  Raises:
    TypeError: a leaf is not an array (a Python float or int).
  """
  names, leaves, treedef = _flatten(tree)
  _arrays_only(names, leaves)
  return names, _storable(leaves), leaves, treedef


def placed(wholes: list, stored: list, leaves: list, treedef, mesh) -> Any:
  """The tree of `wholes` (host arrays, one whole leaf each, PRNG keys as
  their data) placed on `mesh` as the target's leaves are (`stored`, as
  `storable_leaves` gives them, and `leaves`): split where they are split
  over this mesh, otherwise whole on every device."""
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
  """Where a leaf is restored: split as the target's leaf is (optimizer
  state sharded over this mesh's replicas, orbax reads each device's block),
  otherwise whole on every device."""
  sharding = getattr(leaf, "sharding", None)
  if (isinstance(sharding, NamedSharding) and
      sharding.mesh == replicated.mesh and any(sharding.spec)):
    return sharding
  return replicated


def _digest(meta: dict) -> str:
  text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def _sealed(meta: dict) -> dict:
  """`meta` as JSON will read it back, with the checksum of its content."""
  meta = json.loads(json.dumps(meta))
  return dict(meta, meta_checksum=_digest(meta))


def _unsealed(meta: dict) -> tuple[dict, str | None]:
  """`(meta, problem)`: the metadata without its checksum, or what is wrong."""
  meta = dict(meta)
  checksum = meta.pop("meta_checksum", None)
  if checksum is None:
    if meta.get("format") in (FORMAT, _NESTED_FORMAT):
      return meta, "its metadata has lost its checksum"
    return meta, None  # an older checkpoint, or not one of jdist's
  if checksum != _digest(meta):
    return meta, "its metadata fails its checksum"
  return meta, None


def _policy_change(saved: dict, names: list[str]) -> list[str]:
  """The line that says a loss-scaling dtype policy was turned on or off
  between the save and this trainer (its loss scale is in one state only)."""
  scaled = lambda ns: any("/loss_scale/" in f"/{n}/" for n in ns)
  if scaled(saved) == scaled(names):
    return []
  if scaled(saved):
    why = ("the checkpoint was saved with dtype_policy=\"mixed_float16\" (its "
           "optimizer state has a loss scale), this Trainer scales no loss")
  else:
    why = ("the checkpoint was saved without loss scaling, this Trainer's "
           "dtype_policy=\"mixed_float16\" adds a loss scale")
  return [f"  ({why}: make the Trainer with the dtype_policy of the run that "
          "saved it)"]


def _mismatch(saved: dict, expected: dict) -> list[str]:
  lines = []
  # Parameters first: they say most plainly which model each side holds.
  order = lambda n: (not n.startswith("params/"), n)
  for name in sorted(set(saved) | set(expected), key=order):
    if name not in expected:
      lines.append(f"  {name}: in the checkpoint, not in this model")
    elif name not in saved:
      lines.append(f"  {name}: in this model, not in the checkpoint")
    elif list(saved[name][0]) != list(expected[name][0]) or \
        saved[name][1] != expected[name][1]:
      lines.append(f"  {name}: checkpoint {tuple(saved[name][0])} "
                   f"{saved[name][1]}, model {tuple(expected[name][0])} "
                   f"{expected[name][1]}")
  return lines


class Checkpointer:
  """Saves and restores train states in `directory` with orbax.

  Args:
    directory: where the step directories go (created if needed).
    max_to_keep: keep only this many newest checkpoints (None: all).
    claim: claim the directory for this job (`directory_claim.py`): check
      that every process can write it and lock it against other jobs, until
      `close`. Writers claim; `load_checkpoint` only reads.

  Raises:
    jdist.CheckpointDirectoryError: (with `claim`) the directory is a file
      or cannot be written.
    jdist.CheckpointInUseError: (with `claim`) another running job owns it.

  Example:
    >>> import jdist, tempfile
    >>> from jdist._src.checkpoint.checkpointer import Checkpointer
    >>> ckpt = Checkpointer(tempfile.mkdtemp())
    >>> ckpt.steps()
    []
  """

  def __init__(self, directory, *, max_to_keep: int | None = None,
               claim: bool = False):
    self.directory = os.path.abspath(os.fspath(directory))
    self._max_to_keep = max_to_keep
    self._claim = directory_claim.claim(self.directory) if claim else None
    self._ocp, self._opened = None, None

  @property
  def _manager(self):
    """orbax's CheckpointManager of the directory, opened at the first save
    or restore that needs it: its creation is a barrier of every process
    (all call `save` and `restore`), and a restart that resumes from memory
    never needs it."""
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
    """Steps of the complete checkpoints, oldest first (the step directories
    orbax has renamed into place; read without opening orbax)."""
    try:
      entries = os.scandir(self.directory)
    except (FileNotFoundError, NotADirectoryError):
      return []
    with entries:
      return sorted(int(e.name) for e in entries
                    if _STEP.fullmatch(e.name) and e.is_dir())

  def save(self, step: int, state, meta: dict) -> bool:
    """Writes `state` and `meta` as checkpoint `step` (all processes call it).

    A state with NaN or infinite values is not written (a warning says so):
    with `max_to_keep`, it would rotate the last good checkpoints away.

    Returns:
      Whether checkpoint `step` is now in the directory.
    """
    if self._claim is not None:
      self._claim.check()
    manager = self._manager
    ocp = self._ocp
    if step in manager.all_steps():
      return True  # already saved at this step (same state)
    names, leaves, _ = _flatten(state)
    _arrays_only(names, leaves)
    leaves = _storable(leaves)
    checksums = _checksums(leaves)
    bad = _nonfinite(names, checksums)
    if bad:
      newest = self._manager.latest_step()
      kept = (f"The newest checkpoint there, step {newest}, is kept."
              if newest is not None else "No checkpoint is written.")
      more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
      warnings.warn(
          f"Not saving step {step} to {self.directory}: the train state has "
          f"NaN or infinite values (in {', '.join(bad[:3])}{more}). {kept} "
          "Add jdist.TerminateOnNaN() to the callbacks to stop training when "
          "the loss becomes NaN.", UserWarning, stacklevel=3)
      return False
    meta = _sealed(dict(meta, format=FORMAT, step=int(step),
                        leaves=_describe(names, leaves), checksums=checksums))
    try:
      with orbax_errors.summarised():
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_nest(names, leaves)),
            meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()
    except Exception as e:
      raise self._save_failed(step, e) from None  # e stays as __context__
    return True

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
    """Restores the newest usable checkpoint onto `mesh`, shaped like `target`.

    Returns:
      `(state, meta)`, or None when the directory has no checkpoint.

    Raises:
      CheckpointMismatchError: the checkpoint holds another model.
      jdist.CheckpointError: no checkpoint in the directory can be read (a
        RuntimeError).
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
      meta, problem = _unsealed(meta)
      if problem:
        problems.append(self._skip(s, problem))
        continue
      if meta.get("format") not in _FORMATS:
        raise CheckpointMismatchError(
            f"{self.directory}/{s} is not a jdist.Trainer checkpoint (format "
            f"{meta.get('format')!r}). Use another directory.")
      got, problem = self._read_state(s, meta, target, mesh)
      if problem:
        problems.append(self._skip(s, problem))
        continue
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
    diff = _mismatch(meta.get("leaves", {}), _describe(names, stored))
    if diff:
      shown = "\n".join(_policy_change(meta.get("leaves", {}), names) +
                        diff[:10])
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
    if not np.allclose(_checksums(got), meta.get("checksums", []),
                       rtol=1e-5, atol=1e-6, equal_nan=True):
      return None, "its arrays fail their checksums"
    got = [jax.random.wrap_key_data(g, dtype=t.dtype)
           if _is_key(t) else g for g, t in zip(got, leaves)]
    return jax.tree_util.tree_unflatten(treedef, got), None

  def _skip(self, step: int, why: str) -> str:
    msg = (f"Checkpoint {self.directory}/{step} is corrupt: {why}. Using the "
           "checkpoint before it.")
    warnings.warn(msg, UserWarning, stacklevel=3)
    return f"  step {step}: {why}"

  def close(self, *, delete: bool = False) -> None:
    """Lets the directory go; with `delete`, deletes it first (process 0)."""
    if self._opened is not None:
      self._opened.close()
    if self._claim is None:
      if delete and jax.process_index() == 0:
        shutil.rmtree(self.directory, ignore_errors=True)
    elif delete:
      self._claim.remove_directory()
    else:
      self._claim.release()
