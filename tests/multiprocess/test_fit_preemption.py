"""Two real training processes (2 fake CPU devices each) on 127.0.0.1.

kill -9 of one process: the relaunch resumes from the last complete backup
and applies exactly the missing optimizer steps. SIGTERM to one process (of
that relaunch): both save at the same step and exit 0, and the relaunch
ends with the parameters of an uninterrupted run. The job is
tests/train_child.py.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(ROOT, "tests", "train_child.py")
STEPS = 48  # 3 epochs of 16 steps
# Jobs the test does not interrupt back up less often (train_child.py).
UNINTERRUPTED = ["--save-freq", "16"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Job:
  """Two processes of tests/train_child.py; output in files, killed on exit."""

  def __init__(self, tmp_path, name, backup, out, mode="plain", extra=()):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    self.logs, self.procs = [], []
    for i in range(2):
      stdout = open(tmp_path / f"{name}{i}.out", "w+")
      stderr = open(tmp_path / f"{name}{i}.err", "w+")
      self.logs.append((stdout, stderr))
      self.procs.append(subprocess.Popen(
          [sys.executable, CHILD, str(backup), str(out), "--mode", mode,
           "--processes", "2", "--process-id", str(i), "--port", str(port),
           *extra],
          env=env, stdout=stdout, stderr=stderr, text=True))

  def out(self, i) -> str:
    f = self.logs[i][0]
    f.flush()
    with open(f.name) as g:
      return g.read()

  def err(self, i) -> str:
    with open(self.logs[i][1].name) as g:
      return g.read()

  def wait_for(self, i, text, timeout=120):
    deadline = time.monotonic() + timeout
    while text not in self.out(i):
      if self.procs[i].poll() is not None or time.monotonic() > deadline:
        raise AssertionError(f"process {i} never printed {text!r}:\n"
                             f"{self.out(i)[-1000:]}\n{self.err(i)[-3000:]}")
      time.sleep(0.05)

  def wait(self, timeout=120) -> list:
    deadline = time.monotonic() + timeout
    for p in self.procs:
      p.wait(timeout=max(1, deadline - time.monotonic()))
    return [p.returncode for p in self.procs]

  def close(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for out, err in self.logs:
      out.close()
      err.close()


@pytest.fixture(scope="module")
def reference(digits_flat):
  """The same training, uninterrupted, in this process on 4 fake devices."""
  x, y = digits_flat
  trainer = jdist.Trainer(MLP(), optimizer=optax.adam(1e-2),
                          loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"],
                          strategy=jdist.MirroredStrategy(jax.local_devices()[:4]))
  trainer.fit(x[:1000], y[:1000], batch_size=64, epochs=3, verbose=0)
  return [np.asarray(p) for p in jax.tree.leaves(trainer.params)]


def assert_params_match(reference, path):
  with np.load(path) as f:
    got = [f[f"p{i}"] for i in range(len(f.files))]
  assert len(got) == len(reference)
  for want, have in zip(reference, got):
    # Two processes reduce over gloo in another order than one process does.
    np.testing.assert_allclose(have, want, rtol=2e-5, atol=2e-6)


def complete_steps(backup) -> list:
  return sorted(int(d) for d in os.listdir(backup) if d.isdigit())


def finish(tmp_path, backup, out, resume_at):
  job = Job(tmp_path, "relaunch", backup, out, extra=UNINTERRUPTED)
  try:
    codes = job.wait(timeout=180)
    assert codes == [0, 0], job.err(0)[-3000:] + job.err(1)[-3000:]
    assert f"resuming from step {resume_at} " in job.err(0)
    for i in range(2):
      assert f"ran {STEPS - resume_at} steps" in job.out(i)  # none lost or redone
      assert f"done {STEPS} {STEPS}" in job.out(i)
    # Only process 0 prints progress and writes the shared CSV log.
    assert "Epoch 3/3 - " in job.out(0) and "Epoch" not in job.out(1)
  finally:
    job.close()
  assert not os.path.exists(backup)  # deleted once the job completed
  with open(f"{out}.csv") as f:
    lines = f.read().splitlines()
  assert lines[0].startswith("epoch,") and [l[0] for l in lines[1:]] == list("012")


def test_kill_9_then_sigterm_to_one_process(reference, tmp_path, digits_flat):
  """One job, two faults, each checked as if it were the only one.

  kill -9 of process 1 after step 10: the backups of steps 4 and 8 are
  complete, and resume (below, also in one process on 2 devices). The
  relaunch resumes from the newest; SIGTERM to its process 1 two steps
  later: both processes save at one agreed step and exit 0. The relaunch
  after that resumes there, applies exactly the missing optimizer steps and
  ends with the parameters of an uninterrupted run.
  """
  backup, out = tmp_path / "backup", tmp_path / "params.npz"
  job = Job(tmp_path, "first", backup, out, mode="slow")
  try:
    job.wait_for(0, "step 10\n")  # backups at steps 4 and 8 are complete
    job.procs[1].send_signal(signal.SIGKILL)
    job.procs[1].wait(timeout=30)
  finally:
    job.close()
  saved = complete_steps(backup)
  assert saved and saved[-1] >= 8 and saved[-1] % 4 == 0
  shutil.copytree(backup, tmp_path / "copy")

  job = Job(tmp_path, "second", backup, out, mode="slow")
  try:
    job.wait_for(1, f"step {saved[-1] + 2}\n")
    job.procs[1].send_signal(signal.SIGTERM)
    codes = job.wait(timeout=120)
    assert codes == [0, 0], job.err(0)[-3000:] + job.err(1)[-3000:]
    stops = [int(job.out(i).split("exit at step ")[1].split()[0]) for i in range(2)]
  finally:
    job.close()
  assert f"resuming from step {saved[-1]} " in job.err(0)
  # One agreed step.
  assert stops[0] == stops[1] and saved[-1] + 2 <= stops[0] < STEPS
  assert f"preempted; saved step {stops[0]} " in job.err(0)
  assert complete_steps(backup)[-1] == stops[0]
  finish(tmp_path, backup, out, resume_at=stops[0])
  assert_params_match(reference, out)

  # The two processes' backup also resumes in one process on 2 devices.
  x, y = digits_flat
  restore = jdist.BackupAndRestore(tmp_path / "copy")
  trainer = jdist.Trainer(MLP(), optimizer=optax.adam(1e-2),
                          loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"],
                          strategy=jdist.MirroredStrategy(jax.local_devices()[:2]))
  trainer.fit(x[:1000], y[:1000], batch_size=64, epochs=3, verbose=0,
              callbacks=[restore])
  assert restore.restored_step == saved[-1] and trainer.global_step == STEPS
  for want, have in zip(reference, jax.tree.leaves(trainer.params)):
    np.testing.assert_allclose(np.asarray(have), want, rtol=2e-5, atol=2e-6)


def test_a_second_job_on_the_same_backup_is_refused_on_every_process(
    reference, tmp_path):
  """The job owns the directory: process 0 locks it, process 1 learns why."""
  backup, out, go = tmp_path / "backup", tmp_path / "params.npz", tmp_path / "go"
  first = subprocess.Popen(
      [sys.executable, CHILD, str(backup), str(out), "--pause-at", "2",
       "--until", str(go), *UNINTERRUPTED],
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  second = None
  try:
    for line in first.stdout:
      if line.strip() == "step 2":
        break
    second = Job(tmp_path, "second", backup, tmp_path / "other.npz")
    codes = second.wait(timeout=120)
    errors = [second.err(0), second.err(1)]
    outs = [second.out(0), second.out(1)]
    go.touch()
    stdout, stderr = first.communicate(timeout=120)
  finally:
    if second is not None:
      second.close()
    if first.poll() is None:
      first.kill()
      first.communicate()
  assert codes[0] != 0 and codes[1] != 0
  want = (f"The checkpoint directory {backup} is in use by another running "
          f"job: process {first.pid} on host")
  assert f"jdist.CheckpointInUseError: {want}" in errors[0]
  assert f"jdist.CheckpointInUseError: Process 0: {want}" in errors[1]
  assert all("step " not in o for o in outs)
  assert first.returncode == 0, stderr[-3000:]
  assert "done 48 48" in stdout and not os.path.exists(backup)
  assert_params_match(reference, out)
