"""Where a RESULTS.md section's figures came from: the command, the date, the
machine and its load.

A benchmark script's `main` calls `report(measure, section, as_json)`: it
stamps the run, measures, keeps the stamp in the result, and prints the
script's RESULTS.md section (which opens with `line(stamp)`) and, with
`--json`, the result; so a section pasted from a script run alone says so as
plainly as one that `make bench` wrote.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shlex
import sys
from typing import Callable


def _load() -> str:
  return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def stamp(argv: list | None = None) -> dict:
  """The command (as typed from the repository's root), date, machine, load."""
  argv = sys.argv if argv is None else argv
  script = pathlib.Path(argv[0])
  shown = (f"benchmarks/{script.name}" if script.parent.name == "benchmarks"
           else str(script))
  args = [a for a in argv[1:] if a != "--json"]  # the output's format only
  return {"command": shlex.join(["python", shown, *args]),
          "date": str(datetime.date.today()),
          "machine": f"{platform.machine()}, {os.cpu_count()} cores",
          "load_before": _load()}


def finish(st: dict) -> dict:
  """The stamp with the load after the measurement."""
  return {**st, "load_after": _load()}


def line(st: dict) -> str:
  """One sentence: what ran, when, where, under what load."""
  return (f"From `{st['command']}` on {st['date']} ({st['machine']}); load "
          f"average (1, 5, 15 min) before: {st['load_before']}, after: "
          f"{st.get('load_after', 'not recorded')}.")


def report(measure: Callable[[], dict], section: Callable[[dict], list],
           as_json: bool) -> dict:
  """Measures, prints the RESULTS.md section and, `as_json`, the result."""
  st = stamp()
  res = measure()
  res["provenance"] = finish(st)
  print("\n".join(section(res)), flush=True)
  if as_json:
    print(json.dumps(res))
  return res
