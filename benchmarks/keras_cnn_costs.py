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

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import provenance  # (benchmarks/provenance.py: which run a section is from)

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


def measure() -> dict:
  """Each way's train step's costs, by worker name."""
  rows = {}
  for which in WORKERS:
    with tempfile.TemporaryDirectory(prefix="jdist-cnn-costs-") as tmp:
      dump(which, tmp)
      rows[which] = costs(train_step(tmp))
  return {"rows": rows}


def section(res: dict) -> list:
  """The RESULTS.md section: the table, and whether the three compute the
  same (the same convolutions and bytes, FLOPs within 1%)."""
  rows = res["rows"]
  lines = [
      "## Keras models in jdist.Trainer: the CNN's compiled train step "
      "(benchmarks/keras_cnn_costs.py)", "",
      provenance.line(res["provenance"]), "",
      "keras_models.py's CNN trained two steps on 2 fake CPU devices each "
      "of the three ways, XLA dumping what it compiles (its default "
      "optimization level); the train step is the optimized program with "
      "convolutions, read by XLA's cost analysis. The figures do not depend "
      "on the machine's load.", "",
      "| trained by | GFLOP per device step | MB accessed | HLO instructions "
      "| convolutions (layouts) |", "|---|---:|---:|---:|---|"]
  for which, c in rows.items():
    lines.append(f"| {WORKERS[which]} | {c['flops'] / 1e9:.3f} | "
                 f"{c['bytes'] / 1e6:.1f} | {c['instructions']} | "
                 f"{c['count']} ({', '.join(c['convolutions'])}) |")
  flops = [c["flops"] for c in rows.values()]
  same = (len({(c["count"], tuple(c["convolutions"]), round(c["bytes"], -5))
               for c in rows.values()}) == 1 and
          max(flops) <= 1.01 * min(flops))
  lines += ["", (
      "The three compute the same: the same convolutions in the same "
      "layouts, the same bytes, FLOPs within 1%. A step of this CNN is its "
      "convolutions, so its speed ratios in the section above measure the "
      "same XLA program, not jdist's host work." if same else
      "The three compiled programs differ (above): their speed ratios "
      "compare different computations.")]
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true",
                      help="also print the result as JSON")
  args = parser.parse_args()
  provenance.report(measure, section, args.json)


if __name__ == "__main__":
  main()
