"""Elastic jobs that resume from the in-memory snapshot:
`jdist.CheckpointManager(snapshot_every=10, save_every=50)` under
`jdist launch --nnodes 2:4 --max-restarts 3` (elastic_job.py, 4 processes x
1 CPU device, 60 steps; see test_elastic.py). A process killed after step
30 leaves no checkpoint on disk to resume from (the first is at 50): the
restart resumes from the snapshot of step 30 in /dev/shm (the killed
process's part, or its replica when the kill came before its writer thread
wrote the part), on 4 processes or on the 3 that are left, and ends with the parameters of an uninterrupted
run within 1e-6. Each process's part is also held by the next process as
its replica: a host that goes away with its memory leaves the snapshot
complete. A process killed while it writes its part of a snapshot leaves
that snapshot to its replica, if the next process wrote it before the
launcher stopped it; else the one before is used. When the job ends, its
snapshot directory is gone, and so is every process.
"""

import contextlib
import os
import re
import signal
import time

import pytest

import harness
import test_elastic as elastic

pytestmark = pytest.mark.multiprocess

SNAPSHOTS = ["--snapshot-every", 10, "--save-every", 50]
PART_30 = "step-000000000030.attempt-0.part-{}-of-4.snap"


def snapshot_dir(output: str) -> str:
  found = re.search(r"^\[0\] snapshots (\S+)$", output, re.M)
  assert found, output[-3000:]
  return found.group(1)


def assert_resumed_from_memory(output: str, out_dir, world: int,
                               restores: list):
  """Each restart resumed where `restores` says, read from the in-memory
  snapshot, not from the checkpoint directory (whose first checkpoint is at
  step 50). `restores`: per restart, `(step, replicas, maybe)`: `replicas`,
  a pattern of the processes whose parts came from their replicas, as the
  line names them (with `maybe`, or none)."""
  resumed = [s for _, s, _ in elastic.markers(output, "resumed")]
  want = [0] * 4 + [step for step, _, _ in restores for _ in range(world)]
  assert sorted(resumed) == sorted(want), output[-5000:]
  lines = re.findall(r"^\[0\] jdist: restored step (\d+) from the in-memory "
                     r"snapshot in \S+(.*), not from \S+ \(no checkpoint "
                     r"there\)\.$", output, re.M)
  assert [int(step) for step, _ in lines] == [s for s, _, _ in restores], \
      output[-5000:]
  for (_, copies), (_, replicas, maybe) in zip(lines, restores):
    want = (rf" \(the parts of processes {replicas} of 4 from their "
            r"replicas on the processes after them\)" if replicas else "")
    assert re.fullmatch(f"(?:{want})?" if maybe else want, copies), lines
  ckpts = os.path.join(out_dir, "checkpoints")
  assert sorted(d for d in os.listdir(ckpts) if d.isdigit()) == ["50"]


def assert_nothing_left(output: str):
  folder = snapshot_dir(output)
  assert not os.path.exists(os.path.dirname(folder)), os.listdir(folder)
  assert harness.wait_gone(elastic.pids(output), timeout=5) == []


def test_killed_processes_resume_from_the_snapshots_in_memory(tmp_path):
  """Attempt 0: SIGKILL of process 2 after step 30; attempt 1 resumes from
  the snapshot of step 30. Attempt 1: process 2 dies while it writes its
  part of the snapshot of step 40 (its temporary file is there). Process 3
  had its replica (copied when the snapshot was taken) and writes it unless
  the launcher stops it first: attempt 2 resumes from the snapshot of step
  40 with process 2's part from its replica, or, when that snapshot lacks
  process 2's part, from step 30. (One job for both faults: each restart is
  checked as if it were the only one.)"""
  r = harness.run_launcher(["--nnodes", "2:4", "--max-restarts", 3,
                            "--devices-per-process", 1, elastic.JOB, tmp_path,
                            *SNAPSHOTS, "0:2:30:kill", "1:2:40:snapkill"],
                           timeout=elastic.RUN_TIMEOUT)
  assert r.returncode == 0, r.output[-5000:]
  assert "jdist launch: the job completed after 2 restarts" in r.stderr
  for attempt in (0, 1):
    assert (f"jdist launch: attempt {attempt}: process 2 of 4 failed (killed "
            f"by SIGKILL); restarting the job (restart {attempt + 1} of at "
            "most 3)." in r.stderr), r.stderr
  assert snapshot_dir(r.stdout).startswith("/dev/shm/jdist-snapshots-")
  writing = re.search(r"^\[2\] writing (\.tmp-2-\d+\.snap) \d+ (.*)$",
                      r.stdout, re.M)
  assert writing, r.output[-5000:]
  assert writing.group(1) in writing.group(2).split()
  # The first kill: its part of step 30 is written by its writer thread
  # from the save of step 31 on, and the kill comes right after that save:
  # the part, or (killed before it was written) its replica on process 3.
  first = (30, re.escape("[2]"), True)
  # The second: the others wrote theirs, and their replicas, before the
  # launcher stopped them, or not.
  if re.search(r"^\[0\] jdist: the snapshot of step 40 \(attempt 1\) lacks "
               r"the parts of processes \[[\d, ]+\] of 4; not using it\.$",
               r.stderr, re.M):
    second = first  # (the snapshot of step 30, from attempt 0, again)
  else:
    second = (40, r"\[(\d, )*2(, \d)*\]", False)
  assert_resumed_from_memory(r.output, tmp_path, 4, [first, second])
  elastic.assert_finished(tmp_path, world=4, attempt=2)
  assert_nothing_left(r.output)
  print(elastic.restart_report(r.stdout))


def test_a_job_that_fails_leaves_no_snapshot(tmp_path):
  """No restart allowed: the job fails at its first fault, after three
  snapshots; the launcher removes them as it ends."""
  r = harness.run_launcher(["--nnodes", 2, "--max-restarts", 0,
                            "--devices-per-process", 1, elastic.JOB, tmp_path,
                            *SNAPSHOTS, "0:1:30:kill"],
                           timeout=elastic.RUN_TIMEOUT)
  assert r.returncode != 0, r.output[-5000:]
  assert "process 1 of 2" in r.stderr and "killed by SIGKILL" in r.stderr
  assert not os.path.exists(os.path.join(tmp_path, "final.npz"))
  assert_nothing_left(r.output)


def test_a_node_that_goes_away_with_its_memory_resumes_from_the_replicas(
    tmp_path):
  """Four launchers on one rendezvous (one machine: one /dev/shm); process
  2's goes away after step 30, and with it what its host held: its files
  (each its part and the replica of process 1's; the test removes them).
  The 3 others resume from the snapshot of step 30, with process 2's part
  from its replica on process 3 (and the probe, a leaf split over the
  processes, comes back)."""
  with contextlib.ExitStack() as stack:
    launchers = harness.hosts_on_one_rendezvous(
        stack, [elastic.JOB, tmp_path, *SNAPSHOTS, "0:2:30:park"])
    host = launchers[0]
    doomed = int(elastic.wait_for_file(os.path.join(tmp_path, "parked-2"),
                                       launchers, timeout=elastic.RUN_TIMEOUT))
    folder = snapshot_dir(host.output())
    # Process 3's file of step 30, with the replica of process 2's part, is
    # written after the save after step 30 (process 2 has written its own,
    # with its part and the replica of process 1's).
    replica = os.path.join(folder, PART_30.format(3))
    deadline = time.monotonic() + 60
    while not os.path.exists(replica):
      assert time.monotonic() < deadline, os.listdir(folder)
      time.sleep(0.05)
    gone = [f for f in os.listdir(folder) if re.fullmatch(
        r"step-\d+\.attempt-0\.part-2-of-4\.snap", f)]
    assert PART_30.format(2) in gone, os.listdir(folder)
    for name in gone:
      os.unlink(os.path.join(folder, name))
    os.kill(doomed, signal.SIGKILL)
    for launcher in launchers:
      launcher.popen.wait(timeout=elastic.RUN_TIMEOUT)
    output = "".join(l.output() for l in launchers)
  codes = sorted(l.popen.returncode for l in launchers)
  assert codes == [-signal.SIGKILL, 0, 0, 0], output[-5000:]
  assert_resumed_from_memory(output, tmp_path, 3,
                             [(30, re.escape("[2]"), False)])
  elastic.assert_finished(tmp_path, world=3, attempt=1)
  assert_nothing_left(output)
