"""`CommunicationOptions`: how a multi-process strategy's collectives behave."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
  """How a multi-process strategy's collectives behave.

  Attributes:
    timeout_seconds: collectives not done in this time end the waiting
      processes (`jdist.CollectiveTimeoutError`); None waits forever.
    bytes_per_pack: accepted for TensorFlow compatibility; XLA packs itself.
    implementation: accepted for TensorFlow compatibility; XLA chooses.

  Example:
    >>> import jdist
    >>> jdist.CommunicationOptions(timeout_seconds=30).timeout_seconds
    30
  """

  timeout_seconds: float | None = None
  bytes_per_pack: int = 0
  implementation: str = "auto"

  def __post_init__(self):
    t = self.timeout_seconds
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                          or t <= 0):
      raise ValueError(f"timeout_seconds must be a positive number of seconds "
                       f"or None, got {t!r}.")
    if self.bytes_per_pack < 0:
      raise ValueError(f"bytes_per_pack must be >= 0, got {self.bytes_per_pack}.")

  @classmethod
  def of(cls, options) -> "CommunicationOptions":
    """Accepts None, an instance, or TensorFlow's CommunicationOptions."""
    if options is None:
      return cls()
    if isinstance(options, cls):
      return options
    if hasattr(options, "timeout_seconds"):  # tf.distribute.experimental's
      return cls(timeout_seconds=getattr(options, "timeout_seconds", None) or None)
    raise TypeError(f"communication_options must be jdist.CommunicationOptions, "
                    f"got {type(options).__name__}.")
