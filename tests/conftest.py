"""Test setup: 4 fake CPU devices, set before JAX starts its backend.

Every program XLA compiles during the session goes into one persistent
compilation cache (a temporary directory, removed at the end), shared with the
processes the tests start: the many tests that compile the same step, and the
relaunches of one training, compile it once. The cache starts empty on every
run, so nothing from an earlier run (or another jdist) is ever reused. Ray's
session directories (its logs and sockets, which Ray keeps in /tmp/ray) go to
another temporary directory of the run (`RAY_TMPDIR`, short: a socket's path
must stay under 107 bytes), also removed at the end.

The suite compiles its many small programs for compile time, not run time
(`TEST_XLA_FLAGS`, which every process the tests start gets too, in
`XLA_FLAGS` or through `JDIST_TEST_XLA_FLAGS`): XLA's backend optimization
level 0, its older loop emitters for fusions (`xla_cpu_use_fusion_emitters=false`),
one code-generation unit per program and LLVM's expensive passes left out.
Most of an in-process test's time is JAX tracing and XLA compiling: these
flags take 35-45% off the CPU time of such test files, and what the tests
check (equality with one device, exact resumes, errors) holds under any of
them. The benchmarks and `make demo` compile with
XLA's defaults. `JDIST_TEST_XLA_FLAGS=` (empty) runs the suite with XLA's
defaults too.
"""

import contextlib
import logging
import os
import re
import shutil
import tempfile

TEST_XLA_FLAGS = os.environ.setdefault("JDIST_TEST_XLA_FLAGS", " ".join((
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_llvm_disable_expensive_passes=true")))


def xla_flags(devices: int) -> str:
  """`XLA_FLAGS` for a process of the suite with `devices` CPU devices."""
  return (f"{os.environ.get('JDIST_TEST_XLA_FLAGS', '')} "
          f"--xla_force_host_platform_device_count={devices}").strip()


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                           xla_flags(4)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keras 3 runs on JAX in jdist (tests/test_keras*.py); chosen before any
# test imports keras.
os.environ.setdefault("KERAS_BACKEND", "jax")
# pytest-xdist's workers inherit the cache of the run that started them.
_OWNER = "JDIST_TESTS_XLA_CACHE_OWNER"
if _OWNER not in os.environ:
  os.environ.update({
      _OWNER: str(os.getpid()),
      "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(
          prefix="jdist-tests-xla-cache-"),
      "RAY_TMPDIR": tempfile.mkdtemp(prefix="jdist-ray-"),
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jdist  # noqa: E402


def pytest_unconfigure(config):
  if os.environ.get(_OWNER) == str(os.getpid()):
    for name in ("JAX_COMPILATION_CACHE_DIR", "RAY_TMPDIR"):
      shutil.rmtree(os.environ[name], ignore_errors=True)


# Tests that start processes (or run for long) weigh this many quick tests.
_HEAVY = 10


def pytest_collection_modifyitems(config, items):
  """Runs the heaviest files first (by their tests, those that start
  processes or are marked slow weighing `_HEAVY`).

  `make test` hands files to its two pytest workers in collection order
  (`--dist loadfile --no-loadscope-reorder`): with the long files first, the
  workers end together instead of one running the last long file alone.
  """
  weight = {}
  for item in items:
    heavy = item.get_closest_marker("multiprocess") or item.get_closest_marker(
        "slow")
    weight[item.path] = weight.get(item.path, 0) + (_HEAVY if heavy else 1)
  items.sort(key=lambda item: -weight[item.path])  # stable: in-file order kept


@pytest.fixture(scope="session")
def devices():
  devs = jax.local_devices()
  assert len(devs) >= 4, "tests need 4 fake CPU devices (see conftest.py)"
  return devs


@pytest.fixture(scope="session")
def digits():
  from jdist.examples.data import load_digits
  return load_digits(image=True)


@pytest.fixture(scope="session")
def digits_flat():
  from jdist.examples.data import load_digits
  return load_digits(image=False)


def strategy_on(n: int):
  """A MirroredStrategy over the first n devices (OneDevice for n == 1)."""
  devs = jax.local_devices()[:n]
  return jdist.OneDeviceStrategy(devs[0]) if n == 1 else jdist.MirroredStrategy(devs)


@contextlib.contextmanager
def lowered_programs():
  """Yields the list of the programs JAX lowers in the block, by name
  (`jit(f)`): each one traced and compiled (or read from the cache)."""
  names = []

  class Lowerings(logging.Handler):
    def emit(self, record):
      found = re.match(r"Finished jaxpr to MLIR module conversion (\S+)",
                       record.getMessage())
      if found:
        names.append(found.group(1))

  handler, logger = Lowerings(), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield names
  finally:
    logger.removeHandler(handler)


class Interrupt(jdist.Callback):
  """Dies (raises) after a given global step, like a crashed job."""

  def __init__(self, at):
    super().__init__()
    self.at = at

  def on_train_batch_end(self, batch, logs=None):
    if self.model.global_step == self.at:
      raise KeyboardInterrupt(f"interrupted at step {self.at}")


@pytest.fixture
def rng():
  return np.random.default_rng(0)
