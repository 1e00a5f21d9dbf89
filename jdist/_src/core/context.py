"""Which strategy's scope is open, and whether code runs inside a replica's step.

Two thread-local stacks, as in TensorFlow: `strategy.scope()` pushes a
strategy, tracing a step its `ReplicaContext` (`merge_call`: None). The
default strategy is decided at the top layer (`jdist/_src/current.py`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from jdist._src.errors import ReplicaContextError, StrategyMismatchError


class _Stacks(threading.local):
  """This thread's scope stack (strategies) and replica stack (contexts)."""

  def __init__(self):
    super().__init__()
    self.scopes: list = []
    self.replicas: list = []
    self.untyped = 0


_stacks = _Stacks()

# How many scopes and replica contexts are open, in all threads: while none
# is, any step may be called (`may_call_step`'s answer without reading this
# thread's stacks, one module attribute read per step call).
open_count = 0
_count_lock = threading.Lock()


@contextlib.contextmanager
def _counted() -> Iterator[None]:
  global open_count
  with _count_lock:
    open_count += 1
  try:
    yield
  finally:
    with _count_lock:
      open_count -= 1


@contextlib.contextmanager
def strategy_scope(strategy) -> Iterator[Any]:
  """Makes `strategy` current for the block (what `strategy.scope()` does)."""
  scopes = _stacks.scopes
  if scopes and scopes[-1] != strategy:
    raise StrategyMismatchError(
        f"Cannot enter the scope of {strategy!r} inside the scope of "
        f"{scopes[-1]!r}: mixing strategies in one program would place state "
        "on different devices. Leave the outer scope first.")
  if _stacks.replicas:
    raise ReplicaContextError(
        "strategy.scope() was entered inside a step (a replica context). Enter "
        "the scope outside the step, around the code that builds and runs it.")
  with _counted():
    scopes.append(strategy)
    try:
      yield strategy
    finally:
      scopes.pop()


def current_scope_strategy():
  """The innermost strategy whose scope is open, or None."""
  scopes = _stacks.scopes
  return scopes[-1] if scopes else None


@contextlib.contextmanager
def replica_scope(replica_context) -> Iterator[Any]:
  """Marks the block as one replica's step (used while tracing a step)."""
  replicas = _stacks.replicas
  with _counted():
    replicas.append(replica_context)
    try:
      yield replica_context
    finally:
      replicas.pop()


def current_replica_context():
  """The replica context of the step being traced, or None outside steps
  (and inside `merge_call`)."""
  replicas = _stacks.replicas
  return replicas[-1] if replicas else None


def tracing_step() -> bool:
  """Whether a step is being traced (including its `merge_call` functions)."""
  return bool(_stacks.replicas)


def may_call_step(strategy) -> bool:
  """Whether a step of `strategy` may be called here: outside every step (or
  in its `merge_call`), and in no other strategy's scope (callers skip it
  while `open_count` is 0)."""
  stacks = _stacks
  if stacks.replicas and stacks.replicas[-1] is not None:
    return False
  scopes = stacks.scopes
  return not scopes or scopes[-1] is strategy or scopes[-1] == strategy


@contextlib.contextmanager
def untyped_replica() -> Iterator[None]:
  """Marks a trace whose varying-axis types are not tracked (one replica
  over several devices, `check_vma=False`): every value counts as varying."""
  _stacks.untyped += 1
  try:
    yield
  finally:
    _stacks.untyped -= 1


def varying_types_untracked() -> bool:
  """Whether the trace runs inside `untyped_replica`."""
  return _stacks.untyped > 0
