"""Every tutorial notebook runs top to bottom on fake CPU devices.

The notebooks are kept as jupytext pairs: `notebooks/NN_name.py` (percent
format, the one to edit) and `notebooks/NN_name.ipynb` (outputs stripped, the
one to open in Jupyter or Colab). This checks that each pair agrees and then
executes the .ipynb in a fresh kernel.
"""

import os
import pathlib

import pytest

from conftest import TEST_XLA_FLAGS

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")
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
# hold (01: fit on all devices equals fit on one, at every epoch).
PARAMETERS = {"01_mirrored_quickstart":
              "EPOCHS, SIZES, TIMED_STEPS = 3, [64, 256], 2",
              "05_parameter_servers": "STEPS = 200"}


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


# Notebooks that spend their time compiling, run at the suite's level 0.
COMPILE_BOUND = {"06_model_parallel"}


@pytest.mark.slow
@pytest.mark.parametrize("path", PAIRS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
  nb = _with_parameters(nbformat.read(path, as_version=4), path.stem)
  env_dir = tmp_path / "run"
  env_dir.mkdir()
  os.environ.setdefault("MPLBACKEND", "Agg")
  # The kernel runs in a scratch directory: let it import this checkout's jdist
  # even when it is not installed (an installed jdist works the same).
  root = str(NOTEBOOKS.parent)
  paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [root] + [os.path.abspath(p) for p in paths if os.path.abspath(p) != root])
  client = NotebookClient(nb, timeout=900, kernel_name="python3",
                          resources={"metadata": {"path": str(env_dir)}})
  # The kernel compiles at XLA's default level, as the notebooks' users do:
  # most train for epochs, and at the suite's level 0 (conftest.py) their
  # steps ran slower than they compiled faster (notebook 01: 27 -> 49 s in
  # the suite). Notebook 06 compiles a GPT's steps on four meshes and runs a
  # few: level 0 takes it from 25 s to 8 s.
  env = dict(os.environ)
  if path.stem not in COMPILE_BOUND:
    env["XLA_FLAGS"] = " ".join(f for f in os.environ["XLA_FLAGS"].split()
                                if f not in TEST_XLA_FLAGS.split())
  # A notebook's `ray.init()` starts its own cluster: without an address it
  # joins one that `ray start` or `ray.cluster_utils.Cluster` runs on this
  # machine (test_parameter_server_elastic's, in the other pytest worker),
  # where `ray.init(num_cpus=...)` is an error.
  env["RAY_ADDRESS"] = "local"
  # The notebooks' scratch directories (`tempfile.mkdtemp`: a user keeps
  # them to look at) go to the test's own, which pytest removes. Not Ray's:
  # its socket paths under a longer temporary directory could pass the
  # 107-byte limit of a Unix socket's path.
  if "import ray" not in path.with_suffix(".py").read_text():
    env["TMPDIR"] = str(tmp_path)
  # raises CellExecutionError, naming the cell, on any error
  client.execute(env=env)
  errors = [o for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if o.output_type == "error"]
  assert not errors
