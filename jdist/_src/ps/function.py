"""`ParameterServerFunction`: a user's step, run on workers against the servers.

On a worker the step runs as a `MirroredStrategy` step, in one `jax.jit`
that joins the variables' pieces before it and computes each server's change
after it (new minus read for numbers, the new value for booleans and keys).
A change refused as too stale is recomputed from a new read.
"""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jdist._src.core import carried as carried_lib
from jdist._src.core import state_output as state_output_lib
from jdist._src.errors import DistributionError, VaryingStateError
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

  def __init__(self, inner, static_argnums, static_argnames, state_output,
               param_names):
    self._inner = inner  # the DistributedFunction over the worker's devices
    self._state_output = state_output
    self._param_names = param_names
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
    names = _argument_names(args, kwargs, self._param_names)
    writes = _new_state(self._state_output, out, values, names)
    changes = {j: _changes(layouts[j], parts[j], new,
                           f"{where}, the new value of {names[j]}")
               for j, where, new in writes}
    return changes, _with_slots(out, {id(new): j for j, _, new in writes})


def _argument_names(args, kwargs, param_names) -> list[str]:
  """How messages name each variables handle: by the argument holding it."""
  flat, _ = jax.tree_util.tree_flatten_with_path((args, kwargs),
                                                 is_leaf=_is_handle_slot)
  names = {}
  for path, x in flat:
    if not _is_handle_slot(x):
      continue
    where, rest = path[1], jax.tree_util.keystr(path[2:])
    if path[0].idx == 0:
      name = (f" `{param_names[where.idx]}`"
              if where.idx < len(param_names) else "")
      names[x.index] = f"argument {where.idx}{name}{rest}"
    else:
      names[x.index] = f"argument `{where.key}`{rest}"
  return [f"the ServerVariables {names[j]}" for j in range(len(names))]


def _new_state(state_output, out, values, names) -> list[tuple]:
  """`(handle index, where, new value)` of each variable set the step writes;
  raises before anything is written when the output does not match the
  `state_output` contract."""
  if state_output is None or (not values and
                              state_output is state_output_lib.DEFAULT):
    return []
  places = state_output if isinstance(state_output, tuple) else (state_output,)
  if not values:
    raise DistributionError(
        f"state_output={state_output!r} names where the step returns the new "
        "value of its ServerVariables, but it takes none: pass the variables "
        "as an argument, or drop state_output.")
  if len(places) != len(values):
    given = ("the default (one)" if state_output is state_output_lib.DEFAULT
             else str(len(places)))
    example = tuple(range(len(values)))
    raise DistributionError(
        f"The step takes {len(values)} sets of ServerVariables "
        f"({'; '.join(names)}) and state_output gives {given} place(s) for "
        f"their new values. Nothing was written. Pass one place per set, in "
        f"the order of the arguments, e.g. strategy.function(step, "
        f"state_output={example}) for a step that returns them as its first "
        f"outputs, with None for a set it only reads (or state_output=None "
        f"when it writes none).")
  writes = []
  for j, place in enumerate(places):
    if place is not None:
      where, new = _select(place, out, values[j], names[j])
      writes.append((j, where, new))
  return writes


def _structure(x):
  return jax.tree.structure(plain(x))


def _select(place, out, value, name) -> tuple:
  """`(where, new value)`: the output's part at `place`, checked to have the
  structure of the variables' `value`."""
  state = _structure(value)
  if place is state_output_lib.DEFAULT:
    first = out[0] if isinstance(out, (tuple, list)) and out else None
    # Output 0 in the variables' structure is their new value, unless its
    # shapes differ where another output fits exactly: `return loss, state`.
    if first is not None and _structure(first) == state and (
        _fits(first, value) or not _hint(out, value)):
      return "output 0", first
    raise DistributionError(
        f"The step's output {_summary(out)} does not hold the new value of "
        f"{name} {_summary(value)} where a step returns it by default: as "
        f"output 0 of a tuple, `return state, outputs`, the synchronous "
        f"strategies' step. Nothing was written.{_hint(out, value)} Say where "
        f"the step returns the new state: strategy.function(step, "
        f"state_output=1) (an index or key of the output, or a function of "
        f"the output that returns it, `lambda out: out` for the whole "
        f"output), or state_output=None for a step that only reads the "
        f"variables (an evaluation).")
  where = state_output_lib.describe(place)
  if callable(place):
    new = place(out)
  elif isinstance(place, int) and isinstance(out, (tuple, list)) and (
      -len(out) <= place < len(out)):
    new = out[place]
  elif isinstance(place, str) and isinstance(out, Mapping) and place in out:
    new = out[place]
  else:
    raise DistributionError(
        f"state_output={place!r} names {where}, which the step's output "
        f"{_summary(out)} does not have (for {name}). Nothing was written.")
  if _structure(new) != state:
    raise DistributionError(
        f"state_output={place!r}: {where} of the step is {_summary(new)}, not "
        f"the new value of {name} {_summary(value)}. Nothing was written."
        f"{_hint(out, value)} Return the variables' new value there, or pass "
        f"state_output=None for a step that only reads them.")
  return where, new


def _fits(x, value) -> bool:
  """Whether `x` has the structure, shapes and dtypes of the variables."""
  if _structure(x) != _structure(value):
    return False
  return all(jnp.shape(a) == jnp.shape(b) and
             getattr(a, "dtype", None) == getattr(b, "dtype", None)
             for a, b in zip(jax.tree.leaves(plain(x)),
                             jax.tree.leaves(plain(value))))


def _hint(out, value) -> str:
  """Which output has the variables' shapes (for the message only)."""
  if _fits(out, value):
    return (" The whole output has the variables' shapes: if it is their "
            "new value, pass state_output=lambda out: out; if it is only "
            "computed from them, state_output=None.")
  if isinstance(out, (tuple, list)):
    items = enumerate(out)
  elif isinstance(out, Mapping):
    items = out.items()
  else:
    return ""
  found = [k for k, v in items if _fits(v, value)]
  return "".join(f" Output {k!r} has the variables' shapes: if it is their "
                 f"new value, pass state_output={k!r}." for k in found[:1])


def _summary(tree, limit: int = 160) -> str:
  """A tree's shapes for a message, shortened."""
  text = str(jax.tree.map(
      lambda x: f"{getattr(x, 'dtype', type(x).__name__)}{list(jnp.shape(x))}",
      plain(tree)))
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _with_slots(node, slots: dict):
  """`node` with each written value replaced by its handle's slot."""
  if id(node) in slots:
    return _HandleSlot(slots[id(node)])
  if not slots:
    return node
  if isinstance(node, tuple) and hasattr(node, "_fields"):
    return type(node)(*(_with_slots(x, slots) for x in node))
  if type(node) in (tuple, list):
    return type(node)(_with_slots(x, slots) for x in node)
  if type(node) is dict:
    return {k: _with_slots(v, slots) for k, v in node.items()}
  return node


def _changes(layout, parts, new, where: str) -> tuple:
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
          f"{spec.path or '<value>'}, which is {spec.dtype}{list(spec.shape)} "
          f"(in {where}). Nothing was written. A step must return the new "
          "state with the shapes and dtypes of the state it took" + (
              f": cast it back, e.g. `.astype(jnp.{spec.dtype})`, or give "
              f"strategy.replicate a {leaf.dtype} value"
              if tuple(got) == tuple(spec.shape) else "") + (
              "; a step that only reads its variables takes "
              "strategy.function(step, state_output=None)") + ".")
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
               static_argnums=(), static_argnames=(), check_state: bool = True,
               state_output=state_output_lib.DEFAULT):
    del donate_argnums  # the variables are fresh copies read from the servers
    if not callable(fn):
      raise TypeError(f"strategy.function needs a function, got "
                      f"{type(fn).__name__}.")
    self._strategy = strategy
    self._fn = fn
    self._static = (tuple(static_argnums), tuple(static_argnames))
    self._check_state = check_state
    self._state_output = state_output_lib.check(state_output)
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

  def carry(self, *values) -> carried_lib.Carried:
    """Holds `values`, the step's first positional arguments, for a loop of
    `call_carried`: whole, as a scheduled call takes them (see
    `DistributedFunction.carry`)."""
    return carried_lib.Carried.held_whole(values)

  def call_carried(self, carried: carried_lib.Carried, *args) -> tuple:
    """Calls the step with `carried`'s values, then `args`; the outputs in
    the carried values' place replace them. Returns the other outputs."""
    out = self(*carried.whole, *args)
    return carried.hold(getattr(self, "__name__", "step"), tuple(out))

  # --- on a worker -------------------------------------------------------------

  def _program(self, ctx) -> _Program:
    program = ctx.programs.get(self._id)
    if program is None:
      inner = ctx.strategy.function(self._fn, static_argnums=self._static[0],
                                    static_argnames=self._static[1],
                                    check_state=self._check_state)
      program = ctx.programs[self._id] = _Program(
          inner, *self._static, self._state_output, _param_names(self._fn))
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
    if key in self._templates:
      template = self._templates[key]
    else:
      ids = {h.set_id: j for j, h in enumerate(handles)}
      template = self._templates[key] = _template(result.get(), ids)
    if isinstance(template, int):
      return handles[template]
    if isinstance(template, tuple):
      return tuple(result[p] if t is None else handles[t]
                   for p, t in enumerate(template))
    if isinstance(template, dict):
      return {k: result[k] if t is None else handles[t]
              for k, t in template.items()}
    return result


def _template(value, ids: dict):
  """Where a step's output holds variables: the handle's index (an int, a
  tuple of them and None, or a dict of them); None: one `RemoteValue`."""
  slot = lambda v: ids[v.set_id] if isinstance(v, ServerVariables) else None
  if isinstance(value, ServerVariables):
    return ids[value.set_id]
  if type(value) is tuple:
    return tuple(slot(v) for v in value)
  if type(value) is dict and any(slot(v) is not None for v in value.values()):
    return {k: slot(v) for k, v in value.items()}
  return None


def _param_names(fn) -> tuple:
  """The names of `fn`'s positional parameters, for messages."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return ()
  return tuple(p.name for p in params
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
