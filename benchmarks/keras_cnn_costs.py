"""The compiled train step of keras_models.py's CNN, each way it is trained:
XLA's cost analysis (FLOPs, bytes accessed) and its convolutions' layouts.

The three workers of `benchmarks/keras_models.py` (a Keras model in
`jdist.Trainer`, Keras's own `fit` under `keras.distribution.DataParallel`,
the flax model in `jdist.Trainer`) each train the CNN for two steps on 2
fake CPU devices in a process of their own, with XLA dumping the programs
it compiles; the train step is the dumped program with convolutions. The
figures are deterministic: they say whether the three run the same
computation, which a timing on a shared machine cannot.

  python benchmarks/keras_cnn_costs.py
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
WORKERS = {
    "jdist_keras": "jdist Trainer fit, Keras model",
    "keras": "Keras 3 (JAX) DataParallel, fit",
    "jdist_fit": "jdist Trainer fit, flax model",
}

_RUN = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, {peers!r})
import jax, common
devices = jax.devices()[:2]
which = {which!r}
if which == "keras":
  import keras, keras_jax
  keras.distribution.set_distribution(
      keras.distribution.DataParallel(devices=devices))
  trainer = keras_jax.Trainer("cnn", "fit", 1)
else:
  import jdist
  worker = __import__(which)
  trainer = worker.Trainer("cnn", jdist.MirroredStrategy(devices), 1)
trainer.run(2)
"""


def dump(which: str, directory: str) -> None:
  """Trains the CNN two steps with `which`, XLA dumping to `directory`."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                      f"--xla_dump_to={directory} --xla_dump_hlo_as_text",
         "PYTHONPATH": os.pathsep.join(
             [str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
  code = _RUN.format(peers=str(HERE / "peers"), which=which)
  subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env,
                 check=True, timeout=1800, capture_output=True)


def train_step(directory: str) -> str:
  """The optimized HLO text of the dumped train step (the largest program
  with a convolution)."""
  found = [p for p in pathlib.Path(directory).glob(
      "*after_optimizations.txt") if "convolution(" in p.read_text()]
  return max(found, key=lambda p: p.stat().st_size).read_text()


def costs(text: str) -> dict:
  """XLA's cost analysis of an HLO module's text, and what it is made of.

  Reads the module with jaxlib's HLO parser and cost analysis (private
  jaxlib entry points: the public `Compiled.cost_analysis()` needs the
  program compiled in this process).
  """
  import jax
  from jax._src.lib import _jax
  from jaxlib import _hlo
  module = _hlo.hlo_module_from_text(text)
  analysis = _jax.hlo_module_cost_analysis(jax.devices()[0].client, module)
  convolutions = re.findall(r"dim_labels=([\w>-]+)", text)
  return {"flops": analysis.get("flops", 0.0),
          "bytes": analysis.get("bytes accessed", 0.0),
          "instructions": len(re.findall(r"^\s+%\S+ = ", text, re.M)),
          "convolutions": sorted(set(convolutions)),
          "count": len(convolutions)}


def main() -> None:
  rows = {}
  for which in WORKERS:
    with tempfile.TemporaryDirectory(prefix="jdist-cnn-costs-") as tmp:
      dump(which, tmp)
      rows[which] = costs(train_step(tmp))
  print("| trained by | GFLOP per device step | MB accessed | HLO "
        "instructions | convolutions (layouts) |")
  print("|---|---:|---:|---:|---|")
  for which, c in rows.items():
    print(f"| {WORKERS[which]} | {c['flops'] / 1e9:.3f} | "
          f"{c['bytes'] / 1e6:.1f} | {c['instructions']} | {c['count']} "
          f"({', '.join(c['convolutions'])}) |")


if __name__ == "__main__":
  main()
