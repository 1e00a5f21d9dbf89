"""`ServerVariables`: a pytree of variables held by the parameter servers,
each leaf cut into pieces spread round-robin, as TensorFlow places
variables."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import uuid
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.core import kinds
from jdist._src.core import placement
from jdist._src.core.reduce_op import VariableAggregation
from jdist._src.core.values import RemoteState
from jdist._src.errors import ParameterServerError
from jdist._src.ps import forwarding
from jdist._src.ps import partitioners
from jdist._src.ps import worker as worker_lib
from jdist._src.ps.server import ADD, ASSIGN


@dataclasses.dataclass(frozen=True)
class Piece:
  """One piece of a leaf: the server holding it, its name there, its rows."""

  server: int
  shard: str
  rows: tuple | None  # (start, stop) along axis 0; None: the whole leaf


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One leaf of the variables: its path, the shape and dtype the step sees,
  how it updates (`ADD`, or `ASSIGN` for booleans and keys), a key's PRNG
  implementation, and its pieces in row order."""

  path: str
  shape: tuple
  dtype: Any
  kind: str
  key_impl: str | None
  pieces: tuple

  @property
  def stored_dtype(self):
    return np.dtype(np.uint32) if self.key_impl else np.dtype(self.dtype)

  def join(self, parts):
    """The leaf from its pieces' arrays (traced or not)."""
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)
    if self.key_impl:
      x = jax.random.wrap_key_data(x, impl=self.key_impl)
    return x

  def change(self, new, old):
    """What the servers apply for this leaf: the difference, or the value."""
    if self.key_impl:
      new = jax.random.key_data(new)
    if self.kind == ASSIGN:
      return new
    return (new - old).astype(new.dtype)

  def split(self, x) -> tuple:
    """`x` (the leaf's stored form) cut into its pieces' rows."""
    if len(self.pieces) == 1:
      return (x,)
    return tuple(x[p.rows[0]:p.rows[1]] for p in self.pieces)


def plain(tree: Any) -> Any:
  """`tree` with every `SyncOnRead` replaced by its (aggregated) value."""
  return jax.tree.map(lambda x: kinds.kind_of(x).read(x), tree,
                      is_leaf=kinds.is_node)


def _unplaced(tree: Any) -> Any:
  """`tree` with every `SyncOnRead` read and re-wrapped unplaced."""
  return jax.tree.map(lambda x: kinds.kind_of(x).unplaced(x), tree,
                      is_leaf=kinds.is_node)


class Layout:
  """Assigns pieces to servers round-robin, over every variable set made."""

  def __init__(self, num_servers: int, partitioner=None):
    self.num_servers = num_servers
    self.partitioner = partitioner
    self._count = itertools.count()
    self._lock = threading.Lock()

  def leaves(self, tree: Any) -> tuple:
    """`(treedef, host leaves in stored form, LeafSpecs)` of a value tree."""
    tree = _unplaced(tree)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    hosts, specs = [], []
    with self._lock:
      for path, leaf in with_path:
        specs.append(self._spec(jax.tree_util.keystr(path), leaf))
        hosts.append(_stored(leaf))
    return treedef, hosts, tuple(specs)

  def _spec(self, path: str, leaf) -> LeafSpec:
    dtype = getattr(leaf, "dtype", None)
    key_impl = None
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      key_impl = str(jax.random.key_impl(leaf))
      host = np.asarray(jax.random.key_data(leaf))
    else:
      host = _stored(leaf)
      dtype = host.dtype
    if host.dtype.kind not in "biufc":
      raise TypeError(
          f"Leaf {path or '<value>'} is a {type(leaf).__name__} of dtype "
          f"{host.dtype}; parameter servers hold arrays of numbers, booleans or "
          "PRNG keys. Keep other values out of the state.")
    kind = ASSIGN if key_impl or host.dtype.kind == "b" else ADD
    # Keys split along their own axes, not their key data's last one.
    rows = partitioners.row_splits(jnp.shape(leaf), host.dtype,
                                   self.partitioner)
    bounds = (None,) if rows is None else rows
    pieces = tuple(Piece(next(self._count) % self.num_servers,
                         uuid.uuid4().hex[:12], r) for r in bounds)
    return LeafSpec(path, tuple(jnp.shape(leaf)), dtype, kind, key_impl, pieces)


def _stored(leaf) -> np.ndarray:
  """The leaf on the host in the dtype JAX computes it in (int32 while x64 is
  off), so a step's result has the variable's dtype."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)
  host = np.asarray(leaf)
  return host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """What a worker read of a variable set: each server's version and pieces."""

  versions: dict   # server -> version
  parts: tuple     # per leaf: tuple of piece arrays


class ServerVariables(RemoteState):
  """A pytree of variables held by the parameter servers.

  Steps take it as their state; on the coordinator `read()` gives the
  values and `assign()` replaces them. A handle of an object (a metric)
  forwards its methods.

  Example:
    >>> import jdist, jax.numpy as jnp
    >>> strategy = jdist.ParameterServerStrategy(
    ...     jdist.cluster_resolver.LocalClusterResolver(num_workers=1, num_ps=1))
    >>> mean = strategy.replicate(jdist.metrics.Mean().update(jnp.ones(4)))
    >>> float(mean.result()), float(mean.sums()["count"])
    (1.0, 4.0)
    >>> mean.reset_state()                  # on the servers, as in Keras
    >>> float(mean.sums()["count"])
    0.0
    >>> jdist.ClusterCoordinator(strategy).shutdown()
  """

  def __init__(self, store, layout: Layout, tree: Any, *, coordinator=None):
    treedef, hosts, specs = layout.leaves(tree)
    self._set_id = uuid.uuid4().hex[:16]
    self._treedef = treedef
    self._specs = specs
    self._store = store
    self._coordinator = coordinator
    # Running sums (a SyncOnRead SUM, such as a trainer's metric totals):
    # a worker's change is its own contribution, right however stale.
    # What a compiled step depends on: structure, shapes, kinds, row splits
    # (not where the pieces live), so new sets of the same shape reuse it.
    self._layout_key = (treedef, tuple(
        (s.shape, str(s.dtype), s.kind, s.key_impl,
         tuple(p.rows for p in s.pieces)) for s in specs))
    self._sums = (kinds.kind_of(tree).aggregation(tree) is
                  VariableAggregation.SUM)
    self._value_type = type(tree)
    self._value_attributes = forwarding.attributes(tree)
    store.create(self._set_id, self._per_server(hosts),
                 {s: {p.shard: spec.kind for spec in specs for p in spec.pieces
                      if p.server == s} for s in self.servers})
    # The coordinator's handle owns the servers' copy; copies sent to
    # workers (pickled) do not.
    self._finalizer = weakref.finalize(self, _delete_quietly, store,
                                       self._set_id)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_coordinator"] = None
    state["_finalizer"] = None
    return state

  def __repr__(self) -> str:
    shapes = jax.tree.unflatten(self._treedef, [s.shape for s in self._specs])
    return f"ServerVariables({shapes}, servers={list(self.servers)})"

  def __getattr__(self, name: str):
    # Only names the handle lacks: the held object's (module forwarding).
    held = self.__dict__.get("_value_attributes") or {}
    if name.startswith("_") or name not in held:
      raise AttributeError(
          f"'ServerVariables' object has no attribute {name!r}, nor has the "
          f"{self.__dict__.get('_value_type', object).__name__} it holds. "
          "Read the values with .read() (or jdist.read_value(handle)) and "
          "replace them with .assign(value).")
    return forwarding.attribute(self, self._value_type, name, held[name])

  # --- what it holds ---------------------------------------------------------

  @property
  def set_id(self) -> str:
    return self._set_id

  @property
  def layout_key(self):
    """Equal for variables a compiled step treats alike."""
    return self._layout_key

  @property
  def specs(self) -> tuple:
    """The `LeafSpec` of every leaf, in flattening order."""
    return self._specs

  @property
  def treedef(self):
    """The structure of the value (`SyncOnRead` nodes unplaced)."""
    return self._treedef

  @property
  def servers(self) -> tuple:
    """The parameter servers that hold pieces of these variables."""
    return tuple(sorted({p.server for s in self._specs for p in s.pieces}))

  def structure(self) -> Any:
    """The value's structure, with `jax.ShapeDtypeStruct` leaves."""
    return jax.tree.unflatten(self._treedef, [
        jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self._specs])

  def placement(self) -> Any:
    """Where each leaf lives: a tree of `[(server, rows), ...]` lists."""
    return jax.tree.unflatten(self._treedef, [
        [(p.server, p.rows) for p in s.pieces] for s in self._specs])

  def version(self) -> dict:
    """How many updates each server has applied to these variables."""
    return {s: v for s, (v, _) in self._store.read(self._set_id,
                                                   self.servers).items()}

  # --- reading and writing -----------------------------------------------------

  def read(self, *, wait: bool = True) -> Any:
    """The variables' values, as numpy arrays (PRNG keys as typed keys).

    Args:
      wait: on the coordinator, first wait for every function scheduled so
        far (never inside a scheduled function).

    Raises:
      jdist.ParameterServerError: a server holding them is unavailable.
    """
    if wait and self._coordinator is not None and worker_lib.current() is None:
      self._coordinator.join()
    snap = self.snapshot()
    return jax.tree.unflatten(self._treedef, [
        _host_value(spec, parts) for spec, parts in zip(self._specs,
                                                         snap.parts)])

  def assign(self, tree: Any) -> "ServerVariables":
    """Replaces the values (same structure, shapes and dtypes); returns self.

    On the coordinator it first waits for the functions scheduled so far.
    """
    if self._coordinator is not None and worker_lib.current() is None:
      self._coordinator.join()
    tree = _unplaced(tree)
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self._treedef:
      raise ValueError(
          f"assign() needs the structure the variables were made with:\n"
          f"  variables: {self._treedef}\n  given:     {treedef}")
    hosts = []
    for spec, leaf in zip(self._specs, leaves):
      host = _stored(leaf)
      if host.shape != tuple(spec.shape) and not spec.key_impl:
        raise ValueError(f"assign(): leaf {spec.path} has shape {host.shape}, "
                         f"the variable {spec.shape}.")
      hosts.append(host.astype(spec.stored_dtype, copy=False))
    self._store.assign(self._set_id, self._per_server(hosts))
    return self

  def snapshot(self) -> Snapshot:
    """Reads the pieces with their versions."""
    return self._snapshot(self._store.read(self._set_id, self.servers))

  def _snapshot(self, got: dict) -> Snapshot:
    """A `Snapshot` from `{server: (version, shards, ...)}` of every server."""
    parts = tuple(tuple(got[p.server][1][p.shard] for p in spec.pieces)
                  for spec in self._specs)
    return Snapshot({s: v[0] for s, v in got.items()}, parts)

  def push(self, snapshot: Snapshot, changes: tuple, max_staleness: int,
           servers=None) -> tuple:
    """Sends `changes` (per leaf, per piece, computed from `snapshot`) to the
    servers, or only to `servers`.

    Returns:
      `(refused, next)`: the servers that refused the update as too stale,
      and a `Snapshot` of their answers (None when only some were sent it).
    """
    targets = set(servers or self.servers)
    by_server = {s: {} for s in targets}
    for spec, parts in zip(self._specs, changes):
      for piece, part in zip(spec.pieces, parts):
        if piece.server in targets:
          by_server[piece.server][piece.shard] = part
    answers = self._store.push(self._set_id, {
        s: (snapshot.versions[s], c) for s, c in by_server.items()},
        math.inf if self._sums else max_staleness)
    refused = {s for s, (accepted, _, _) in answers.items() if not accepted}
    if set(answers) != set(self.servers):
      return refused, None
    return refused, self._snapshot({s: (v, shards) for s, (_, v, shards)
                                    in answers.items()})

  def _per_server(self, hosts) -> dict:
    out = {s: {} for s in self.servers}
    for spec, host in zip(self._specs, hosts):
      for piece, part in zip(spec.pieces, spec.split(host)):
        out[piece.server][piece.shard] = part
    return out


def _host_value(spec: LeafSpec, parts) -> Any:
  x = np.concatenate(parts, axis=0) if len(parts) > 1 else np.asarray(parts[0])
  if spec.key_impl:
    return jax.random.wrap_key_data(x, impl=spec.key_impl)
  return x


def _delete_quietly(store, set_id: str) -> None:
  try:
    store.delete(set_id)
  except (ParameterServerError, RuntimeError, KeyError):
    pass  # the cluster is shut down or lost: nothing left to free


class ServerPlacement(placement.StatePlacement):
  """State held on the parameter servers, as `ServerVariables`."""

  def read(self, held: ServerVariables) -> Any:
    return held.read()

  def write(self, held: ServerVariables, value: Any, mesh) -> ServerVariables:
    del mesh  # the servers take host values
    return held if value is held else held.assign(value)

  def abstract(self, held: ServerVariables) -> Any:
    return held.structure()
