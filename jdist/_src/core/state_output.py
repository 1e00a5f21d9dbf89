"""`state_output`: where a step returns the new value of the state it took.

Stated, never inferred from shapes: `DEFAULT` (output 0 of a tuple or
list), `None` (read only), an int, str or callable place, or a tuple of
those, one per set of variables.
"""

from __future__ import annotations

import enum
from typing import Any


class _Default(enum.Enum):
  """The type of `DEFAULT` (an enum: its identity survives pickling)."""

  FIRST = "output 0"

  def __repr__(self) -> str:
    return "<output 0 of a tuple>"


DEFAULT = _Default.FIRST


def _is_place(x: Any) -> bool:
  return (x is None or callable(x) or isinstance(x, str) or
          (isinstance(x, int) and not isinstance(x, bool)))


def check(state_output: Any) -> Any:
  """Returns `state_output` if it has one of the forms above.

  Raises:
    TypeError: any other value, with the forms it may take.
  """
  if state_output is DEFAULT or _is_place(state_output):
    return state_output
  if isinstance(state_output, tuple) and state_output and all(
      _is_place(p) for p in state_output):
    return state_output
  raise TypeError(
      f"state_output={state_output!r} is not a place in the step's output. "
      "Pass an int (an index of the tuple the step returns), a str (a key of "
      "the dict it returns), a function of the output that returns the new "
      "state, None for a step that only reads its variables, or a tuple of "
      "these with one per set of variables the step takes.")


def describe(place: Any) -> str:
  """A place as a message names it: "output 1", "output['state']"."""
  if place is DEFAULT:
    return "output 0"
  if isinstance(place, int):
    return f"output {place}"
  if isinstance(place, str):
    return f"output[{place!r}]"
  if place is whole:
    return "the whole output"
  return f"the output selected by {getattr(place, '__name__', repr(place))}"


def whole(output: Any) -> Any:
  """The place that is the whole output (`lambda out: out`, named)."""
  return output
