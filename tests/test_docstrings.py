"""Every docstring example in jdist runs and prints what it says."""

import doctest
import importlib
import pkgutil
import tempfile

import docstring_share
import pytest

import jdist

# Docstrings are API entries and short notes; longer explanations go to docs/.
DOCSTRING_SHARE_LIMIT = 0.20

# Every module but the demo's entry points (they parse sys.argv when run).
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(jdist.__path__, "jdist.")
    if not m.name.endswith(("__main__", ".demo")))


def test_there_are_examples():
  count = sum(1 for m in MODULES
              for t in doctest.DocTestFinder().find(importlib.import_module(m))
              if t.examples)
  assert count >= 40


@pytest.mark.parametrize("name", MODULES)
def test_examples(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # examples that write files write them here
  # and their `tempfile.mkdtemp()` directories too (pytest removes them)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS |
                                 doctest.NORMALIZE_WHITESPACE)
  globs = {"jdist": jdist}
  for test in finder.find(module, globs=globs):
    if test.examples:
      runner.run(test)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{result.failed} example(s) failed in {name}"


def test_docstrings_are_at_most_a_fifth_of_the_source():
  rows = docstring_share.share()
  doc, lines = rows.pop("all")
  excess = {package: d - DOCSTRING_SHARE_LIMIT * n
            for package, (d, n) in rows.items()}
  above = ", ".join(
      f"{package} {rows[package][0] / rows[package][1]:.1%} (+{lines_over:.0f} "
      f"lines)" for package, lines_over in
      sorted(excess.items(), key=lambda item: -item[1]) if lines_over >= 1)
  assert doc / lines <= DOCSTRING_SHARE_LIMIT, (
      f"docstrings are {doc / lines:.1%} of jdist/_src ({doc:,} of {lines:,} "
      f"lines), above {DOCSTRING_SHARE_LIMIT:.0%}; shorten those of the "
      f"packages above it: {above} (see tests/docstring_share.py)")
