"""Keras's output-layout keys for flax models: a layer's output constrained
to its `LayoutMap` layout inside a step (linen through
`nn.intercept_methods`, nnx through a step-only subclass).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Iterator

import jax

from jdist._src.strategies.layout_map import LayoutMap


def _constrained(outputs: Any, spec) -> Any:
  return jax.tree.map(
      lambda y: jax.lax.with_sharding_constraint(y, spec)
      if isinstance(y, jax.Array) else y, outputs)


def _linen_interceptor(layout_map: LayoutMap, seen: list):
  """A linen method interceptor that constrains each module's output."""
  def intercept(next_fun, args, kwargs, ctx):
    out = next_fun(*args, **kwargs)
    path = "/".join(map(str, ctx.module.path))
    if ctx.method_name != "__call__" or not path:
      return out
    seen.append(path)
    spec = layout_map.output_layout(path)
    return out if spec is None else _constrained(out, spec)
  return intercept


@functools.lru_cache(maxsize=None)
def _subclass(cls: type) -> type:
  """`cls` with a `__call__` that constrains its output to the instance's
  `_jdist_output_layout` (a subclass per class, made once)."""
  def __call__(self, *args, **kwargs):
    out = super(sub, self).__call__(*args, **kwargs)
    return _constrained(out, self.__dict__["_jdist_output_layout"])
  sub = type(cls.__name__, (cls,), {"__call__": __call__,
                                    "__module__": cls.__module__})
  return sub


@contextlib.contextmanager
def _nnx_constrained(modules: list, layout_map: LayoutMap,
                     seen: list) -> Iterator[None]:
  """nnx `modules` (and their submodules) whose output a key lays out,
  constrained while the block runs; their classes restored after."""
  nnx = sys.modules["flax.nnx"]
  changed = []
  for module in modules:
    for path, sub in nnx.iter_modules(module):
      name = "/".join(map(str, path))
      if not name:
        continue
      seen.append(name)
      spec = layout_map.output_layout(name)
      if spec is not None and "_jdist_output_layout" not in sub.__dict__:
        changed.append((sub, type(sub)))
        sub.__dict__["_jdist_output_layout"] = spec
        sub.__class__ = _subclass(type(sub))
  try:
    yield
  finally:
    for sub, cls in changed:
      sub.__class__ = cls
      del sub.__dict__["_jdist_output_layout"]


def nnx_modules(tree: Any) -> list:
  """The flax nnx modules among the nodes of `tree` (none without nnx)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return []
  return [x for x in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, nnx.Module))
          if isinstance(x, nnx.Module)]


class _Active(threading.local):
  """This thread's open `applied` scopes: (layout map, layer paths seen)."""

  def __init__(self):
    super().__init__()
    self.scopes: list = []


_active = _Active()


def nnx_outputs(module) -> contextlib.AbstractContextManager:
  """Inside a step with output-layout keys: the outputs of `module`'s (an
  nnx module made in the step) submodules constrained for the block."""
  if not _active.scopes:
    return contextlib.nullcontext()
  layout_map, seen = _active.scopes[-1]
  return _nnx_constrained([module], layout_map, seen)


@contextlib.contextmanager
def applied(layout_map: LayoutMap | None, modules: list,
            warned: set) -> Iterator[None]:
  """For a step's trace: `layout_map`'s output keys constrain the outputs of
  linen modules and of nnx `modules`' submodules; then warns once (keys in
  `warned`) of keys that matched no layer."""
  keys = layout_map.output_keys if layout_map is not None else ()
  if not keys:
    yield
    return
  seen: list = []
  with contextlib.ExitStack() as stack:
    linen = sys.modules.get("flax.linen")
    if linen is not None:
      stack.enter_context(linen.intercept_methods(
          _linen_interceptor(layout_map, seen)))
    if modules:
      stack.enter_context(_nnx_constrained(modules, layout_map, seen))
    _active.scopes.append((layout_map, seen))
    try:
      yield
    finally:
      _active.scopes.pop()
  if not set(keys) <= warned:
    warned.update(keys)
    layout_map.warn_unmatched_outputs(list(dict.fromkeys(seen)))
