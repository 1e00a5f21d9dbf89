"""The README's complete programs run as printed (issue 9.12): the first
example (flax linen with flax's TrainState), the flax nnx custom loop, the
parameter-server loop and the sharded optimizer state's example."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import xla_flags

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _run(code: str, tmp_path) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(4))
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_the_first_example_is_a_whole_program(tmp_path):
  first = _blocks()[0]
  assert "train_state.TrainState.create" in first
  losses = [float(line.split()[1]) for line in _run(first, tmp_path).splitlines()]
  assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.slow
def test_the_nnx_recipe_trains_and_evaluates(tmp_path):
  recipe, = [b for b in _blocks() if "nnx.split((model, optimizer))" in b]
  out = _run(recipe, tmp_path)
  accuracy = float(re.search(r"test accuracy: (\S+)", out).group(1))
  assert accuracy > 0.9
  assert out.count("epoch ") == 3


def test_the_parameter_server_example_trains_and_stops(tmp_path):
  program, = [b for b in _blocks() if "ClusterCoordinator(strategy)" in b]
  out = _run(program, tmp_path)
  first, last = map(float, re.search(r"loss (\S+) -> (\S+);", out).groups())
  assert last < first
  assert "updates per server {0: 200}" in out


def test_the_sharded_optimizer_example_keeps_a_quarter_of_adams_state(tmp_path):
  example, = [b for b in _blocks() if "jdist.ShardedOptimizer(" in b]
  out = _run(example, tmp_path)
  state_bytes = int(out.split("adam state on one device:")[1])
  assert state_bytes == 602_196  # README: 0.250x of mirrored's 2,408,532


def test_the_partition_metadata_example_trains_split_without_a_layout_map(
    tmp_path):
  example, = [b for b in _blocks()
              if "ModelParallelStrategy(device_mesh=mesh)" in b]
  spec, losses = _run(example, tmp_path).splitlines()
  assert spec == "P(None, 'model') (32, 32)"  # README: what it prints
  losses = [float(v) for v in losses.split()[1:]]
  assert len(losses) == 3 and losses[-1] < losses[0]
