"""A checkpoint directory is claimed before any step: usable, and one job's.

Two real trainers on one directory are in tests/test_resume.py (and a
two-process job in tests/multiprocess/); here, the lock's other cases: owners
that are gone (same machine, another machine), an owner on another machine
that is alive, two callbacks of one fit, a job whose lock was taken over, and
paths that cannot hold checkpoints.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import optax
import pytest

import jdist
from jdist._src.checkpoint import directory_claim
from jdist.examples.models import MLP

from conftest import strategy_on


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return x[:256], y[:256]


class CountSteps(jdist.Callback):
  def __init__(self):
    super().__init__()
    self.steps = 0

  def on_train_batch_end(self, batch, logs=None):
    self.steps += 1


def fit(data, callbacks, epochs=1):
  x, y = data
  trainer = jdist.Trainer(MLP(), optimizer=optax.adam(1e-2),
                          loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                          strategy=strategy_on(2))
  count = CountSteps()
  try:
    trainer.fit(x, y, batch_size=64, epochs=epochs, verbose=0,
                callbacks=[count] + list(callbacks))
  finally:
    fit.steps = count.steps
  return trainer


def write_lock(directory, *, age=0.0, **owner):
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "jdist.lock")
  record = dict(token="theirs", host="elsewhere", pid=4242, pid_start=None,
                machine="elsewhere|boot|pid:[1]", processes=1, coordinator=None,
                since="earlier", command="train.py")
  record.update(owner)
  with open(path, "w") as f:
    json.dump(record, f)
  then = time.time() - age
  os.utime(path, (then, then))
  return path


def test_a_path_that_is_a_file_fails_before_any_step(data, tmp_path):
  path = tmp_path / "backup"
  path.write_text("not a directory")
  with pytest.raises(jdist.CheckpointDirectoryError,
                     match=rf"{path} cannot be used: it is a file, not a "
                     "directory. Point the callback at a directory"):
    fit(data, [jdist.BackupAndRestore(path)])
  assert fit.steps == 0
  with pytest.raises(OSError, match="a part of its path is a file"):
    fit(data, [jdist.ModelCheckpoint(path / "checkpoints")])
  assert fit.steps == 0


def ignores_permissions(tmp_path) -> bool:
  """Whether this process writes where permissions forbid it (root does)."""
  locked = tmp_path / "locked"
  locked.mkdir(mode=0o500)
  try:
    (locked / "probe").touch()
    return True
  except PermissionError:
    return False
  finally:
    locked.chmod(0o700)


@pytest.mark.multiprocess
def test_a_directory_without_write_permission_fails_before_any_step(
    data, tmp_path):
  if ignores_permissions(tmp_path):  # root: run the same fit bound by them
    _fit_bound_by_permissions_into_a_read_only_directory()
    return
  tmp_path.chmod(0o500)
  try:
    with pytest.raises(jdist.CheckpointDirectoryError,
                       match="this process cannot write to it"):
      fit(data, [jdist.ModelCheckpoint(tmp_path)])
  finally:
    tmp_path.chmod(0o700)
  assert fit.steps == 0


# The same program, for a process that permissions bind.
_READ_ONLY_FIT = """
import os, tempfile
import optax, jdist
from jdist.examples.data import load_digits
from jdist.examples.models import MLP

x, y = load_digits(image=False)
steps = []

class Count(jdist.Callback):
  def on_train_batch_end(self, batch, logs=None):
    steps.append(batch)

directory = tempfile.mkdtemp()
os.chmod(directory, 0o500)
trainer = jdist.Trainer(
    MLP(), optimizer=optax.adam(1e-2),
    loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True))
try:
  trainer.fit(x[:256], y[:256], batch_size=64, verbose=0,
              callbacks=[Count(), jdist.ModelCheckpoint(directory)])
except jdist.CheckpointDirectoryError as e:
  print("refused:", e)
finally:
  os.chmod(directory, 0o700)
  os.rmdir(directory)
print("steps:", len(steps))
"""

# Root writes anywhere through one capability, CAP_DAC_OVERRIDE. Without it
# (left out of the inheritable and bounding sets, so the exec'd interpreter
# never gets it back) root is still root: it reads every file the suite reads
# (CAP_DAC_READ_SEARCH stays), from a checkout and a venv in a private
# directory too, but a directory's mode bits decide whether it may write
# there, as for any user.
_WITHOUT_OVERRIDE = ["--inh-caps=-dac_override", "--bounding-set=-dac_override"]


def _fit_bound_by_permissions_into_a_read_only_directory():
  setpriv = shutil.which("setpriv")
  if setpriv is None:
    pytest.skip("root writes to read-only directories, and there is no "
                "setpriv to run the program without CAP_DAC_OVERRIDE")
  probe = subprocess.run([setpriv, *_WITHOUT_OVERRIDE, "true"],
                         capture_output=True, text=True, timeout=60)
  if probe.returncode != 0:
    pytest.skip("root writes to read-only directories, and this process may "
                f"not drop CAP_DAC_OVERRIDE: {probe.stderr.strip()}")
  done = subprocess.run(
      [setpriv, *_WITHOUT_OVERRIDE, sys.executable, "-c", _READ_ONLY_FIT],
      capture_output=True, text=True, timeout=300, cwd="/")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "this process cannot write to it" in done.stdout, done.stdout
  assert done.stdout.rstrip().endswith("steps: 0"), done.stdout


def test_two_callbacks_of_one_fit_on_one_directory(data, tmp_path):
  with pytest.raises(jdist.CheckpointInUseError,
                     match=r"in use by this process, which already writes"):
    fit(data, [jdist.BackupAndRestore(tmp_path),
               jdist.ModelCheckpoint(tmp_path)])
  assert fit.steps == 0
  fit(data, [jdist.ModelCheckpoint(tmp_path)])  # both let it go
  assert not os.path.exists(tmp_path / "jdist.lock")


def test_a_reused_process_id_is_not_an_owner(data, tmp_path, capfd):
  """The lock's pid runs (it is this process) but started at another time."""
  seen = {}

  class ReadLock(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      with open(tmp_path / "jdist.lock") as f:
        seen.update(json.load(f))

  fit(data, [jdist.ModelCheckpoint(tmp_path), ReadLock()])
  assert seen["pid"] == os.getpid() and not os.path.exists(tmp_path / "jdist.lock")
  if seen["pid_start"] is None:
    pytest.skip("no /proc here: process start times are unknown")
  write_lock(tmp_path, **dict(seen, pid_start=str(int(seen["pid_start"]) - 1)))
  fit(data, [jdist.ModelCheckpoint(tmp_path)])
  assert "which no longer runs; taking it over" in capfd.readouterr().err


@pytest.fixture
def short_lease(monkeypatch):
  monkeypatch.setattr(directory_claim, "LEASE_SECONDS", 3.0)
  monkeypatch.setattr(directory_claim, "POLL_SECONDS", 0.1)


def test_an_expired_lock_from_another_machine_is_taken_over(
    data, tmp_path, short_lease, capfd):
  write_lock(tmp_path, age=3600)
  fit(data, [jdist.ModelCheckpoint(tmp_path, save_freq=2)])
  assert "locked by process 4242 on host elsewhere" in capfd.readouterr().err
  assert fit.steps == 4 and os.path.isdir(tmp_path / "4")


class LockAtTrainBegin(jdist.Callback):
  """Writes the lock of an owner that died just now, as fit begins (before
  ModelCheckpoint, next in the list, claims the directory): on a loaded
  machine fit's start alone can outlast a 3 s lease."""

  def __init__(self, directory, **owner):
    super().__init__()
    self.directory, self.owner, self.written = directory, owner, None

  def on_train_begin(self, logs=None):
    write_lock(self.directory, **self.owner)
    self.written = time.monotonic()


def test_a_fresh_lock_from_another_machine_waits_for_its_lease(
    data, tmp_path, short_lease, capfd):
  lock = LockAtTrainBegin(tmp_path)  # nobody refreshes it
  fit(data, [lock, jdist.ModelCheckpoint(tmp_path)])
  waited = time.monotonic() - lock.written
  err = capfd.readouterr().err
  # Its age when the claim reads it: 0 s, or a second on a loaded machine.
  found = re.search(r"on another machine, last refreshed (\d+) s ago; waiting "
                    r"up to (\d+) s", err)
  assert found, err
  age, wait = map(int, found.groups())
  assert age <= 2 and 2 <= age + wait <= 4, found.group(0)
  assert "which no longer runs; taking it over" in err
  assert waited >= 2.5 and fit.steps == 4


def test_an_earlier_attempt_of_the_job_on_another_host_is_taken_over_at_once(
    data, tmp_path, short_lease, monkeypatch, capfd):
  """`jdist launch` restarted the job and process 0 now runs on another
  host: the lock of attempt 0's process 0 is fresh, from another machine,
  but of this job's earlier attempt (`JDIST_RUN_ID`): no wait for its lease.
  Another job's lock, or this attempt's, still waits."""
  monkeypatch.setenv("JDIST_RUN_ID", "run-7")
  monkeypatch.setenv("JDIST_RESTART_COUNT", "1")
  write_lock(tmp_path, run="run-7", attempt=0)
  fit(data, [jdist.ModelCheckpoint(tmp_path)])
  err = capfd.readouterr().err
  assert ("locked by process 4242 on host elsewhere, since earlier "
          "('train.py'), in attempt 0 of this job, "
          "which has ended; taking it over") in err
  assert "waiting" not in err and fit.steps == 4
  # This attempt's own lock, written as fit begins (fit's start can outlast
  # the lease on a loaded machine).
  fit(data, [LockAtTrainBegin(tmp_path, run="run-7", attempt=1),
             jdist.ModelCheckpoint(tmp_path)])
  assert re.search(r"waiting up to \d+ s", capfd.readouterr().err)


def test_a_live_owner_on_another_machine_is_refused(data, tmp_path,
                                                    short_lease):
  path = write_lock(tmp_path)
  stop = threading.Event()

  def heartbeat():  # what the other machine's job does
    while not stop.wait(0.2):
      os.utime(path)

  thread = threading.Thread(target=heartbeat)
  thread.start()
  try:
    with pytest.raises(jdist.CheckpointInUseError,
                       match=r"in use by another running job: process 4242 on "
                       r"host elsewhere.*refreshed by its heartbeat"):
      fit(data, [jdist.BackupAndRestore(tmp_path)])
  finally:
    stop.set()
    thread.join()
  assert fit.steps == 0
  with open(path) as f:
    assert json.load(f)["token"] == "theirs"  # left as it was


def test_a_job_whose_lock_was_taken_over_stops_writing(data, tmp_path,
                                                       monkeypatch):
  monkeypatch.setattr(directory_claim, "HEARTBEAT_SECONDS", 0.05)

  class TakeOver(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if self.model.global_step == 3:  # another job judged this one dead
        write_lock(tmp_path, token="new owner")
        time.sleep(0.5)

  with pytest.raises(jdist.CheckpointInUseError,
                     match=r"Another job took the checkpoint directory .* over "
                     r"while this one ran \(process 4242 on host elsewhere"):
    fit(data, [TakeOver(), jdist.ModelCheckpoint(tmp_path, save_freq=2)])
  assert sorted(os.listdir(tmp_path)) == ["2", "jdist.lock"]
  with open(tmp_path / "jdist.lock") as f:
    assert json.load(f)["token"] == "new owner"  # not removed by the old job
  assert fit.steps == 4
