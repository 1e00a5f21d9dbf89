"""Every docstring example in jdist runs and prints what it says."""

import doctest
import importlib
import pkgutil
import tempfile

import pytest

import jdist

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
