"""What IDEs and type checkers see of jdist: the facade's stub and mypy.

`jdist/__init__.py` imports each public name on first use (so `jdist launch`
never loads JAX); type checkers and IDEs read `jdist/__init__.pyi` instead,
which names every one with the module that defines it. Here: the stub says
what the facade does, mypy accepts a user's typed program (which also runs)
and refuses wrong uses of the public names, as a user's mypy would.
"""

import ast
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

import jdist

ROOT = pathlib.Path(jdist.__file__).parent.parent
STUB = ROOT / "jdist" / "__init__.pyi"
PROGRAMS = ROOT / "tests" / "typecheck"
GOOD = PROGRAMS / "uses_public_api.py"
WRONG = PROGRAMS / "misuses_public_api.py"


def _stub():
  """The stub's `{name: defining module}`, its `__all__`, its other names."""
  imported, names, other = {}, None, []
  for node in ast.parse(STUB.read_text()).body:
    if isinstance(node, ast.ImportFrom):
      for alias in node.names:
        # `X as X`: what mypy and pyright count as re-exported.
        assert alias.asname == alias.name, ast.unparse(node)
        imported[alias.name] = (f"jdist.{alias.name}" if node.module == "jdist"
                                else node.module)
    elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == \
        "__all__":
      names = ast.literal_eval(node.value)
    elif isinstance(node, ast.AnnAssign):
      other.append(ast.unparse(node.target))
  return imported, names, other


def test_the_stub_names_what_the_facade_exports():
  imported, names, other = _stub()
  assert names == jdist.__all__, (
      "jdist/__init__.pyi's __all__ differs from jdist.__all__: "
      f"missing {sorted(set(jdist.__all__) - set(names))}, "
      f"extra {sorted(set(names) - set(jdist.__all__))}")
  wrong = {name: (imported.get(name), module)
           for name, module in jdist._EXPORTS.items()
           if imported.get(name) != module}
  assert not wrong and len(imported) == len(jdist.__all__), (
      "jdist/__init__.pyi imports these names from other modules than "
      f"jdist/__init__.py (stub, facade): {wrong}")
  assert other == ["__version__"]
  # The stub is the facade: each name is the object `jdist.<name>` gives.
  assert jdist.Trainer is __import__(imported["Trainer"],
                                     fromlist=["Trainer"]).Trainer


def _mypy_errors(cache_dir):
  """`{(file, line, code)}` of mypy's errors over the two programs."""
  done = subprocess.run(
      [sys.executable, "-m", "mypy", "--config-file",
       str(PROGRAMS / "mypy.ini"), "--cache-dir", str(cache_dir),
       "--no-error-summary", "--no-pretty", "--no-color-output",
       str(GOOD.relative_to(ROOT)), str(WRONG.relative_to(ROOT))],
      cwd=ROOT, env=dict(os.environ, MYPYPATH=str(ROOT)),
      capture_output=True, text=True, timeout=600)
  assert done.returncode in (0, 1) and not done.stderr, (
      done.stdout + done.stderr)
  found = re.findall(r"^(\S+):(\d+): error: .*\[([\w-]+)\]$", done.stdout,
                     re.MULTILINE)
  return {(pathlib.Path(f).name, int(line), code) for f, line, code in found}, \
      done.stdout


@pytest.mark.slow
def test_mypy_accepts_a_users_program_and_refuses_wrong_uses(tmp_path):
  """A misspelt name, a wrong argument type and a wrong use of a result are
  mypy errors (the lazy facade alone made every name `Any`: none was)."""
  refused = {(WRONG.name, i, m.group(1))
             for i, line in enumerate(WRONG.read_text().splitlines(), 1)
             if (m := re.search(r"# refused: ([\w-]+)$", line))}
  assert len(refused) == 6
  errors, out = _mypy_errors(tmp_path / "mypy-cache")
  assert errors == refused, out


def test_the_typed_program_runs():
  """The program mypy reads is a working one: a custom loop and fit."""
  program = runpy.run_path(str(GOOD))
  program["main"]()
