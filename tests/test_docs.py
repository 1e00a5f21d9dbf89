"""The documentation site builds clean: `make docs`'s build, warnings as
errors, with the notebooks read but not executed (test_notebooks.py runs
them). docs/conf.py fails the build for a public name without an entry in
the API reference, so this also checks that every name is documented."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_site_builds_without_warnings(tmp_path):
  # Sphinx's dummy builder: every page read, autodoc'd, cross-referenced
  # and checked (a page in no table of contents is a warning), without
  # writing HTML, which halves the build's time (`make docs` writes it).
  doctrees = tmp_path / "doctrees"
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
       "dummy", "-D", "nb_execution_mode=off", "-d", str(doctrees),
       str(REPO / "docs"), str(tmp_path / "out")],
      env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
      text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  read = {p.relative_to(doctrees).with_suffix("").as_posix()
          for p in doctrees.rglob("*.doctree")}
  guides = {p.stem for p in (REPO / "docs").glob("*.md")}
  notebooks = {f"notebooks/{p.stem}"
               for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}
  assert guides | notebooks | {"api/strategies", "reference/changelog"} <= read
