"""`Optional`: a value that may be absent (`tf.experimental.Optional`)."""

from __future__ import annotations

from typing import Any

_ABSENT = object()


class Optional:
  """A value or nothing, with the spec of the value it would hold.

  `has_value()` is a Python bool (TensorFlow's: a boolean tensor).

  Example:
    >>> import jdist
    >>> some = jdist.Optional.from_value(3)
    >>> some.has_value(), some.get_value()
    (True, 3)
    >>> jdist.Optional.empty(None).has_value()
    False
  """

  __slots__ = ("_value", "_spec")

  def __init__(self, value: Any, element_spec: Any):
    self._value = value
    self._spec = element_spec

  @classmethod
  def from_value(cls, value: Any, element_spec: Any = None) -> "Optional":
    """An optional that holds `value`."""
    return cls(value, element_spec)

  @classmethod
  def empty(cls, element_spec: Any) -> "Optional":
    """An optional that holds nothing (values would match `element_spec`)."""
    return cls(_ABSENT, element_spec)

  def has_value(self) -> bool:
    """Whether it holds a value."""
    return self._value is not _ABSENT

  def get_value(self) -> Any:
    """The value.

    Raises:
      ValueError: it holds none (TensorFlow raises `InvalidArgumentError`).
    """
    if self._value is _ABSENT:
      raise ValueError(
          "This Optional holds no value: the iterator it came from had "
          "reached the end of its data. Check has_value() before "
          "get_value().")
    return self._value

  @property
  def element_spec(self) -> Any:
    """The spec of the value it holds or would hold (None if unknown)."""
    return self._spec

  def __repr__(self) -> str:
    return (f"Optional({self._value!r})" if self.has_value()
            else "Optional(<empty>)")
