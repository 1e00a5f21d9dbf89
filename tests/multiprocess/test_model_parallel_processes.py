"""Model parallelism over many hosts (issue 21): 2 real processes x 2 fake
CPU devices train a small MLP (Megatron's column then row split) on a 2x2
data x model mesh as one process with 4 devices does, and as one device
does; and a pipeline whose 2 stages are the 2 processes.

`jdist launch -n 2 --devices-per-process 2 model_parallel_job.py` trains in a
custom loop (`strategy.init`, `strategy.function`,
`experimental_distribute_dataset`) with the mesh jdist lays out (the data
axis across the processes, the model axis inside each), then with the mesh
laid out the other way by hand. Each process writes the shards it holds;
this test checks that they are its own devices' shards only, split as the
layout says, and rebuilds the arrays from both processes' shards.

The same pipeline as an elastic job (elastic_pipeline_job.py, under
`jdist launch --nnodes 2 --max-restarts 1`): a stage's process is killed
after a checkpoint, the launcher restarts the job, and it resumes and ends
where one device ends.
"""

import functools
import os
import pickle
import re

import jax
import numpy as np
import pytest

import harness
import jdist
import model_parallel_train as train_lib

pytestmark = pytest.mark.multiprocess

JOB = os.path.join(harness.HERE, "model_parallel_job.py")
ELASTIC_JOB = os.path.join(harness.HERE, "elastic_pipeline_job.py")
RUN_TIMEOUT = 240  # two JAX processes on 2 busy cores; nothing waits on it
TOL = 1e-6  # float32: the split matmuls and the gradient sums run in another order


@functools.cache
def in_one_process(case: str, pipeline: bool = False):
  """(params, momentum, losses) on 4 devices of this process, or on one."""
  devices = jax.local_devices()
  layout = train_lib.strategy_pipeline if pipeline else train_lib.strategy_2x2
  strategy = (jdist.OneDeviceStrategy(devices[0]) if case == "one_device"
              else layout(devices[:4]))
  params, opt_state, losses = train_lib.train(strategy, pipeline)
  return jax.device_get(params), jax.device_get(opt_state), losses


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  out = tmp_path_factory.mktemp("model_parallel")
  r = harness.run_launcher(["-n", 2, "--devices-per-process", 2, JOB, out],
                           timeout=RUN_TIMEOUT)
  assert r.returncode == 0, r.output[-5000:]
  records = {}
  for layout in ("auto", "by_hand", "pipeline"):
    for rank in (0, 1):
      with open(out / f"{layout}-{rank}.pkl", "rb") as f:
        records[layout, rank] = pickle.load(f)
  return records


def rebuild(parts, like):
  """The whole array from the (device, index, data) shards of both processes,
  checking that shards of the same block agree."""
  whole = np.full(np.shape(like), np.nan, np.float32)
  for _, index, data in parts:
    block = tuple(slice(*i) for i in index)
    seen = whole[block]
    assert np.all(np.isnan(seen) | (seen == data))
    whole[block] = data
  assert not np.isnan(whole).any()
  return whole


def check_held(records, layout, tree, key):
  """Every process holds its own devices' shards only, of the sizes the
  layout gives; rebuilt, the arrays are the one-process run's."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  for rank in (0, 1):
    held = records[layout, rank][key]
    assert set(held) == {jax.tree_util.keystr(p) for p, _ in flat}
    for name, parts in held.items():
      assert sorted(d for d, _, _ in parts) == records[layout, rank]["local"]
  for path, want in flat:
    name = jax.tree_util.keystr(path)
    parts = records[layout, 0][key][name] + records[layout, 1][key][name]
    np.testing.assert_allclose(rebuild(parts, want), want, rtol=0, atol=TOL,
                               err_msg=f"{layout} {key} {name}")


@pytest.mark.parametrize("layout", ["auto", "by_hand", "pipeline"])
def test_two_processes_train_as_one_process_and_one_device(launched, layout):
  pipeline = layout == "pipeline"
  params, momentum, losses = in_one_process("four_devices", pipeline)
  one_params, _, one_losses = in_one_process("one_device", pipeline)
  for rank in (0, 1):
    np.testing.assert_allclose(launched[layout, rank]["losses"], losses,
                               rtol=0, atol=TOL)
  np.testing.assert_allclose(losses, one_losses, rtol=0, atol=TOL)
  check_held(launched, layout, params, "params")
  check_held(launched, layout, momentum, "momentum")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=TOL),
               params, one_params)


def test_the_data_axis_crosses_the_processes_unless_laid_out_by_hand(launched):
  for rank in (0, 1):
    local = launched["auto", rank]["local"]
    mesh = launched["auto", rank]["mesh"]
    assert sorted(mesh[rank]) == local  # a replica inside one process
    by_hand = launched["by_hand", rank]["mesh"]
    assert sorted(row[rank] for row in by_hand) == local
  # The model axis splits a kernel in two: each device holds half of it,
  # each process both halves (auto) or the half of both replicas (by hand).
  name = "['Dense_0']['kernel']"
  for layout in ("auto", "by_hand"):
    for rank in (0, 1):
      parts = launched[layout, rank]["params"][name]
      assert [d.shape for _, _, d in parts] == [(8, 8)] * 2
      halves = {index[1] for _, index, _ in parts}
      assert len(halves) == (2 if layout == "auto" else 1)
  # The pipeline's stages are the processes: each holds its stage's two
  # layers (on both of its replicas' devices), the other process the rest.
  held = [{index[0] for _, index, _ in
           launched["pipeline", rank]["params"]["['layers']['kernel']"]}
          for rank in (0, 1)]
  assert held == [{(0, 2)}, {(2, 4)}], held


def test_a_pipeline_across_processes_resumes_under_the_elastic_launcher(
    tmp_path):
  """Process 1 (the second stage: layers 2 and 3) SIGKILLs itself after its
  second step and the checkpoint of it; the launcher restarts the job on its
  2 processes, which restore the checkpoint into their stages and train
  steps 2 and 3. Losses and final parameters and momentum are one device's."""
  r = harness.run_launcher(["--nnodes", 2, "--max-restarts", 1,
                            "--devices-per-process", 2, ELASTIC_JOB,
                            tmp_path, "0:1:1:kill"], timeout=RUN_TIMEOUT)
  assert r.returncode == 0, r.output[-5000:]
  assert ("jdist launch: attempt 0: process 1 of 2 failed (killed by SIGKILL); "
          "restarting the job (restart 1 of at most 1)." in r.stderr), r.stderr
  assert "jdist launch: the job completed after 1 restart" in r.stderr
  resumed = re.findall(r"^\[(\d)\] resumed (\d+) attempt=(\d) pid=(\d+)$",
                       r.stdout, re.M)
  assert sorted(found[:3] for found in resumed) == [
      ("0", "0", "0"), ("0", "2", "1"), ("1", "0", "0"), ("1", "2", "1")
  ], r.stdout
  assert harness.wait_gone([int(found[3]) for found in resumed], 5) == []
  params, momentum, losses = in_one_process("one_device", pipeline=True)
  seen = [(int(rank), int(i), float(value)) for rank, i, value in re.findall(
      r"^\[(\d)\] loss (\d+) (\S+)$", r.stdout, re.M)]
  for rank in (0, 1):  # steps 0, 1 in attempt 0; 2, 3 in attempt 1
    assert {i for k, i, _ in seen if k == rank} == {0, 1, 2, 3}, r.stdout
  for _, i, value in seen:
    np.testing.assert_allclose(value, losses[i], rtol=0, atol=TOL)
  with np.load(tmp_path / "final.npz") as z:
    assert int(z["attempt"]) == 1
    want = jax.tree_util.tree_flatten_with_path((params, momentum))[0]
    assert set(z.files) == {"attempt"} | {jax.tree_util.keystr(p)
                                          for p, _ in want}
    for path, x in want:
      name = jax.tree_util.keystr(path)
      np.testing.assert_allclose(z[name], x, rtol=0, atol=TOL, err_msg=name)
