"""Every tutorial notebook runs top to bottom on fake CPU devices.

The notebooks are kept as jupytext pairs: `notebooks/NN_name.py` (percent
format, the one to edit) and `notebooks/NN_name.ipynb` (outputs stripped, the
one to open in Jupyter or Colab). This checks that each pair agrees and then
executes each .ipynb, top to bottom, in one kernel that starts every
notebook from an empty namespace.
"""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")
from jupyter_client import AsyncKernelManager  # noqa: E402
from jupyter_core.utils import run_sync  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PAIRS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_there_are_notebooks():
  assert len(PAIRS) >= 1


def _sources(nb):
  return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_stripped(path):
  nb = nbformat.read(path, as_version=4)
  text = jupytext.read(path.with_suffix(".py"))
  assert _sources(nb) == _sources(text), (
      f"{path.name} and its .py differ: run "
      f"`jupytext --to ipynb {path.with_suffix('.py').name}` in notebooks/")
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs, f"{path.name} has outputs: strip them"


# Smaller runs of the same cells, as papermill passes parameters: set in a
# cell after the one tagged "parameters". The notebooks' own checks still
# hold (01: fit on all devices equals fit on one, at every epoch; its timed
# loops compile one step per global batch and device count, and their times
# are printed, not checked: one batch size runs the same lines).
PARAMETERS = {"01_mirrored_quickstart":
              "EPOCHS, SIZES, TIMED_STEPS = 2, [64], 2",
              # 2 epochs: the crash at step 37 is in the second, resumed
              # from the backup at step 30 (4 epochs, 57 and 50 by default)
              "03_checkpoints_and_recovery": "EPOCHS, CRASH_AT = 2, 37",
              "05_parameter_servers": "STEPS = 200",
              # one timed step of smaller layers per schedule
              "07_pipelines": "TIMED_STEPS, WIDTH, ROWS = 1, 256, 64"}


def test_parameters_name_a_parameters_cell():
  for stem, values in PARAMETERS.items():
    nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{stem}: one cell tagged 'parameters'"
    for name in values.split("=")[0].replace(",", " ").split():
      assert name in cells[0].source, f"{stem}: {name} is not a parameter"


def _with_parameters(nb, stem: str):
  if stem in PARAMETERS:
    at = next(i for i, c in enumerate(nb.cells)
              if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(PARAMETERS[stem]))
  return nb


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
  """One Python kernel that runs every notebook in turn (each from a reset
  namespace, its own directory and the kernel's starting environment: see
  `_fresh_start`), so that the kernel's start and the imports of JAX, jdist,
  flax and matplotlib are paid once, not once per notebook. The kernel
  compiles with the suite's XLA flags (conftest.py's XLA_FLAGS): with the
  parameters above every notebook spends more of its time compiling than
  running steps."""
  os.environ.setdefault("MPLBACKEND", "Agg")
  env = dict(os.environ)
  # The kernel runs in scratch directories: let it import this checkout's
  # jdist even when it is not installed (an installed jdist works the same).
  root = str(NOTEBOOKS.parent)
  paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [os.path.abspath(p) for p in paths if os.path.abspath(p) != root])
  # A notebook's `ray.init()` starts its own cluster: without an address it
  # joins one that `ray start` or `ray.cluster_utils.Cluster` runs on this
  # machine (test_parameter_server_elastic's, in the other pytest worker),
  # where `ray.init(num_cpus=...)` is an error.
  env["RAY_ADDRESS"] = "local"
  manager = AsyncKernelManager(kernel_name="python3")
  run_sync(manager.start_kernel)(env=env, cwd=str(tmp_path_factory.mktemp("kernel")))
  try:
    yield manager, env
  finally:
    run_sync(manager.shutdown_kernel)(now=False)


def _fresh_start(env: dict, directory: pathlib.Path, scratch: bool) -> str:
  """The code run before a notebook's first cell: an empty namespace (a
  name the notebook does not define is a NameError, as in a new kernel),
  the kernel's starting environment (what an earlier notebook set in
  `os.environ` is gone) and the notebook's own working directory. Its
  scratch directories (`tempfile.mkdtemp`: a user keeps them to look at) go
  to the test's own, which pytest removes; not Ray's (`scratch` False): its
  socket paths under a longer temporary directory could pass the 107-byte
  limit of a Unix socket's path."""
  env = dict(env, TMPDIR=str(directory)) if scratch else env
  return (f"%reset -f\nimport os, tempfile\nos.environ.clear()\n"
          f"os.environ.update({env!r})\ntempfile.tempdir = None\n"
          f"os.chdir({str(directory)!r})\ndel os, tempfile")


@pytest.mark.slow
@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, kernel):
  manager, env = kernel
  nb = _with_parameters(nbformat.read(path, as_version=4), path.stem)
  scratch = "import ray" not in path.with_suffix(".py").read_text()
  nb.cells.insert(0, nbformat.v4.new_code_cell(
      _fresh_start(env, tmp_path, scratch)))
  client = NotebookClient(nb, km=manager, timeout=900)
  try:
    # raises CellExecutionError, naming the cell, on any error
    client.execute()
  except BaseException:
    # the next notebook gets a new kernel, not this one's leftovers
    run_sync(manager.restart_kernel)(now=True)
    raise
  finally:
    if client.kc is not None:
      client.kc.stop_channels()
  errors = [o for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"]
  assert not errors
