"""Processes that read different global batches are stopped, naming the
batch (issue 19.3): 2 real processes x 2 fake CPU devices each.

With `experimental_distribute_dataset` every process reads the whole global
batch and keeps its replicas' rows; if the processes read different batches
(an unseeded shuffle), the replicas train on some examples twice and on
others never. The processes compare a fingerprint of each batch through the
runtime's key-value store, as they compare their step counts.
"""

import os
import re
import sys

import numpy as np
import pytest

import harness

pytestmark = pytest.mark.multiprocess

WORKER = os.path.join(harness.HERE, "input_worker.py")
# Generous: starting two JAX processes takes ~10 s on this 2-core machine,
# more when it is busy. Nothing waits on a timer: the processes meet at the
# input agreement's rendezvous.
RUN_TIMEOUT = 240


def run(mode, out_dir):
  port = harness.free_port()
  jobs = [([sys.executable, WORKER, mode, str(out_dir)], harness.base_env(
      2, JDIST_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JDIST_NUM_PROCESSES=2,
      JDIST_PROCESS_ID=rank)) for rank in (0, 1)]
  return harness.run_processes(jobs, timeout=RUN_TIMEOUT)


def expected_sums(seed, epoch):
  """Per global batch, the sum and sum of squares of its example ids, in the
  order the seeded shuffle gives that epoch (numpy, one process)."""
  order = np.random.default_rng([seed, epoch]).permutation(1000)
  return np.array([[b.sum(), (b.astype(np.float64) ** 2).sum()]
                   for b in np.split(order, range(64, 1000, 64))])


def test_processes_reading_the_same_batches_run_every_step(tmp_path):
  results = run("same_order", tmp_path)
  for rank, r in enumerate(results):
    assert r.returncode == 0, f"process {rank}:\n{r.output[-5000:]}"
  p0, p1 = (np.load(tmp_path / f"same_order-{i}.npz") for i in (0, 1))
  np.testing.assert_array_equal(p0["sums"], p1["sums"])
  for epoch in (0, 1):  # every example once per epoch, in the epoch's order
    np.testing.assert_allclose(p0["sums"][epoch], expected_sums(5, epoch),
                               rtol=1e-6)
  # element_spec: one replica's rows of a global batch of 64 over 4 replicas,
  # as the step receives them (the host's int64 labels are int32 in JAX).
  assert p0["spec"].tolist() == p1["spec"].tolist() == ["(16,)", "int32"]


def test_processes_reading_different_batches_are_stopped(tmp_path):
  results = run("different_order", tmp_path)
  for rank, r in enumerate(results):
    assert r.returncode not in (0, None), f"process {rank}:\n{r.output[-5000:]}"
    assert "ran to the end" not in r.stdout
    # One label differs in batch 11: found at the second window (batches 8
    # to 15), after the 8 agreed steps ran.
    assert re.search(
        r"caught after 8 steps: The processes read different global batches: "
        r"batch 11 \(counting from 0\) of pass 1 over dataset "
        r"global/auto/OneLabelDiffers differs between processes \(fingerprints "
        r"of its rows: process 0: [0-9a-f]{8}; process 1: [0-9a-f]{8}\)",
        r.stdout), f"process {rank}:\n{r.output[-5000:]}"
  # The unseeded shuffle: stopped before the first step, on every process.
  told = [re.search(r"DistributionError: The processes read different global "
                    r"batches: batch 0 \(counting from 0\) of pass 1 over "
                    r"dataset global/auto/Shuffled .*same seed on every "
                    r"process", r.stderr) for r in results]
  assert all(told), "\n\n".join(r.stderr[-3000:] for r in results)
