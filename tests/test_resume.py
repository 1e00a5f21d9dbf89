"""Checkpoints and BackupAndRestore: resume exactly, on any device count.

In-process tests interrupt `fit` with an exception; the crash and signal
tests run tests/train_child.py as a separate process (4 fake devices) and
relaunch its training in this process (`relaunch`), from the backups the
child left (a full disk relaunches the child: its backups are on a tmpfs
that only the child's mount namespace sees).
"""

import functools
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import Interrupt, strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "train_child.py")
# Jobs the test does not interrupt back up less often (train_child.py).
UNINTERRUPTED = ["--save-freq", "16"]


@pytest.fixture(scope="module")
def data(digits_flat):
  x, y = digits_flat
  return (x[:1000], y[:1000]), (x[1500:], y[1500:])


def make_trainer(n, model=None):
  return jdist.Trainer(model or MLP(), optimizer=optax.adam(1e-2), loss=LOSS,
                       metrics=["accuracy"], strategy=strategy_on(n), seed=0)


def fit(trainer, data, callbacks=(), epochs=3):
  (x, y), val = data
  return trainer.fit(x, y, batch_size=64, epochs=epochs, validation_data=val,
                     callbacks=list(callbacks), verbose=0)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
  """An uninterrupted run (3 epochs x 16 steps) on 4 devices, with backups."""
  backup = tmp_path_factory.mktemp("reference")
  trainer = make_trainer(4)
  history = fit(trainer, data, [jdist.BackupAndRestore(backup, save_freq=5)])
  assert not os.path.exists(backup)  # deleted once training completed
  return trainer, history


def interrupted_backup(data, directory, at=23, n=4):
  trainer = make_trainer(n)
  with pytest.raises(KeyboardInterrupt):
    fit(trainer, data, [Interrupt(at), jdist.BackupAndRestore(directory,
                                                              save_freq=5)])
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def assert_same_run(reference, trainer, history, *, exact):
  ref_trainer, ref_history = reference
  assert trainer.global_step == 48 and int(trainer.state.step) == 48
  assert history.epoch == ref_history.epoch
  for key, values in ref_history.history.items():
    np.testing.assert_allclose(history.history[key], values, rtol=1e-5,
                               err_msg=key)
  for a, b in zip(jax.tree.leaves(ref_trainer.params),
                  jax.tree.leaves(trainer.params)):
    if exact:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                 atol=1e-5)


def test_resume_after_an_interruption_is_exact(data, reference, tmp_path):
  assert interrupted_backup(data, tmp_path) == [15, 20]  # max_to_keep=2
  backup = jdist.BackupAndRestore(tmp_path, save_freq=5)
  trainer = make_trainer(4)
  history = fit(trainer, data, [backup])
  assert backup.restored_step == 20  # mid-epoch: epoch 2, batch 4
  assert_same_run(reference, trainer, history, exact=True)
  assert not os.path.exists(tmp_path)


def test_resume_from_the_snapshot_in_memory_is_exact(data, reference,
                                                     tmp_path, monkeypatch,
                                                     capfd):
  """`snapshot_every=11` in a (simulated) `jdist launch` job: killed at
  step 23, after the backup of step 20 and the snapshot of 22; the restart
  resumes from the snapshot (its step, data position and logs so far)
  without opening the backups, ends with the bits of the uninterrupted run,
  and leaves neither backups nor snapshots behind."""
  monkeypatch.setenv("JDIST_RUN_ID", "testjob")
  monkeypatch.setenv("JDIST_SNAPSHOT_ROOT", str(tmp_path / "shm"))
  backup_dir = tmp_path / "backup"
  make = lambda: jdist.BackupAndRestore(backup_dir, save_freq=5,
                                        snapshot_every=11)
  with pytest.raises(KeyboardInterrupt):
    fit(make_trainer(4), data, [Interrupt(23), make()])
  assert sorted(d for d in os.listdir(backup_dir) if d.isdigit()) == ["15",
                                                                      "20"]
  capfd.readouterr()
  backup = make()
  trainer = make_trainer(4)
  history = fit(trainer, data, [backup])
  assert backup.restored_step == 22  # mid-epoch: epoch 2, batch 6
  err = capfd.readouterr().err
  assert re.search(r"jdist: restored step 22 from the in-memory snapshot in "
                   r"\S+, not from the checkpoint of step 20 in \S+backup\.",
                   err), err
  assert "BackupAndRestore: resuming from step 22 (epoch 2, batch 6) in the "\
      "in-memory snapshot" in err
  assert_same_run(reference, trainer, history, exact=True)
  assert list(history.history) == list(reference[1].history)  # their order
  assert not os.path.exists(backup_dir)
  assert [f for _, _, fs in os.walk(tmp_path / "shm") for f in fs] == []


def test_snapshots_need_a_launched_job_and_a_number_of_batches(tmp_path,
                                                               monkeypatch):
  monkeypatch.delenv("JDIST_RUN_ID", raising=False)
  with pytest.raises(ValueError, match=r"snapshot_every=10: .*`jdist launch`"):
    jdist.BackupAndRestore(tmp_path, snapshot_every=10)
  monkeypatch.setenv("JDIST_RUN_ID", "testjob")
  for bad in (0, 2.5, True, "epoch"):
    with pytest.raises(ValueError, match="positive number"):
      jdist.BackupAndRestore(tmp_path, snapshot_every=bad)


@pytest.mark.parametrize("saved_on,resumed_on", [(4, 2), (2, 4)])
def test_resume_on_another_device_count(data, reference, tmp_path, saved_on,
                                        resumed_on):
  interrupted_backup(data, tmp_path, at=37, n=saved_on)
  backup = jdist.BackupAndRestore(tmp_path, save_freq=5)
  trainer = make_trainer(resumed_on)
  history = fit(trainer, data, [backup])
  assert backup.restored_step == 35
  assert trainer.params["Dense_0"]["kernel"].sharding.device_set == set(
      jax.local_devices()[:resumed_on])
  assert_same_run(reference, trainer, history, exact=False)


def test_corrupt_latest_backup_falls_back_to_the_previous(data, reference,
                                                          tmp_path):
  assert interrupted_backup(data, tmp_path) == [15, 20]
  for path in glob.glob(str(tmp_path / "20" / "state" / "**" / "*"),
                        recursive=True):
    if os.path.isfile(path) and "ocdbt" not in os.path.basename(path):
      with open(path, "r+b") as f:  # flip the bytes of every data file
        raw = f.read()
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in raw))
  resumes_from_15(data, reference, tmp_path, r"/20 is corrupt.*Using the "
                  r"checkpoint before it")


def resumes_from_15(data, reference, directory, warning):
  """A resume that warns (`warning`), falls back to step 15, ends exactly."""
  backup = jdist.BackupAndRestore(directory, save_freq=5)
  trainer = make_trainer(4)
  with pytest.warns(UserWarning, match=warning):
    history = fit(trainer, data, [backup])
  assert backup.restored_step == 15
  assert_same_run(reference, trainer, history, exact=True)


def test_a_corrupt_backup_is_replaced_when_its_step_is_trained_again(
    data, tmp_path):
  """Backups at steps 4 and 6, the arrays of 6 truncated: the resume falls
  back to 4 and trains step 6 again, whose backup replaces the corrupt one
  (it was skipped as saved already, so the next interruption resumed from
  4 again, with the warning again)."""
  def interrupted_at_7():
    backup = jdist.BackupAndRestore(tmp_path, save_freq=2)
    with pytest.raises(KeyboardInterrupt):
      fit(make_trainer(2), data, [Interrupt(7), backup], epochs=1)
    return backup.restored_step

  assert interrupted_at_7() is None
  assert sorted(d for d in os.listdir(tmp_path) if d.isdigit()) == ["4", "6"]
  for path in glob.glob(str(tmp_path / "6" / "state" / "**" / "d" / "*"),
                        recursive=True):
    os.truncate(path, os.path.getsize(path) // 2)
  with pytest.warns(UserWarning, match=r"/6 is corrupt: its arrays"):
    assert interrupted_at_7() == 4
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=".* is corrupt")
    assert interrupted_at_7() == 6


def test_a_flipped_bit_in_the_metadata_falls_back_to_the_previous(
    data, reference, tmp_path):
  """One bit of "batch" (4 -> 5) once resumed a batch late, silently."""
  assert interrupted_backup(data, tmp_path) == [15, 20]
  path = tmp_path / "20" / "meta" / "metadata"
  raw = path.read_bytes()
  at = raw.index(b'"batch": 4') + len(b'"batch": ')
  path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:])
  assert b'"batch": 5' in path.read_bytes()
  resumes_from_15(data, reference, tmp_path, r"/20 is corrupt: its metadata "
                  r"fails its checksum. Using the checkpoint before it")


def test_checkpoints_of_format_1_have_no_metadata_checksum_and_still_load(
    data, tmp_path):
  """Step 8 rewritten as format 1 wrote it (no metadata checksum; float sums
  of the arrays, not content hashes) loads; step 16 claiming format 2 but
  without the metadata checksum format 2 has is corrupt."""
  trainer = make_trainer(2)
  fit(trainer, data, [jdist.ModelCheckpoint(tmp_path, save_freq=8)], epochs=1)
  fresh = make_trainer(2)
  fresh.build(data[0][0][:4])
  assert fresh.load_checkpoint(tmp_path, step=8) == 8
  sums = [float(np.sum(np.asarray(x, np.float32)))
          for x in jax.tree.leaves(fresh.state)]
  for step, fmt in (("8", "jdist.Trainer/1"), ("16", "jdist.Trainer/2")):
    path = tmp_path / step / "meta" / "metadata"
    meta = json.loads(path.read_text())
    for key in ("meta_checksum", "hash", "digests"):
      del meta[key]
    path.write_text(json.dumps(dict(meta, format=fmt, checksums=sums)))
  fresh = make_trainer(2)
  fresh.build(data[0][0][:4])
  with pytest.warns(UserWarning, match="/16 is corrupt: its metadata has lost "
                    "its checksum"):
    assert fresh.load_checkpoint(tmp_path) == 8


def test_unreadable_metadata_is_corruption_too(data, tmp_path):
  interrupted_backup(data, tmp_path, at=12)
  with open(tmp_path / "10" / "meta" / "metadata", "w") as f:
    f.write("{not json")
  backup = jdist.BackupAndRestore(tmp_path, save_freq=5)
  with pytest.warns(UserWarning, match=r"/10 is corrupt: its metadata"):
    fit(make_trainer(2), data, [backup], epochs=1)
  assert backup.restored_step == 5


def test_no_readable_backup_is_an_error_before_any_step(data, tmp_path):
  interrupted_backup(data, tmp_path, at=12)
  for step in ("5", "10"):
    with open(tmp_path / step / "meta" / "metadata", "w") as f:
      f.write("{not json")
  trainer = make_trainer(2)
  with pytest.warns(UserWarning, match="is corrupt"):
    with pytest.raises(jdist.CheckpointError, match=r"(?s)No checkpoint in .* "
                       r"can be restored.*step 10.*step 5.*Delete the directory"):
      fit(trainer, data, [jdist.BackupAndRestore(tmp_path)], epochs=1)
  assert trainer.global_step == 0


def test_loading_from_a_directory_without_checkpoints(data, tmp_path):
  trainer = make_trainer(2)
  trainer.build(data[0][0][:4])
  with pytest.raises(jdist.CheckpointNotFoundError, match="No checkpoint in"):
    trainer.load_checkpoint(tmp_path)
  with pytest.raises(FileNotFoundError):  # what code catching it used before
    trainer.load_checkpoint(tmp_path)


def test_backup_of_another_model_is_an_error_before_any_step(data, tmp_path):
  interrupted_backup(data, tmp_path, at=6)
  trainer = make_trainer(4, model=MLP(hidden=32))
  steps = []

  class Count(jdist.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      steps.append(batch)

  with pytest.raises(jdist.CheckpointMismatchError,
                     match=r"(?s)different model.*params/Dense_0/kernel: checkpoint "
                     r"\(64, 16\) float32, model \(64, 32\).*new directory"):
    fit(trainer, data, [Count(), jdist.BackupAndRestore(tmp_path)])
  assert steps == [] and trainer.global_step == 0
  with pytest.raises(jdist.CheckpointMismatchError):
    trainer.load_checkpoint(tmp_path)


def test_sigterm_after_the_last_step_is_passed_on(data, tmp_path):
  """A SIGTERM that no step saw reaches the handler that was there before."""
  received = []
  previous = signal.signal(signal.SIGTERM, lambda *_: received.append("TERM"))

  class TermDuringValidation(jdist.Callback):
    def on_test_end(self, logs=None):
      if self.model.global_step == 16:  # the last epoch's validation
        os.kill(os.getpid(), signal.SIGTERM)

  try:
    trainer = make_trainer(2)
    fit(trainer, data, [TermDuringValidation(), jdist.BackupAndRestore(tmp_path)],
        epochs=1)
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert trainer.global_step == 16 and received == ["TERM"]


# --- real processes ------------------------------------------------------------


def run_child(args, timeout=180):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, CHILD] + args, env=env, timeout=timeout,
                        capture_output=True, text=True)


def relaunch(data, backup, capfd):
  """train_child.py's training relaunched in this process, from the backups
  in `backup`: a new Trainer, as the relaunched script builds it (on the 4
  devices the child had); it completes its 48 steps. Returns the trainer,
  its BackupAndRestore and what was printed to stderr."""
  capfd.readouterr()
  restore = jdist.BackupAndRestore(backup, save_freq=16)
  (x, y), _ = data
  trainer = make_trainer(4)
  trainer.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[restore])
  assert trainer.global_step == 48 and int(trainer.state.step) == 48
  return trainer, restore, capfd.readouterr().err


def final_params(path):
  with np.load(path) as f:
    return [f[f"p{i}"] for i in range(len(f.files))]


def assert_params_equal(reference, got):
  """`got` (a Trainer, or the path of a child's final parameters) holds the
  reference run's parameters, exactly."""
  ref_trainer, _ = reference
  got = (final_params(got) if isinstance(got, (str, os.PathLike)) else
         [np.asarray(p) for p in jax.tree.leaves(got.params)])
  want = [np.asarray(p) for p in jax.tree.leaves(ref_trainer.params)]
  assert len(got) == len(want)
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)


@pytest.mark.multiprocess
def test_crash_while_finalising_a_checkpoint_keeps_the_previous(
    data, reference, tmp_path, capfd):
  backup, out = tmp_path / "backup", tmp_path / "params.npz"
  crashed = run_child([str(backup), str(out), "--mode", "crash-in-finalize"])
  assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
  # Saves every 4 steps: step 4 is complete, step 8 died while finalising.
  assert "step 8\n" in crashed.stdout and "step 9\n" not in crashed.stdout
  # The dead job's lock stays behind: its process no longer runs.
  assert sorted(os.listdir(backup)) == ["4", "8.orbax-checkpoint-tmp",
                                        "jdist.lock"]

  trainer, restore, err = relaunch(data, backup, capfd)
  assert "which no longer runs; taking it over" in err
  assert "resuming from step 4 " in err and restore.restored_step == 4
  assert_params_equal(reference, trainer)


def signalled(backup, out, *signals):
  """The job (slowed down), sent `signals` after step 6: (code, out, err)."""
  proc = subprocess.Popen(
      [sys.executable, CHILD, str(backup), str(out), "--mode", "slow"],
      env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    for line in proc.stdout:
      if line.strip() == "step 6":
        for sig in signals:
          proc.send_signal(sig)
          time.sleep(0.05)
        break
    stdout, stderr = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  return proc.returncode, stdout, stderr


@pytest.mark.multiprocess
def test_sigterm_saves_exits_0_and_the_relaunch_finishes_exactly(
    data, reference, tmp_path, capfd):
  """SIGTERM, and a second one 50 ms later (an impatient scheduler): still
  one preemption, one save, exit 0. (A single SIGTERM to
  a job of two processes: multiprocess/test_fit_preemption.py.)"""
  backup, out = tmp_path / "backup", tmp_path / "params.npz"
  code, stdout, stderr = signalled(backup, out, signal.SIGTERM, signal.SIGTERM)
  assert code == 0, stderr[-3000:]
  stopped = int(stdout.split("exit at step ")[1].split()[0])
  assert 6 <= stopped < 48
  assert f"preempted; saved step {stopped} " in stderr

  trainer, restore, err = relaunch(data, backup, capfd)
  assert f"resuming from step {stopped} " in err
  assert restore.restored_step == stopped
  assert_params_equal(reference, trainer)


def start_paused(backup, out, go):
  """A training job that stops after step 2 until the file `go` exists."""
  proc = subprocess.Popen(
      [sys.executable, CHILD, str(backup), str(out), "--pause-at", "2",
       "--until", str(go), *UNINTERRUPTED],
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  for line in proc.stdout:
    if line.strip() == "step 2":
      return proc
  proc.kill()
  raise AssertionError(proc.communicate()[1][-3000:])


@pytest.mark.multiprocess
def test_a_second_trainer_on_the_same_backup_is_refused_before_any_step(
    data, reference, tmp_path):
  """Once, the second job adopted the first one's backup, then deleted it.
  The first job is a child process; the second trains in this process."""
  backup, out, go = tmp_path / "backup", tmp_path / "params.npz", tmp_path / "go"
  first = start_paused(backup, out, go)
  try:
    second = make_trainer(4)
    (x, y), _ = data
    with pytest.raises(jdist.CheckpointInUseError) as refused:
      second.fit(x, y, batch_size=64, epochs=3, verbose=0,
                 callbacks=[jdist.BackupAndRestore(backup, save_freq=4)])
    go.touch()
    stdout, stderr = first.communicate(timeout=120)
  finally:
    if first.poll() is None:
      first.kill()
      first.communicate()
  assert second.global_step == 0
  assert (f"The checkpoint directory {backup} is in use by another running "
          f"job: process {first.pid} on host {socket.gethostname()}"
          ) in str(refused.value)
  assert "that process is running on this machine" in str(refused.value)
  # The first job never noticed: it ends as if alone, and cleans up.
  assert first.returncode == 0, stderr[-3000:]
  assert "done 48 48" in stdout and not os.path.exists(backup)
  assert_params_equal(reference, out)


@pytest.mark.multiprocess
def test_sigint_keeps_the_backups_and_the_relaunch_finishes_exactly(
    data, reference, tmp_path, capfd):
  backup, out = tmp_path / "backup", tmp_path / "params.npz"
  code, _, stderr = signalled(backup, out, signal.SIGINT)  # Ctrl-C
  assert code == -signal.SIGINT
  assert stderr.rstrip().endswith("KeyboardInterrupt")
  assert stderr.count("Traceback") == 1 and "Event loop" not in stderr
  saved = sorted(int(d) for d in os.listdir(backup) if d.isdigit())
  assert saved and saved[-1] in (4, 8)  # 8 if Ctrl-C came during its save

  trainer, restore, err = relaunch(data, backup, capfd)
  assert f"resuming from step {saved[-1]} " in err
  assert restore.restored_step == saved[-1]
  assert_params_equal(reference, trainer)


# --- a full disk, a read-only directory, a failed restore: one clear message ---


@functools.cache
def unshare_flags():
  """`unshare` flags for a private mount namespace this user may mount in."""
  if shutil.which("unshare") is None:
    return None
  for flags in (["-m"], ["-rm"]) if os.geteuid() == 0 else (["-rm"],):
    probe = subprocess.run(
        ["unshare", *flags, "sh", "-c", 'd=$(mktemp -d) && mount -t tmpfs '
         '-o size=4k tmpfs "$d" && umount "$d" && rmdir "$d"'],
        capture_output=True)
    if probe.returncode == 0:
      return flags
  return None


def on_tmpfs(tmp_path, runs, timeout=240):
  """Runs the training job once per `(mount options, args)` of `runs`, with a
  tmpfs (mounted, then remounted with each run's options) at tmp_path/fs, in
  a private mount namespace: the mount goes away with it. The job's backup
  directory is fs/backup; returns each run's `(returncode, stdout, stderr)`."""
  flags = unshare_flags()
  if flags is None:
    pytest.skip("mounting a tmpfs needs root or user namespaces")
  fs = tmp_path / "fs"
  fs.mkdir()
  lines = []
  for i, (options, args) in enumerate(runs):
    mount = (f"mount -t tmpfs -o {options} tmpfs {fs}" if i == 0 else
             f"mount -o remount,{options} {fs}")
    child = " ".join(shlex.quote(a) for a in
                     [sys.executable, CHILD, str(fs / "backup")] + args)
    lines.append(f"{mount} || exit 99")
    lines.append(f"{child} > {tmp_path}/run{i}.out 2> {tmp_path}/run{i}.err; "
                 f"echo $? > {tmp_path}/run{i}.rc")
  done = subprocess.run(["unshare", *flags, "sh", "-c", "\n".join(lines)],
                        env=dict(os.environ, PYTHONPATH=ROOT), timeout=timeout,
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  return [(int((tmp_path / f"run{i}.rc").read_text()),
           (tmp_path / f"run{i}.out").read_text(),
           (tmp_path / f"run{i}.err").read_text()) for i in range(len(runs))]


def assert_one_clear_error(stderr, error):
  """One traceback, ending in `error`; none of orbax's echoes of it."""
  assert stderr.count("Traceback") == 1, stderr[-5000:]
  assert "Event loop is closed" not in stderr and "ERROR:absl" not in stderr
  last = stderr.rstrip().splitlines()[-1]
  assert last.startswith(error), stderr[-3000:]
  assert len(stderr.splitlines()) < 25, stderr[-5000:]
  return last


@pytest.mark.multiprocess
def test_a_full_disk_is_one_clear_error_and_the_relaunch_finishes_exactly(
    reference, tmp_path):
  """Once about 500 lines of orbax's threads; backups every 4 steps."""
  out = str(tmp_path / "params.npz")
  (code, stdout, stderr), resumed = on_tmpfs(
      tmp_path, [("size=300k", [out]), ("size=64m", [out, *UNINTERRUPTED])])
  assert code == 1
  last = assert_one_clear_error(stderr, "jdist.CheckpointError: Could not save "
                                "checkpoint step ")
  assert "No space left on device. The checkpoints written before it are " \
      "intact (the newest is step " in last
  newest = int(last.split("the newest is step ")[1].split(")")[0])
  failed = int(last.split("checkpoint step ")[1].split()[0])
  assert newest >= 4 and failed == newest + 4
  assert f"step {failed}\n" in stdout and f"step {failed + 1}\n" not in stdout

  code, stdout, stderr = resumed  # the same command, after space was freed
  assert code == 0, stderr[-3000:]
  assert f"resuming from step {newest} " in stderr
  assert f"ran {48 - newest} steps" in stdout
  assert_params_equal(reference, out)


@pytest.mark.multiprocess
def test_a_file_size_limit_is_one_clear_error(tmp_path):
  """EFBIG instead of ENOSPC, where a tmpfs cannot be mounted: from step 5
  on, no file may grow past 1 KB (RLIMIT_FSIZE)."""
  backup = tmp_path / "backup"
  failed = run_child([str(backup), str(tmp_path / "p.npz"), "--mode",
                      "file-size-limit"])
  assert failed.returncode == 1
  last = assert_one_clear_error(failed.stderr, "jdist.CheckpointError")
  # The first of orbax's writers to fail names the cause (Python's or
  # tensorstore's words for EFBIG).
  assert last.startswith(f"jdist.CheckpointError: Could not save checkpoint "
                         f"step 8 to {backup}: ")
  assert "File too large. The checkpoints written before it are intact (the " \
      "newest is step 4)" in last


@pytest.mark.multiprocess
def test_a_read_only_directory_fails_before_any_step(tmp_path):
  [(code, stdout, stderr)] = on_tmpfs(
      tmp_path, [("ro,size=64k", [str(tmp_path / "p.npz")])])
  assert code == 1 and "step " not in stdout
  assert_one_clear_error(
      stderr, f"jdist.CheckpointDirectoryError: The checkpoint directory "
      f"{tmp_path}/fs/backup cannot be used: it cannot be created (Read-only "
      "file system)")


@pytest.mark.multiprocess
def test_a_failed_restore_is_one_clear_message(data, tmp_path):
  """Once about 20 "Event loop is closed" tracebacks from tensorstore."""
  interrupted_backup(data, tmp_path, at=12)
  for manifest in glob.glob(str(tmp_path / "*" / "state" / "**" /
                                "manifest.ocdbt"), recursive=True):
    open(manifest, "w").close()
  failed = run_child([str(tmp_path), str(tmp_path / "p.npz")])
  assert failed.returncode == 1 and "step " not in failed.stdout
  assert_one_clear_error(failed.stderr, "Delete the directory to start over.")
  assert (f"jdist.CheckpointError: No checkpoint in {tmp_path} can be "
          "restored:\n  step 10: its arrays cannot be read (ValueError: ") in \
      failed.stderr
  assert "Error decoding manifest" in failed.stderr
  assert "tensorstore_spec" not in failed.stderr
  assert failed.stderr.count("is corrupt: its arrays cannot be read") == 2


# --- iterators: resumed by their own state, or by skipping ----------------------


class StatefulBatches:
  """An iterator with grain's DatasetIterator protocol: get_state/set_state."""

  def __init__(self, batches):
    self._batches, self._next, self.restored = batches, 0, []

  def __iter__(self):
    return self

  def __next__(self):
    if self._next >= len(self._batches):
      raise StopIteration
    self._next += 1
    return self._batches[self._next - 1]

  def get_state(self):
    return {"next": self._next}

  def set_state(self, state):
    self.restored.append(state)
    self._next = state["next"]


@pytest.fixture(scope="module")
def stream(data):
  """3 epochs x 5 batches, each epoch in its own order."""
  (x, y), _ = data
  out = []
  for epoch in range(3):
    order = np.random.default_rng(epoch).permutation(320)
    out += [(x[order[i:i + 64]], y[order[i:i + 64]]) for i in range(0, 320, 64)]
  return out


class SeededPasses:
  """A re-iterable of unknown length (no `__len__`) whose every pass has its
  own order, drawn from the pass's number, as a seeded reshuffling dataset
  has."""

  def __init__(self, x, y):
    self.x, self.y, self.passes = x, y, 0

  def __iter__(self):
    order = np.random.default_rng(self.passes).permutation(len(self.x))
    self.passes += 1
    for i in range(0, len(self.x), 64):
      yield self.x[order[i:i + 64]], self.y[order[i:i + 64]]


@pytest.mark.filterwarnings("ignore:steps_per_epoch=6 does not divide")
@pytest.mark.parametrize("kind", ["arrays", "unsized"])
def test_resume_epochs_shorter_than_the_data(data, tmp_path, kind):
  """Shuffled arrays, or a re-iterable of unknown length reshuffled per
  pass, steps_per_epoch=6 over 16 batches (epochs of 6, 6 and 4 batches per
  pass, as Keras's continue through the data; the re-iterable's length
  learned when its first pass runs out), interrupted in the second pass:
  the resumed run equals the uninterrupted one exactly."""
  (x, y), _ = data
  args = {"arrays": lambda: dict(x=x, y=y, batch_size=64),
          "unsized": lambda: dict(x=SeededPasses(x, y))}[kind]
  run = lambda trainer, callbacks: trainer.fit(
      **args(), epochs=5, steps_per_epoch=6, callbacks=callbacks, verbose=0)
  reference = make_trainer(2)
  with pytest.warns(UserWarning, match="16 batches"):
    ref_history = run(reference, [])
  assert reference.global_step == 6 + 6 + 4 + 6 + 6
  with pytest.raises(KeyboardInterrupt):
    run(make_trainer(2), [Interrupt(20),
                          jdist.BackupAndRestore(tmp_path, save_freq=3)])
  backup = jdist.BackupAndRestore(tmp_path, save_freq=3)
  trainer = make_trainer(2)
  history = run(trainer, [backup])
  assert backup.restored_step == 18 and trainer.global_step == 28
  np.testing.assert_array_equal(history.history["loss"],
                                ref_history.history["loss"])
  for a, b in zip(jax.tree.leaves(reference.params),
                  jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["stateful", "generator"])
def test_resume_a_one_shot_iterator(stream, tmp_path, kind):
  make = {"stateful": lambda: StatefulBatches(stream),
          "generator": lambda: (b for b in stream)}[kind]
  reference = make_trainer(2)
  ref_history = reference.fit(make(), epochs=3, steps_per_epoch=5, verbose=0)
  run = lambda callbacks: make_trainer(2).fit(
      make(), epochs=3, steps_per_epoch=5, callbacks=callbacks, verbose=0)
  with pytest.raises(KeyboardInterrupt):
    run([Interrupt(8), jdist.BackupAndRestore(tmp_path, save_freq=3)])
  backup = jdist.BackupAndRestore(tmp_path, save_freq=3)
  trainer = make_trainer(2)
  source = make()
  history = trainer.fit(source, epochs=3, steps_per_epoch=5, callbacks=[backup],
                        verbose=0)
  assert backup.restored_step == 6 and trainer.global_step == 15
  if kind == "stateful":
    assert source.restored == [{"next": 6}]  # its own state, not a replay
  for key in ref_history.history:
    np.testing.assert_allclose(history.history[key], ref_history.history[key],
                               rtol=1e-6)
  for a, b in zip(jax.tree.leaves(reference.params),
                  jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_a_grain_iterator(data, tmp_path):
  """grain's DatasetIterator resumes from its own state (get/set_state)."""
  import grain
  (x, y), _ = data
  records = [{"x": x[i], "y": y[i]} for i in range(320)]
  dataset = grain.MapDataset.source(records).shuffle(seed=0).repeat(3).batch(64)
  make = lambda: iter(dataset.to_iter_dataset())
  reference = make_trainer(2)
  ref_history = reference.fit(make(), epochs=3, steps_per_epoch=5, verbose=0)
  with pytest.raises(KeyboardInterrupt):
    make_trainer(2).fit(make(), epochs=3, steps_per_epoch=5, verbose=0,
                        callbacks=[Interrupt(8),
                                   jdist.BackupAndRestore(tmp_path, save_freq=3)])
  with open(tmp_path / "6" / "meta" / "metadata") as f:
    assert '"iterator_state": {"next_index": 6}' in f.read()
  backup = jdist.BackupAndRestore(tmp_path, save_freq=3)
  trainer = make_trainer(2)
  history = trainer.fit(make(), epochs=3, steps_per_epoch=5, verbose=0,
                        callbacks=[backup])
  assert backup.restored_step == 6
  np.testing.assert_allclose(history.history["loss"],
                             ref_history.history["loss"], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(reference.params),
                  jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
