"""Elastic jobs on 127.0.0.1: `jdist launch --nnodes MIN:MAX --max-restarts R`.

The job is elastic_job.py (60 steps of a small MLP, SGD with momentum, over
`jdist.MultiWorkerMirroredStrategy`, one fake CPU device per process, a
global batch of 16, a `jdist.CheckpointManager` checkpoint every 10 steps; or
the same with `Trainer.fit` and `BackupAndRestore`, here with a snapshot in
memory every 10 steps and a backup every 50). A
process kills or stops itself at a known step, or its node goes away; the job
must finish on the processes it still has (3 replicas take the batch as 3 x 6
with 2 rows masked) with the parameters of an uninterrupted 4-replica run
within 1e-6, having lost at most the steps since the last checkpoint. Each
test reads the processes' timestamped markers; every process is gone at the
end.
"""

import contextlib
import functools
import os
import re
import signal
import time

import jax
import numpy as np
import pytest

import elastic_train
import harness
import jdist

pytestmark = pytest.mark.multiprocess

JOB = os.path.join(harness.HERE, "elastic_job.py")
RUN_TIMEOUT = 240  # two or three attempts of 3-4 JAX processes on 2 cores


@functools.cache
def uninterrupted(mode: str) -> dict:
  """The job's parameters without a fault (`mode`: "loop" or "fit"), on 4
  replicas (4 fake devices of this process, as 4 processes x 1 device)."""
  strategy = jdist.MirroredStrategy(jax.local_devices()[:4])
  run = elastic_train.fit if mode == "fit" else elastic_train.uninterrupted
  return run(strategy)


def assert_finished(out_dir, *, world: int, attempt: int, mode="loop"
                    ) -> float:
  """The job ended in `attempt` on `world` processes, with the parameters of
  the uninterrupted run (float32 reduction order aside); returns the largest
  difference."""
  with np.load(os.path.join(out_dir, "final.npz")) as z:
    assert (int(z["world"]), int(z["attempt"])) == (world, attempt)
    for name, want in uninterrupted(mode).items():
      np.testing.assert_allclose(z[name], want, rtol=0, atol=1e-6,
                                 err_msg=name)
    return max(float(np.max(np.abs(z[name] - want)))
               for name, want in uninterrupted(mode).items())


def markers(output: str, name: str) -> list:
  """[(rank, value, rest)] of each `[rank] name value rest` line."""
  return [(int(r), float(v), rest) for r, v, rest in
          re.findall(rf"^\[(\d+)\] {name} (\S+)(.*)$", output, re.M)]


def pids(output: str) -> list:
  return [int(p) for p in re.findall(r"\] started \S+ pid=(\d+)", output)]


def restart_report(output: str) -> str:
  """The job's `restart ...` line: the time from the fault to the first
  step after it, and its parts."""
  found = re.search(r"^\[0\] (restart .*)$", output, re.M)
  assert found, output[-3000:]
  return found.group(1)


def test_a_killed_process_costs_one_restart_and_a_stuck_one_is_found(
    tmp_path):
  """One job, three faults, each checked as if it were the only one.

  SIGKILL of process 2 at step 30: the job restarts on its 3 processes from
  the checkpoint saved after 30 steps (one step lost). `--stuck-timeout 5`:
  in the next attempt process 2 stops itself (SIGSTOP) at step 40; in the
  one after, process 1 hangs, alive, after its step 54: its peers, a batch
  ahead, wait in the input agreement of the window of 8 batches that starts
  after their first 16 steps of the attempt (at step 56). The job ends with
  the parameters of an uninterrupted run.
  """
  r = harness.run_launcher(["--nnodes", 3, "--max-restarts", 3,
                            "--stuck-timeout", 5, "--devices-per-process", 1,
                            JOB, tmp_path, "0:2:30:kill", "1:2:40:stop",
                            "2:1:54:hang"], timeout=RUN_TIMEOUT)
  assert r.returncode == 0, r.output[-5000:]
  assert ("jdist launch: attempt 0: process 2 of 3 failed (killed by SIGKILL); "
          "restarting the job (restart 1 of at most 3)." in r.stderr), r.stderr
  assert "jdist launch: the job completed after 3 restarts" in r.stderr
  resumed = [step for _, step, _ in markers(r.stdout, "resumed")]
  # 1 step lost at each fault (30, 40, 54: the checkpoints of 30, 40, 50).
  assert sorted(resumed) == [0] * 3 + [30] * 3 + [40] * 3 + [50] * 3
  # The checkpoint directory's lock, left by attempt 0, is this job's.
  assert "in attempt 0 of this job, which has ended; taking it over" in r.stderr
  stopped = re.search(
      r"attempt 1: process 2 of 3 failed \(stuck: stopped by a signal \(SIGSTOP "
      r"or a debugger\) for (\d+\.\d) s, last seen after \d+ steps?\); "
      r"restarting the job \(restart 2 of at most 3\)", r.stderr)
  # Found by the launcher: JAX's heartbeats would end its peers at 10 s. Its
  # peers' wait in the next step can reach the timeout first (their wait
  # starts when they enter it, the stop is seen at the agent's next look).
  assert stopped and 4.5 <= float(stopped.group(1)) < 10, r.stderr
  hung = re.search(
      r"attempt 2: process 1 of 3 failed \(stuck: did not reach the input "
      r"agreement of dataset .*, where processes 0, 2 waited (\d+\.\d) s for "
      r"it; it is alive, busy or blocked elsewhere, last seen after 15 steps\)",
      r.stderr)
  assert hung and 5 <= float(hung.group(1)) < 10, r.stderr
  assert_finished(tmp_path, world=3, attempt=3)
  assert harness.wait_gone(pids(r.stdout), timeout=5) == []
  print(restart_report(r.stdout))


def wait_for_file(path: str, launchers: list, timeout: float) -> str:
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    ended = [l.output()[-3000:] for l in launchers if l.popen.poll() is not None]
    assert not ended and time.monotonic() < deadline, (path, ended)
    time.sleep(0.05)
  with open(path) as f:
    return f.read()


def test_a_node_that_goes_away_leaves_the_job_to_the_others(tmp_path):
  """Four launchers, one per simulated host, on one rendezvous; the host of
  process 2 goes away at step 30 (its launcher is killed, and with it its
  process): the job goes on on the other three, as `Trainer.fit` with
  `BackupAndRestore(save_freq=50, snapshot_every=10)`: no backup on disk
  before step 50, so it resumes from the in-memory snapshot of step 30 (the
  end of the first epoch). Then process 1 dies while it writes its part of
  fit's snapshot of step 40 (its temporary file is there): the job resumes
  from that snapshot with process 1's part from its replica (on process 2),
  or, when that snapshot lacks it, from step 30, and finishes with the
  parameters of an uninterrupted run. (The custom loop with
  `jdist.CheckpointManager`: test_snapshot_restarts.py.)"""
  with contextlib.ExitStack() as stack:
    launchers = harness.hosts_on_one_rendezvous(
        stack, [JOB, tmp_path, "--snapshot-every", 10, "--save-every", 50,
                "0:2:30:park", "1:1:40:snapkill", "--fit"])
    host = launchers[0]
    doomed = int(wait_for_file(os.path.join(tmp_path, "parked-2"), launchers,
                               timeout=RUN_TIMEOUT))
    assert doomed != host.popen.pid  # the job lives as long as its host
    os.kill(doomed, signal.SIGKILL)
    for launcher in launchers:
      launcher.popen.wait(timeout=RUN_TIMEOUT)
    output = "".join(l.output() for l in launchers)
    hosted = host.output()
  codes = sorted(l.popen.returncode for l in launchers)
  assert codes == [-signal.SIGKILL, 0, 0, 0], output[-5000:]
  assert re.search(r"jdist launch: attempt 0: node \d \(127\.0\.0\.1, process 2\) "
                   r"went away \(its launcher's connection closed\); restarting "
                   r"the job \(restart 1 of at most 3\)", hosted), output[-5000:]
  assert re.search(r"jdist launch: attempt 1: process 1 of 3 failed \(killed "
                   r"by SIGKILL\); restarting the job \(restart 2 of at most "
                   r"3\)", output), output[-5000:]
  writing = re.search(r"^\[1\] writing (\.tmp-1-\d+\.snap) \d+ (.*)$",
                      output, re.M)
  assert writing and writing.group(1) in writing.group(2).split(), output
  # The snapshot of step 40 with process 1's part from its replica, or
  # (lacking it: the launcher stopped process 2 before it wrote it) step 30.
  lacks = re.search(r"^\[0\] jdist: the snapshot of step 40 \(attempt 1\) "
                    r"lacks the parts of processes \[[\d, ]+\] of 3; not "
                    r"using it\.$", output, re.M)
  second, position = (30, "epoch 1, batch 30") if lacks else \
      (40, "epoch 2, batch 10")
  resumed = [step for _, step, _ in markers(output, "resumed")]
  assert sorted(resumed) == sorted([0] * 4 + [30] * 3 + [second] * 3)
  restored = re.findall(r"^\[0\] jdist: restored step (\d+) from the "
                        r"in-memory snapshot in \S+( \(the parts of processes "
                        r"\[[\d, ]+\] of 3 from their replicas on the "
                        r"processes after them\))?, not from "
                        r"\S+/backup \(no checkpoint there\)\.$", output, re.M)
  # (Process 0 of each attempt may run under another launcher.)
  assert sorted(int(s) for s, _ in restored) == sorted([30, second]), restored
  if not lacks:
    assert any(s == "40" and "[1]" in copies for s, copies in restored)
  for step, where in ((30, "epoch 1, batch 30"), (second, position)):
    assert re.search(rf"^\[0\] BackupAndRestore: resuming from step {step} "
                     rf"\({where}\) in the in-memory snapshot in \S+\.$",
                     output, re.M), output[-5000:]
  assert not os.path.exists(os.path.join(tmp_path, "backup"))  # completed
  worst = assert_finished(tmp_path, world=3, attempt=2, mode="fit")
  print(f"{restart_report(output)}; after the kill mid-snapshot, resumed "
        f"from step {second}; final parameters within {worst:.1e}")
  assert harness.wait_gone(pids(output), timeout=5) == []
