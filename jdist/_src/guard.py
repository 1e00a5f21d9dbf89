"""Multi-process checks on a strategy's steps: same program, bounded waits.

A `StepGuard` exists only for strategies whose devices span processes. At the
first call per compiled signature (jit's trace, before anything runs) each
process publishes a fingerprint of its traced step through the coordination
service and compares it with everybody's: processes that would run different
programs raise `jdist.ProgramMismatchError` instead of meeting in mismatched
collectives. Every dispatched step is handed to the process monitor, which
enforces `CommunicationOptions.timeout_seconds`. Per step this costs one tuple
assignment; per compilation one key-value exchange.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re

from jdist._src import multihost

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_checks = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
  """How a multi-process strategy's collectives behave.

  Attributes:
    timeout_seconds: a step whose collectives do not complete in this time
      ends the waiting processes with `jdist.CollectiveTimeoutError`, naming
      the processes that did not join (XLA collectives cannot be cancelled, so
      the error is printed and the process exits). Rendezvous outside XLA
      (the program check, per-process input agreement) raise it as an
      exception. None waits forever, as TensorFlow does.
    bytes_per_pack: accepted for TensorFlow compatibility; XLA packs itself.
    implementation: accepted for TensorFlow compatibility ("auto", "ring",
      "nccl"); XLA chooses the collective implementation.

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


class StepGuard:
  """The multi-process checks of one strategy (see the module docstring)."""

  def __init__(self, options: CommunicationOptions):
    self._timeout = options.timeout_seconds
    self._monitor = multihost.ensure_monitor()

  def check_program(self, name: str, closed_jaxpr) -> None:
    """Raises `ProgramMismatchError` on every process unless all traced the same."""
    fingerprint = hashlib.sha256(
        _ADDRESS.sub("0x", str(closed_jaxpr)).encode()).hexdigest()[:16]
    signature = ", ".join(a.str_short() for a in closed_jaxpr.in_avals)
    seq = next(_checks)
    mine = json.dumps({"fp": fingerprint, "name": name, "sig": signature[:600]})
    values = multihost.exchange(
        f"jdist/program/{seq}/", mine, timeout=self._timeout,
        what=f"the program check of {name} (compilation {seq} of this run)")
    infos = {p: json.loads(v) for p, v in values.items()}
    if len({i["fp"] for i in infos.values()}) > 1:
      from jdist._src.types import ProgramMismatchError
      raise ProgramMismatchError(_mismatch_message(name, seq, infos))

  def track(self, name: str, leaf) -> None:
    if leaf is not None and self._monitor is not None:
      self._monitor.track_step(name, leaf, self._timeout)


def _mismatch_message(name: str, seq: int, infos: dict) -> str:
  reference = infos[0]["fp"]
  differ = sorted(p for p, i in infos.items() if i["fp"] != reference)
  groups = {}
  for p, i in sorted(infos.items()):
    groups.setdefault(i["fp"], []).append(p)
  lines = []
  for fp, procs in list(groups.items())[:6]:
    i = infos[procs[0]]
    who = "process" if len(procs) == 1 else "processes"
    lines.append(f"  {who} {', '.join(map(str, procs))}: {i['name']}"
                 f"({i['sig'][:300]}) fingerprint {fp}")
  first, other = infos[0], infos[differ[0]]
  if first["name"] != other["name"]:
    hint = "They compiled different step functions."
  elif first["sig"] != other["sig"]:
    hint = "The inputs differ in shape or dtype."
  else:
    hint = ("The inputs agree; the computation differs (a hyperparameter, the "
            "model size or a code path).")
  return (f"The processes compiled different programs for {name} (compilation "
          f"{seq} of this run): processes {differ} differ from process 0. "
          f"{hint}\n" + "\n".join(lines) + "\nRunning them would hang or give "
          "wrong results, so every process stops here. Every process must run "
          "the same code with the same hyperparameters and input shapes "
          "(multi-controller SPMD): look for code that depends on "
          "jax.process_index() or on per-process configuration.")
