"""`make demo` runs end to end (one short epoch) and matches one device."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import TEST_XLA_FLAGS


@pytest.mark.multiprocess
def test_demo_runs_and_matches_one_device():
  # The demo asks for its own 4 devices; it compiles at the suite's level
  # (conftest.py), as the other processes the tests start: 13 -> 9 s CPU.
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=TEST_XLA_FLAGS)
  proc = subprocess.run(
      [sys.executable, "-m", "jdist.examples.demo", "--epochs", "2"],
      env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "MirroredStrategy: 4 replica(s)" in out
  assert out.count("epoch 2/2") == 2
  diff = float(re.search(r"largest parameter difference after training: (\S+)",
                         out).group(1))
  assert diff < 1e-3
  losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
  assert losses[1] < losses[0]  # it learned


def test_the_digits_are_scikit_learns():
  """The demo's data: `load_digits` reads scikit-learn's own file (without
  importing scikit-learn); the same digits and labels as its loader."""
  from sklearn import datasets

  from jdist.examples.data import load_digits
  x, y = load_digits(image=False)
  reference = datasets.load_digits()
  np.testing.assert_array_equal(x, (reference.data / 16.0).astype(np.float32))
  np.testing.assert_array_equal(y, reference.target)
  images, labels = load_digits()
  assert images.shape == (1797, 8, 8, 1) and labels.dtype == np.int32
  np.testing.assert_array_equal(images.reshape(-1, 64), x)


def test_the_digits_come_from_scikit_learns_loader_when_its_file_moved(
    monkeypatch, tmp_path):
  """A scikit-learn that keeps its data elsewhere: `load_digits` asks its
  loader and returns the same arrays."""
  import importlib.util
  import types

  from sklearn import datasets

  from jdist.examples import data
  real = importlib.util.find_spec

  def find_spec(name, *args):
    if name == "sklearn":  # an install whose package directory has no data
      return types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    return real(name, *args)

  monkeypatch.setattr(importlib.util, "find_spec", find_spec)
  asked = []
  loader = datasets.load_digits
  monkeypatch.setattr(datasets, "load_digits",
                      lambda: asked.append(True) or loader())
  x, y = data.load_digits(image=False)
  assert asked == [True]
  reference = loader()
  np.testing.assert_array_equal(x, (reference.data / 16.0).astype(np.float32))
  np.testing.assert_array_equal(y, reference.target)
