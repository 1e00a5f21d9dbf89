"""A user's JAX mesh around jdist's programs, and what a sharding constraint
means inside a replica's step (docs/jax_meshes.md says it for users).

The mesh in context must be the strategy's own (any axis types). Inside a
replica, a constraint's spec is the global one without the replica axis;
replicas of one device each keep every value whole.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Iterator

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._src import jax_compat
from jdist._src.errors import StrategyMismatchError


def describe(mesh) -> str:
  """`mesh` for a message: its axes, their types and its devices."""
  axes = ", ".join(f"{n!r}: {s}" for n, s in mesh.shape.items())
  types = ", ".join(t.name for t in mesh.axis_types)
  comma = "," if len(mesh.axis_types) == 1 else ""
  text = f"Mesh({axes}, axis_types=({types}{comma}))"
  if isinstance(mesh, Mesh):
    devices = mesh.devices.flat
    text += " on " + ", ".join(f"{d.platform}:{d.id}" for d in devices)
  return text


def same_mesh(a, b) -> bool:
  """Whether `a` and `b` are one mesh, whatever their axis types."""
  if tuple(a.axis_names) != tuple(b.axis_names) or \
      tuple(a.axis_sizes) != tuple(b.axis_sizes):
    return False
  if isinstance(a, Mesh) and isinstance(b, Mesh):
    return ([d.id for d in a.devices.flat] == [d.id for d in b.devices.flat]
            and a.devices.flat[0].platform == b.devices.flat[0].platform)
  return True


def _context_meshes():
  """The user's mesh in context, concrete (or None) and abstract."""
  return jax_compat.context_mesh(), jax.sharding.get_abstract_mesh()


def check_context(mesh: Mesh, what: str) -> None:
  """Raises `StrategyMismatchError` unless the mesh in context (if any) is
  the strategy's `mesh`; `what` names who runs, for the message."""
  concrete, abstract = _context_meshes()
  user = concrete if concrete is not None else abstract
  if (concrete is None and abstract.empty) or same_mesh(user, mesh):
    return
  raise StrategyMismatchError(
      f"{what} runs on its mesh {describe(mesh)}, but the mesh in context "
      f"(jax.set_mesh) is {describe(user)}. Build the strategy from the mesh "
      "you set (jdist.MirroredStrategy(mesh=mesh) for a mesh of one axis, "
      "jdist.ModelParallelStrategy(device_mesh=mesh) for more), or call the "
      "step outside that `with jax.set_mesh(...)` block.")


def entered(mesh: Mesh, what: str) -> contextlib.AbstractContextManager:
  """Inside a trace: the strategy's mesh as the context mesh (`shard_map`
  wants its own), once `check_context` accepts the user's."""
  check_context(mesh, what)
  abstract = jax.sharding.get_abstract_mesh()
  if abstract.empty or abstract == mesh.abstract_mesh:
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def on_mesh(mesh: Mesh, what: str, fn):
  """`fn`, traced under `entered(mesh, what)`."""
  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with entered(mesh, what):
      return fn(*args, **kwargs)
  return traced


def set_aside(mesh: Mesh | None = None,
              what: str = "") -> contextlib.AbstractContextManager:
  """Outside a trace: the user's mesh set aside for the block (after
  `check_context`, if `mesh` is given), so jdist's programs run as they do
  without one."""
  concrete, abstract = _context_meshes()
  if (concrete is None and abstract.empty) or jax_compat.inside_trace():
    return contextlib.nullcontext()
  if mesh is not None:
    check_context(mesh, what)
  return jax.set_mesh(None)


def _axes(entry) -> tuple:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def _known_once(spec: P, names) -> P:
  """`spec` without axes not in `names` and without an axis's second use."""
  seen: set = set()

  def keep(axis) -> bool:
    fresh = axis in names and axis not in seen
    seen.add(axis)
    return fresh
  return P(*(_keeping(entry, keep) for entry in spec))


def _keeping(entry, keep):
  """One dimension's entry of a spec with the axes `keep` refuses left out."""
  if entry is None or entry is P.UNCONSTRAINED:
    return entry
  kept = tuple(a for a in _axes(entry) if keep(a))
  if not kept:
    return None
  return kept if len(kept) > 1 else kept[0]


def constraint(strategy, sharding: Any, *, in_step: bool,
               strict: bool = True) -> Any:
  """What a sharding given to `with_sharding_constraint` means in code that
  `strategy` runs, inside a replica's step (`in_step`) or outside.

  Args:
    strict: raise for another mesh or an unknown axis (else leave it out).

  Raises:
    StrategyMismatchError, ValueError: another mesh, an unknown axis.
  """
  mesh, axis = strategy.mesh, strategy.axis_name
  if isinstance(sharding, NamedSharding):
    spec, on = sharding.spec, sharding.mesh
  elif isinstance(sharding, P):
    spec, on = sharding, None
  else:
    return sharding  # another kind of sharding: JAX's to judge
  if all(name == axis for name in mesh.axis_names):
    return P()
  if not strict:
    spec = _known_once(spec, mesh.axis_names)
  elif on is not None and not same_mesh(on, mesh):
    raise StrategyMismatchError(
        f"with_sharding_constraint in code {strategy!r} runs was given a "
        f"NamedSharding on {describe(on)}, but the strategy's mesh is "
        f"{describe(mesh)}. Constrain activations on the strategy's mesh "
        "(NamedSharding(strategy.mesh, spec)) or with a bare PartitionSpec.")
  unknown = [a for entry in spec for a in _axes(entry)
             if a not in mesh.axis_names]
  if strict and unknown:
    raise ValueError(
        f"with_sharding_constraint in code {strategy!r} runs names the mesh "
        f"axis {unknown[0]!r} ({spec}), but the strategy's mesh has the axes "
        f"{tuple(mesh.axis_names)}. Name axes of the strategy's mesh, or "
        "build the strategy on the mesh the model was written for "
        "(ModelParallelStrategy(device_mesh=mesh)).")
  if not in_step:
    return spec
  return P(*(_keeping(entry, lambda a: a != axis) for entry in spec))


def _rules_and_constraints(stack: contextlib.ExitStack, strategy, *,
                           in_step: bool, strict: bool = True) -> None:
  """Enters flax's rules (the strategy's) and the constraints' meaning."""
  stack.enter_context(jax_compat.sharding_constraints_mapped(
      lambda sharding: constraint(strategy, sharding, in_step=in_step,
                                  strict=strict)))
  rules = strategy.logical_axis_rules
  spmd = sys.modules.get("flax.core.spmd")  # flax's rules, if flax is used
  if rules and spmd is not None:
    stack.enter_context(spmd.logical_axis_rules(rules))


@contextlib.contextmanager
def outside_steps(strategy, *, strict: bool = True) -> Iterator[None]:
  """For code that traces the model outside a step (`strategy.init`): the
  strategy's mesh in context, its rules as flax's, and constraints as
  `constraint(strict=strict)` reads them."""
  what = repr(strategy)
  with contextlib.ExitStack() as stack:
    if jax_compat.inside_trace():
      stack.enter_context(entered(strategy.mesh, what))
    else:
      check_context(strategy.mesh, what)
      stack.enter_context(jax.set_mesh(strategy.mesh))
    _rules_and_constraints(stack, strategy, in_step=False, strict=strict)
    yield


@contextlib.contextmanager
def replica_scope(strategy) -> Iterator[None]:
  """Inside one replica's step: constraints and flax's rules."""
  with contextlib.ExitStack() as stack:
    _rules_and_constraints(stack, strategy, in_step=True)
    yield
