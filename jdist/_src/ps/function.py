"""`ParameterServerFunction`: a user's step, run on workers against the servers.

The step is the one written for the synchronous strategies,
`step(state, batch) -> (state, outputs)`. On a worker it runs as a
`MirroredStrategy` step over the worker's devices, inside one `jax.jit` that
also joins the variables' pieces before it and computes their changes after
it: the worker reads its snapshot from the servers, runs the program, and
sends each server the change of its pieces (new minus read for numbers, the
new value for booleans and keys). A server refuses a change computed from
variables more than `max_staleness` updates old; the worker then reads again
and recomputes, so no applied update is staler than that.

Called on the coordinator, the step is scheduled on a worker instead (as
`coordinator.schedule(step, args)`); its result holds the variables' handles
where the step returns their new value and `RemoteValue`s elsewhere. The
first call with a new argument structure waits for its result to learn the
output's structure; later calls return at once.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any, Callable

import jax

from jdist._src.errors import VaryingStateError
from jdist._src.ps import worker as worker_lib
from jdist._src.ps.datasets import WorkerBatch
from jdist._src.ps.variables import ServerVariables, plain


class _HandleSlot:
  """Where the `index`-th variables handle sits in arguments or outputs."""

  __slots__ = ("index",)

  def __init__(self, index: int):
    self.index = index

  def __eq__(self, other):
    return isinstance(other, _HandleSlot) and other.index == self.index

  def __hash__(self):
    return hash(("slot", self.index))


# A node without leaves: it passes through jit as part of the structure.
jax.tree_util.register_pytree_node(_HandleSlot, lambda s: ((), s.index),
                                   lambda index, _: _HandleSlot(index))

_is_handle = lambda x: isinstance(x, (ServerVariables, WorkerBatch))
_is_handle_slot = lambda x: isinstance(x, _HandleSlot)


class _Program:
  """A step compiled for one worker: join pieces, run, compute changes."""

  def __init__(self, inner, static_argnums, static_argnames):
    self._inner = inner  # the DistributedFunction over the worker's devices
    self._layouts: dict = {}  # layout key -> (treedef, specs)
    self._jitted = jax.jit(
        self._body, static_argnums=(0,) + tuple(i + 2 for i in static_argnums),
        static_argnames=static_argnames)

  def __call__(self, handles, parts, args, kwargs):
    keys = tuple(h.layout_key for h in handles)
    for h in handles:
      if h.layout_key not in self._layouts:
        self._layouts[h.layout_key] = (h.treedef, h.specs)
    return self._jitted(keys, parts, *args, **kwargs)

  def _body(self, keys, parts, *args, **kwargs):
    layouts = [self._layouts[k] for k in keys]
    values = [jax.tree.unflatten(treedef, [
        spec.join(p) for spec, p in zip(specs, leaf_parts)])
        for (treedef, specs), leaf_parts in zip(layouts, parts)]
    call_args, call_kwargs = jax.tree.map(
        lambda x: values[x.index] if _is_handle_slot(x) else x, (args, kwargs),
        is_leaf=_is_handle_slot)
    out = self._inner(*call_args, **call_kwargs)
    changes = {}

    def take(j, new):
      changes[j] = _changes(layouts[j], parts[j], new)
      return _HandleSlot(j)

    structures = [jax.tree.structure(plain(v)) for v in values]
    matches = lambda x, j: jax.tree.structure(plain(x)) == structures[j]
    first = args[0] if args and _is_handle_slot(args[0]) else None
    whole = [j for j in range(len(values)) if matches(out, j)]
    if whole:  # the step returns only the new state
      j = first.index if first is not None and first.index in whole else whole[0]
      return changes, take(j, out)
    if isinstance(out, (tuple, list)):
      items = list(out)
      for p, item in enumerate(items):
        if p < len(args) and _is_handle_slot(args[p]) and matches(item, args[p].index):
          items[p] = take(args[p].index, item)
      out = (type(out)(*items) if hasattr(out, "_fields")
             else type(out)(items))
    return changes, out


def _changes(layout, parts, new) -> tuple:
  """Per leaf, per piece: what the servers apply (traced)."""
  treedef, specs = layout
  leaves = jax.tree.leaves(plain(new))
  out = []
  for spec, leaf_parts, leaf in zip(specs, parts, leaves):
    got = (jax.random.key_data(leaf).shape[:len(spec.shape)]
           if spec.key_impl else leaf.shape)
    if tuple(got) != tuple(spec.shape) or (
        not spec.key_impl and leaf.dtype != spec.dtype):
      raise VaryingStateError(
          f"The step returned {leaf.dtype}{list(got)} for the variable "
          f"{spec.path or '<value>'}, which is {spec.dtype}{list(spec.shape)}. "
          "A step must return the new state with the shapes and dtypes of "
          "the state it took" + (
              f": cast it back, e.g. `.astype(jnp.{spec.dtype})`, or give "
              f"strategy.replicate a {leaf.dtype} value"
              if tuple(got) == tuple(spec.shape) else "") + ".")
    old = spec.join(leaf_parts)
    if spec.key_impl:
      old = jax.random.key_data(old)
    out.append(spec.split(spec.change(leaf, old)))
  return tuple(out)


def _handles(args, kwargs):
  """`(signature, handles)`: the call's structure, and its variables in order."""
  flat, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_handle)
  handles = [x for x in flat if isinstance(x, ServerVariables)]
  return (treedef, tuple(h.layout_key for h in handles)), handles


class ParameterServerFunction:
  """A step under `ParameterServerStrategy`; see `strategy.function`."""

  def __init__(self, strategy, fn: Callable, *, donate_argnums=(),
               static_argnums=(), static_argnames=(), check_state: bool = True):
    del donate_argnums  # the variables are fresh copies read from the servers
    if not callable(fn):
      raise TypeError(f"strategy.function needs a function, got "
                      f"{type(fn).__name__}.")
    self._strategy = strategy
    self._fn = fn
    self._static = (tuple(static_argnums), tuple(static_argnames))
    self._check_state = check_state
    self._id = uuid.uuid4().hex
    self._templates: dict = {}
    functools.update_wrapper(self, fn)

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_templates"] = {}
    return state

  @property
  def strategy(self):
    return self._strategy

  def __call__(self, *args, **kwargs):
    ctx = worker_lib.current()
    if ctx is None:
      return self._schedule(args, kwargs)
    return self._run(ctx, args, kwargs)

  # --- on a worker -------------------------------------------------------------

  def _program(self, ctx) -> _Program:
    program = ctx.programs.get(self._id)
    if program is None:
      inner = ctx.strategy.function(self._fn, static_argnums=self._static[0],
                                    static_argnames=self._static[1],
                                    check_state=self._check_state)
      program = ctx.programs[self._id] = _Program(inner, *self._static)
    return program

  def _run(self, ctx, args, kwargs):
    program = self._program(ctx)
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_handle)
    handles = []
    for i, x in enumerate(flat):
      if isinstance(x, ServerVariables):
        flat[i] = _HandleSlot(len(handles))
        handles.append(x)
      elif isinstance(x, WorkerBatch):
        flat[i] = x.distribute(ctx.strategy)
    args, kwargs = jax.tree_util.tree_unflatten(treedef, flat)
    staleness = self._strategy.max_staleness
    # The values the servers answered this worker's last update with, if it
    # keeps them (one round trip per step), else read now.
    snapshots = [ctx.snapshots.pop(h.set_id, None) or h.snapshot()
                 for h in handles]
    todo = None  # handle -> servers still to update; None: all
    while True:
      changes, out = program(handles, tuple(s.parts for s in snapshots), args,
                             kwargs)
      changes = jax.device_get(changes)
      refused = {}
      for j, change in changes.items():
        if todo is not None and j not in todo:
          continue
        servers = None if todo is None else todo[j]
        left, after = handles[j].push(snapshots[j], change, staleness,
                                      servers=servers)
        if left:
          refused[j] = left
        elif after is not None and ctx.reuse_answers:
          if len(ctx.snapshots) > 64:  # sets this worker no longer updates
            ctx.snapshots.clear()
          ctx.snapshots[handles[j].set_id] = after
      if not refused:
        break
      # Too stale for some servers: read again, recompute, send them only.
      todo = refused
      snapshots = [h.snapshot() for h in handles]
    return jax.tree.map(lambda x: handles[x.index] if _is_handle_slot(x) else x, out,
                        is_leaf=_is_handle_slot)

  # --- on the coordinator ------------------------------------------------------

  def _schedule(self, args, kwargs):
    coordinator = self._strategy.coordinator
    key, handles = _handles(args, kwargs)
    result = coordinator.schedule(self, args=args, kwargs=kwargs)
    template = self._templates.get(key)
    if template is None:
      ids = {h.set_id: j for j, h in enumerate(handles)}
      template = self._templates[key] = _template(result.get(), ids)
    if isinstance(template, int):
      return handles[template]
    if isinstance(template, tuple):
      return tuple(result[p] if t is None else handles[t]
                   for p, t in enumerate(template))
    return result


def _template(value, ids: dict):
  """Where a step's output holds variables: the index of the call's handle
  there (an int, or a tuple of them and None); None: no variables."""
  if isinstance(value, ServerVariables):
    return ids[value.set_id]
  if isinstance(value, tuple) and not hasattr(value, "_fields"):
    return tuple(ids[v.set_id] if isinstance(v, ServerVariables) else None
                 for v in value)
  return None
