"""Every tutorial notebook runs top to bottom on fake CPU devices.

The notebooks are kept as jupytext pairs: `notebooks/NN_name.py` (percent
format, the one to edit) and `notebooks/NN_name.ipynb` (outputs stripped, the
one to open in Jupyter or Colab). This checks that each pair agrees and then
executes the .ipynb in a fresh kernel.
"""

import os
import pathlib

import pytest

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
  # The kernel compiles at the suite's level 0 (conftest.py's XLA_FLAGS):
  # with the parameters above every notebook spends more of its time
  # compiling than running steps (the kernel's CPU seconds at the default
  # level -> level 0, runs alternating on the loaded machine: 01 26-27 ->
  # 18-22, 02 19-26 -> 14-17, 05 23-31 -> 17-23, 03 17-20 -> 16-20; 06 was
  # at level 0 already).
  env = dict(os.environ)
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
