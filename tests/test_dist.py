"""The built wheel works on its own: `make dist`'s wheel, installed (not
editable) into a fresh venv by the notebooks' own setup cell, as on a fresh
Colab runtime, trains a model on 4 devices exactly as on one, with the
examples' data. Nothing is downloaded: the venv sees the test environment's
dependencies through a path file, and pip runs without an index. (The
notebooks and the demo themselves run from the source in test_notebooks.py and
test_demo.py; every notebook has the same setup cell, checked below.)
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _setup_block(path: pathlib.Path) -> str:
  text = path.read_text()
  start = text.index("# Setup:")
  return text[start:text.index("import jax\n", start)]


def test_every_notebook_installs_jdist_the_same_way():
  blocks = {p.name: _setup_block(p) for p in NOTEBOOKS}
  assert len(set(blocks.values())) == 1, "the notebooks' setup cells differ"
  block = next(iter(blocks.values()))
  assert "jdist-*.whl" in block and "JDIST_SOURCE" in block
  assert "pip" in block and "google.colab" not in block


def _build_wheel(out: pathlib.Path) -> pathlib.Path:
  src = out / "src"
  shutil.copytree(ROOT / "jdist", src / "jdist",
                  ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(ROOT / name, src / name)
  subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel",
                  "--outdir", str(out), str(src)], check=True,
                 capture_output=True, timeout=300)
  wheel, = out.glob("jdist-*.whl")
  return wheel


def _fresh_venv(where: pathlib.Path) -> pathlib.Path:
  # Without a pip of its own (ensurepip: 4 s of CPU): the setup cell's
  # `python -m pip` is the test environment's, found through the path file
  # below, and installs into the running interpreter's prefix, the venv.
  venv.EnvBuilder(with_pip=False).create(where)
  python = where / "bin" / "python"
  site = subprocess.run([str(python), "-c", "import sysconfig; print("
                         "sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True).stdout.strip()
  ours = [p for p in sys.path if p.endswith("site-packages")]
  # The dependencies only (jax, flax, pip, ...): a plain path line does not run
  # the .pth files there, so an editable jdist of this checkout stays out.
  pathlib.Path(site, "_test_dependencies.pth").write_text("\n".join(ours))
  return python


# Run after the notebooks' setup cell, in the kernel of the fresh venv.
_FIRST_PROGRAM = """
import jdist.examples.data
x, y = jdist.examples.data.load_digits(image=False)
x, y = x[:256], y[:256]

def train(strategy):
  w = jnp.zeros((64, 10))
  @strategy.function
  def step(w, batch):
    def loss_fn(w):
      logits = batch["x"] @ w
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
    return w - 0.5 * jax.grad(loss_fn)(w)  # summed over replicas already
  batches = [{"x": x[i:i + 64], "y": y[i:i + 64]} for i in range(0, 256, 64)]
  for batch in strategy.experimental_distribute_dataset(batches):
    w = step(w, batch)
  return np.asarray(w)

four = train(jdist.MirroredStrategy())
one = train(jdist.OneDeviceStrategy(jax.devices()[0]))
assert jdist.MirroredStrategy().num_replicas_in_sync == 4
assert np.abs(four).max() > 0.01 and np.allclose(four, one, atol=1e-6)
print("wheel program ok:", jdist.__file__)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_wheel_installs_from_the_setup_cell_and_trains(tmp_path):
  nbformat = pytest.importorskip("nbformat")
  from nbclient import NotebookClient

  wheel = _build_wheel(tmp_path / "dist")
  with zipfile.ZipFile(wheel) as built:  # what type checkers read of jdist
    assert {"jdist/py.typed", "jdist/__init__.pyi"} <= set(built.namelist())
  python = _fresh_venv(tmp_path / "venv")
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  shutil.copy(wheel, run_dir)  # as if uploaded to a Colab runtime
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
             MPLBACKEND="Agg", JAX_PLATFORMS="cpu")
  probe = [str(python), "-c", "import jdist"]
  assert subprocess.run(probe, env=env, cwd=run_dir).returncode != 0

  # A kernel on the fresh venv; the notebook's setup cell installs the wheel.
  kernels = tmp_path / "jupyter" / "kernels" / "wheel"
  kernels.mkdir(parents=True)
  (kernels / "kernel.json").write_text(json.dumps({
      "argv": [str(python), "-m", "ipykernel_launcher", "-f",
               "{connection_file}"],
      "display_name": "jdist wheel", "language": "python", "env": env}))
  notebook = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_code_cell(_setup_block(NOTEBOOKS[0]) + "import jax\n"
                                "jax.config.update('jax_num_cpu_devices', 4)\n"
                                "import jax.numpy as jnp, numpy as np, optax, "
                                "jdist\n"),
      nbformat.v4.new_code_cell(_FIRST_PROGRAM)])
  # The kernel inherits this process's environment: no path to this checkout.
  old = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "PYTHONPATH")}
  os.environ["JUPYTER_PATH"] = str(tmp_path / "jupyter")
  os.environ.pop("PYTHONPATH", None)
  try:
    NotebookClient(notebook, timeout=900, kernel_name="wheel",
                   resources={"metadata": {"path": str(run_dir)}}).execute()
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  assert not [o for c in notebook.cells for o in c.outputs
              if o.output_type == "error"]
  printed = "".join(o.get("text", "") for o in notebook.cells[-1].outputs)
  where = re.search(r"wheel program ok: (\S+)", printed).group(1)
  assert where.startswith(str(tmp_path / "venv")), where  # the wheel's copy
  nbformat.validate(notebook)
