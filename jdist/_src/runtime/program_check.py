"""Multi-process checks on a strategy's steps: same program, bounded waits.

At the first call per compiled signature, every process compares a
fingerprint of its traced step with everybody's, so different programs
raise `jdist.ProgramMismatchError` instead of meeting in mismatched
collectives. The key is the k-th compilation of the run: processes that
compiled different steps must meet to be told so.
"""

from __future__ import annotations

import hashlib
import json
import re

from jdist._src.errors import ProgramMismatchError
from jdist._src.runtime.options import CommunicationOptions
from jdist._src.runtime.runtime import Runtime

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


class StepGuard:
  """The multi-process checks of one strategy (see the module docstring)."""

  def __init__(self, runtime: Runtime, options: CommunicationOptions):
    self._runtime = runtime
    self._timeout = options.timeout_seconds

  def check_program(self, name: str, closed_jaxpr) -> None:
    """Raises `ProgramMismatchError` everywhere unless all traced alike."""
    fingerprint = hashlib.sha256(
        _ADDRESS.sub("0x", str(closed_jaxpr)).encode()).hexdigest()[:16]
    signature = ", ".join(a.str_short() for a in closed_jaxpr.in_avals)
    seq = self._runtime.next_sequence("program")
    mine = json.dumps({"fp": fingerprint, "name": name, "sig": signature[:600]})
    values = self._runtime.exchange(
        f"jdist/program/{seq}/", mine, timeout=self._timeout,
        what=f"the program check of {name} (compilation {seq} of this run)")
    infos = {p: json.loads(v) for p, v in values.items()}
    if len({i["fp"] for i in infos.values()}) > 1:
      raise ProgramMismatchError(_mismatch_message(name, seq, infos))

  def track(self, name: str, leaf) -> None:
    monitor = self._runtime.monitor
    if leaf is not None and monitor is not None:
      monitor.track_step(name, leaf, self._timeout)


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
