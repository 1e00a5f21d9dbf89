"""Runs the documentation's programs, one after another, in this process.

    python tests/run_programs.py PROGRAMS.json RESULTS.json

PROGRAMS.json is a list of `{"name": "README.md:42", "code": "..."}`. Each
program runs as a script would (`__name__ == "__main__"`, its own globals),
in a fresh scratch directory of its own (the files it writes stay there), and
its printed output is kept. One process for all the programs imports JAX
and jdist once (tests/test_readme.py runs every page's programs in one).
RESULTS.json gets, for each program in order, `{"name", "stdout", "error"}`
(`error`: the traceback, or None).
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import traceback


def run(program: dict) -> dict:
  out = io.StringIO()
  error = None
  here = os.getcwd()
  with tempfile.TemporaryDirectory(prefix="jdist-doc-program-") as scratch:
    os.chdir(scratch)
    try:
      with contextlib.redirect_stdout(out):
        exec(compile(program["code"], program["name"], "exec"),
             {"__name__": "__main__"})
    except BaseException:  # noqa: BLE001 -- reported, with its traceback
      error = traceback.format_exc()
    finally:
      os.chdir(here)
  return {"name": program["name"], "stdout": out.getvalue(), "error": error}


def main(argv: list) -> int:
  with open(argv[1]) as f:
    programs = json.load(f)
  results = []
  for program in programs:  # which one a crash or a timeout stopped in
    print(f"running {program['name']}", file=sys.stderr, flush=True)
    results.append(run(program))
  with open(argv[2], "w") as f:
    json.dump(results, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
