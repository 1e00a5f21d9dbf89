"""Real multi-process runs on 127.0.0.1: 2 processes x 2 fake CPU devices.

Each test starts processes of `worker.py` (directly, or through `jdist
launch`), each with a timeout, and checks what a user would see: the trained
parameters, or how and how fast every process ends when something goes wrong.
Run them one at a time (pytest does): CPU collectives abort under heavy load.
"""

import os
import re
import signal
import socket
import time

import jax
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.data import batches
from jdist.examples.models import MLP
from test_conformance import classifier_step, make_state

import harness

pytestmark = pytest.mark.multiprocess

# Generous: this 2-core machine needs ~10 s just to start two JAX processes.
RUN_TIMEOUT = 120


def params_of(npz) -> dict:
  return {k: npz[k] for k in npz.files if k.startswith("[")}


def assert_all_failed(results, pattern, *, within):
  for rank, r in enumerate(results):
    assert r.returncode not in (0, None), f"process {rank}:\n{r.output[-3000:]}"
    assert r.seconds < within, f"process {rank} took {r.seconds:.1f} s"
  for rank, r in enumerate(results):
    assert re.search(pattern, r.stderr), f"process {rank}:\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The directory of the trainings' results (worker.py's `train_all`: each
  training of the four tests below, one after the other, in one job of
  `jdist launch -n 2 --devices-per-process 2`)."""
  out = tmp_path_factory.mktemp("trained")
  r = harness.run_launcher(["-n", 2, "--devices-per-process", 2, harness.WORKER,
                            "train_all", out], timeout=RUN_TIMEOUT)
  assert r.returncode == 0, r.output[-5000:]
  assert "[0] " in r.stdout and "[1] " in r.stdout
  return out


def test_training_matches_one_device(trained, digits_flat):
  """The conformance training via `jdist launch -n 2 --devices-per-process 2`
  ends where one device does."""
  assert_trained_like_one_device(trained, "train_global", digits_flat)


def one_device():
  return jdist.OneDeviceStrategy(jax.local_devices()[0])


def assert_trained_like_one_device(tmp_path, mode, digits_flat):
  p0, p1 = (np.load(tmp_path / f"{mode}-{i}.npz") for i in (0, 1))
  # strategy.reduce gives bit-identical results on every process.
  np.testing.assert_array_equal(p0["losses"], p1["losses"])
  x, y = digits_flat
  data = batches(x[:1280], y[:1280], 64)
  local = jdist.testing.run_training(one_device(), classifier_step,
                                     make_state(MLP(), data[0]["x"]), data)
  expected = {jax.tree_util.keystr(p): v for p, v in
              jax.tree_util.tree_flatten_with_path(local.state.params)[0]}
  problems = jdist.testing.compare_trees(expected, params_of(p0), rtol=1e-5,
                                         atol=1e-6, names=("1 device", "2x2"))
  assert not problems, "\n".join(problems)
  np.testing.assert_allclose([o["loss"] for o in local.outputs], p0["losses"],
                             rtol=1e-5)
  for k, v in params_of(p0).items():
    np.testing.assert_array_equal(v, p1[k])


def test_replicas_alternating_between_processes_train_alike(trained,
                                                            digits_flat):
  """A TPU pod's ring may alternate hosts: each process feeds replicas that
  are not contiguous (0 and 2, 1 and 3), and the result is unchanged."""
  assert_trained_like_one_device(trained, "train_interleaved", digits_flat)


def test_sharded_optimizer_state_across_processes(trained, digits_flat):
  """ZeRO-2 over 2 processes x 2 devices: each device keeps a quarter of
  adam's state, and training equals adam on one device (its moments too:
  adam's update alone would hide a gradient of the wrong scale)."""
  from test_sharded_optimizer import _train
  p0, p1 = (np.load(trained / f"train_sharded-{i}.npz") for i in (0, 1))
  assert p0["mu_blocks"].tolist() == [[16, 32]] * 2  # this process's 2 blocks
  x, y = digits_flat
  data = batches(x[:1280], y[:1280], 64)[:10]
  state, losses, _ = _train(one_device(), optax.adam(1e-2), data,
                            own_grads=False)
  expected = {jax.tree_util.keystr(p): v for p, v in
              jax.tree_util.tree_flatten_with_path(
                  jax.device_get(state.params))[0]}
  problems = jdist.testing.compare_trees(expected, params_of(p0), rtol=1e-5,
                                         atol=1e-6, names=("1 device", "2x2"))
  assert not problems, "\n".join(problems)
  moments = {"mu" + jax.tree_util.keystr(p): v for p, v in
             jax.tree_util.tree_flatten_with_path(
                 jax.device_get(state.opt_state[0].mu))[0]}
  problems = jdist.testing.compare_trees(
      moments, {k: p0[k] for k in p0.files if k.startswith("mu[")},
      rtol=1e-5, atol=1e-8, names=("1 device", "2x2"))
  assert not problems, "\n".join(problems)
  np.testing.assert_allclose(p0["losses"], losses, rtol=1e-5)
  for k, v in params_of(p0).items():
    np.testing.assert_array_equal(v, p1[k])


def test_per_process_inputs_that_end_at_different_steps(trained, digits_flat):
  """Process 0 has 400 examples, process 1 160: 13 steps on both, none lost."""
  p0, p1 = (np.load(trained / f"train_per_process-{i}.npz") for i in (0, 1))
  assert int(p0["steps"]) == int(p1["steps"]) == 13
  assert int(p0["seen"]) == int(p1["seen"]) == 560
  # The same per-replica batches in one process: step j takes process 0's
  # batches 2j, 2j+1 and process 1's (empty once its data has ended).
  x, y = digits_flat
  own = {0: batches(x[:400], y[:400], 16), 1: batches(x[400:560], y[400:560], 16)}
  empty = {"x": x[:0], "y": y[:0]}
  stream = [own[p][i] if i < len(own[p]) else empty
            for j in range(13) for p in (0, 1) for i in (2 * j, 2 * j + 1)]
  strategy = jdist.MirroredStrategy()
  step = strategy.function(classifier_step)
  state = strategy.replicate(make_state(MLP(), x[:16]))
  for batch in strategy.distribute_datasets_from_function(lambda ctx: stream):
    state, _ = step(state, batch)
  expected = {jax.tree_util.keystr(p): np.asarray(v) for p, v in
              jax.tree_util.tree_flatten_with_path(state.params)[0]}
  problems = jdist.testing.compare_trees(expected, params_of(p0), rtol=1e-5,
                                         atol=1e-6, names=("1 process", "2x2"))
  assert not problems, "\n".join(problems)


def test_a_mismatched_program_fails_on_every_process(tmp_path):
  """Process 1 uses another learning rate; both raise before any collective."""
  results = harness.run_workers("mismatch", tmp_path, timeout=RUN_TIMEOUT)
  assert_all_failed(results, r"jdist.ProgramMismatchError: The processes compiled "
                    r"different programs for classifier_step .*processes \[1\] "
                    r"differ from process 0\. The inputs agree; the computation "
                    r"differs", within=RUN_TIMEOUT)
  assert all("ran to the end" not in r.stdout for r in results)


def test_a_peer_failure_during_a_rendezvous_is_raised_where_it_can_be_caught(
    tmp_path):
  """Process 1 fails while process 0 waits for it outside XLA."""
  results = harness.run_workers("peer_fails_at_rendezvous", tmp_path,
                                timeout=RUN_TIMEOUT)
  assert_all_failed(results, r"boom before the first batch", within=RUN_TIMEOUT)
  assert ("caught jdist.PeerFailureError: process 1 failed with RuntimeError: "
          "boom before the first batch") in results[0].stdout, results[0].output


def test_a_rendezvous_timeout_is_raised_where_it_can_be_caught(tmp_path):
  """With timeout_seconds=3, process 1 comes 20 s late to the input agreement."""
  results = harness.run_workers("late_at_rendezvous", tmp_path,
                                timeout=RUN_TIMEOUT, WORKER_TIMEOUT=3)
  assert_all_failed(results, r"CollectiveTimeoutError", within=RUN_TIMEOUT)
  assert re.search(r"caught jdist.CollectiveTimeoutError: Processes \[1\] did "
                   r"not reach the input agreement of dataset .* within 3 s",
                   results[0].stdout), results[0].output
  # Process 1, still asleep, learns of it from the monitor and stops too.
  assert "jdist.PeerFailureError: process 0 stopped: jdist." \
         "CollectiveTimeoutError" in results[1].stderr, results[1].output
  assert results[1].seconds < 15


def test_an_exception_in_one_process_stops_the_other_at_once(tmp_path):
  results = harness.run_workers("crash", tmp_path, timeout=RUN_TIMEOUT)
  assert_all_failed(results, r"RuntimeError: boom in process 1|process 1 failed",
                    within=RUN_TIMEOUT)
  assert "jdist.PeerFailureError: process 1 failed with RuntimeError: boom in " \
         "process 1" in results[0].stderr
  assert abs(results[0].seconds - results[1].seconds) < 5


def test_a_killed_process_is_named_by_the_others(tmp_path):
  results = harness.run_workers("kill", tmp_path, timeout=RUN_TIMEOUT)
  assert results[1].returncode == -9
  survivor = results[0]
  named_by_jdist = ("jdist.PeerFailureError: process 1 has stopped responding"
                    in survivor.stderr)
  # When gloo does not notice (killed while waiting rather than in a
  # collective, or a loaded machine), JAX's heartbeat (10 s with
  # jdist.initialize) names the task and aborts the process (SIGABRT).
  named_by_jax = "unhealthy (stopped sending heartbeats):\n1" in survivor.stderr
  assert named_by_jdist or named_by_jax, survivor.stderr[-3000:]
  want = 1 if named_by_jdist else -signal.SIGABRT
  assert survivor.returncode == want, survivor.output[-3000:]
  assert survivor.seconds - results[1].seconds < 15


def test_a_killed_coordinator_ends_the_others_at_once(tmp_path):
  """Process 0 hosts the coordination service: JAX itself ends the others."""
  results = harness.run_workers("kill", tmp_path, timeout=RUN_TIMEOUT,
                                WORKER_VICTIM=0)
  assert results[0].returncode == -9
  survivor = results[1]
  assert survivor.returncode not in (0, None), survivor.output[-3000:]
  assert "the leader task was preempted/died" in survivor.stderr
  assert survivor.seconds - results[0].seconds < 10


def test_a_stuck_process_times_out_with_its_name(tmp_path):
  """timeout_seconds=5; process 1 sleeps in its loop before step 4.

  The timeout also bounds the first input agreement, which a process reaches
  only after importing JAX and building its dataset: 3 s was too short for
  that on a loaded machine (the slower process timed out there, not at step 4).
  """
  results = harness.run_workers("stuck", tmp_path, timeout=RUN_TIMEOUT,
                                WORKER_TIMEOUT=5)
  waiting, stuck = results
  assert_all_failed(results, r"jdist\.", within=RUN_TIMEOUT)
  assert ("jdist.CollectiveTimeoutError: step 4 (classifier_step) did not "
          "complete within timeout_seconds=5 on process 0. Not started there: "
          "process 1 (dispatched 3 steps)") in waiting.stderr, waiting.stderr
  assert "jdist.PeerFailureError: process 0 stopped: jdist.CollectiveTimeout" \
         in stuck.stderr
  assert stuck.seconds < 30  # it was asleep for 60 s: ended by its monitor


def test_processes_that_run_different_numbers_of_steps(tmp_path):
  """Process 1 breaks out of its loop after 5 steps; process 0 is told why."""
  results = harness.run_workers("early_exit", tmp_path, timeout=RUN_TIMEOUT)
  assert_all_failed(results, r"jdist\.", within=RUN_TIMEOUT)
  assert ("waits in step 6 (classifier_step), but process 1 (after 5 steps) "
          "already reached the end of its program") in results[0].stderr


@pytest.mark.parametrize("evaluation, where", [
    ("dataset", r"the input agreement of dataset global/auto/list \(iterator 2, "
                r"window 1\)"),
    ("new_step", r"the program check of evaluate_step \(compilation 2 of this "
                 r"run\)"),
])
def test_processes_that_take_different_paths_fail_within_seconds(
    tmp_path, evaluation, where):
  """Process 1 leaves training after 5 steps to evaluate; process 0 is in step 6.

  No timeout_seconds: before, both waited 600 s in silence.
  """
  results = harness.run_workers(f"leaves_training_early_{evaluation}", tmp_path,
                                timeout=60)
  assert_all_failed(results, r"jdist\.", within=60)
  both = (r"The processes took different paths and can never meet: process 0 "
          r"waits in step 6 \(classifier_step\), which process 1 never started "
          rf"\(it dispatched 5 steps\); process 1 waits in {where}, which "
          r"process 0 has not reached\.")
  # Process 1 waits in a rendezvous: it raises there, where it can be caught;
  # process 0 is ended by its monitor, with its own finding or process 1's.
  assert re.search(r"jdist.CollectiveTimeoutError: " + both,
                   results[1].stderr), results[1].stderr[-3000:]
  assert re.search(both, results[0].stderr), results[0].stderr[-3000:]
  diverged = float(re.search(r"process 1 evaluates at ([\d.]+)",
                             results[1].stdout).group(1))
  for r in results:
    assert r.ended - diverged < 8, f"{r.ended - diverged:.1f} s after diverging"
    assert "ran to the end" not in r.stdout


def test_global_datasets_of_different_lengths(tmp_path):
  results = harness.run_workers("uneven_global", tmp_path, timeout=RUN_TIMEOUT)
  assert_all_failed(results, r"jdist.DistributionError: experimental_distribute_"
                    r"dataset needs the same global batches on every process",
                    within=RUN_TIMEOUT)


@pytest.mark.parametrize("alone, message", [
    (1, r"jdist.ClusterError: Process 1 of 2 could not reach the coordinator at "
        r"127\.0\.0\.1:\d+ within 3 s"),
    (0, r"jdist.ClusterError: process 0 of 2 waited 3 s at the coordinator "
        r"127\.0\.0\.1:\d+ for all 2 processes to join"),
])
def test_a_missing_process_at_startup(tmp_path, alone, message):
  """Process 1 without a coordinator, or the coordinator without process 1."""
  (r,) = harness.run_workers("no_coordinator", tmp_path, timeout=60, only=[alone])
  assert r.returncode == 1, r.output[-3000:]
  assert r.seconds < 3 + 15  # its timeout, plus starting Python and JAX
  assert re.search(message, r.stderr), r.stderr[-3000:]


def test_a_second_launch_on_a_busy_port_is_refused(tmp_path):
  """Job 1 runs on --port P; job 2 on the same port is refused, job 1 finishes.

  Before, job 2's processes reached job 1's coordinator (gRPC shares a port)
  and job 1 died.
  """
  port = harness.free_port()
  args = ["-n", 2, "--port", port, harness.WORKER, "hold", tmp_path]
  with harness.Background(harness.launcher_cmd(args),
                          harness.base_env(1)) as first:
    first.wait_for("[1] joined", timeout=60)
    first.wait_for("[0] joined", timeout=10)
    second = harness.run_launcher(args, timeout=60)
    assert second.returncode == 1, second.output[-3000:]
    assert (f"jdist launch: port {port} is already in use on this machine"
            in second.stderr), second.stderr
    assert "Leave out --port" in second.stderr
    assert "joined" not in second.stdout  # nothing was started
    (tmp_path / "release").touch()
    assert first.popen.wait(timeout=60) == 0, first.output()[-3000:]
    assert first.output().count("released") == 2


def test_a_coordinator_port_held_by_another_program(tmp_path):
  """Process 0's jdist.initialize names the port (not "Failed to start RPC server")."""
  with socket.socket() as holder:
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    (r,) = harness.run_workers("no_coordinator", tmp_path, timeout=60, only=[0],
                               port=port)
  assert r.returncode == 1, r.output[-3000:]
  assert re.search(rf"jdist.ClusterError: Process 0 of 2 cannot start the "
                   rf"coordinator on port {port} \(\[::\]:{port}\): the port is "
                   r"already in use on this machine", r.stderr), r.stderr[-3000:]
  assert "Failed to start RPC server" not in r.stderr


def test_jdist_launch_names_the_process_that_raised(tmp_path):
  """Process 0 raises at step 3; process 1, told so, may end first."""
  r = harness.run_launcher(["-n", 2, "--devices-per-process", 2, harness.WORKER,
                            "crash", tmp_path], timeout=RUN_TIMEOUT,
                           WORKER_VICTIM=0)
  assert r.returncode == 1, r.output[-3000:]
  assert "jdist launch: process 0 of 2 failed (exit code 1)" in r.stderr, \
      r.stderr[-3000:]
  assert "  | RuntimeError: boom in process 0" in r.stderr


def test_a_terminated_launcher_kills_ranks_stuck_in_a_collective(tmp_path):
  """SIGTERM to `jdist launch`: JAX's preemption handler takes it in the ranks
  (process 0 is blocked in step 4, process 1 asleep), so the launcher kills
  them after its grace period."""
  args = ["-n", 2, "--devices-per-process", 2, "--grace-period", 2,
          harness.WORKER, "stuck", tmp_path]
  with harness.launched(args, ["[1] process 1 misbehaves at step 3"]) as (
      job, ranks):
    assert len(ranks) == 2, ranks
    time.sleep(1)  # process 0 is in step 4 now
    sent = time.monotonic()
    os.kill(job.popen.pid, signal.SIGTERM)
    assert job.popen.wait(timeout=20) == 128 + signal.SIGTERM, job.output()
    took = time.monotonic() - sent
    assert took < 2 + 3, took  # the grace period, and a moment
    assert harness.wait_gone(ranks, timeout=2) == []
    assert ("stopped by SIGTERM, which it forwarded to the processes; "
            "processes [0, 1] were still running after the grace period of "
            "2 s and were killed") in job.output()
