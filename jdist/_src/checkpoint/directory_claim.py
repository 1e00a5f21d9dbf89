"""Owning a checkpoint directory: writable, and written by one job only.

Process 0 takes the lock file `jdist.lock`; a lock whose owner is gone
(dead pid here, an mtime still for `LEASE_SECONDS` elsewhere, or an earlier
attempt of the same job) is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid

from jdist._src.errors import CheckpointDirectoryError, CheckpointInUseError
from jdist._src.launcher import job_env
from jdist._src.launcher import liveness
from jdist._src.runtime import runtime as runtime_lib

LOCK_NAME = "jdist.lock"
HEARTBEAT_SECONDS = 10.0
LEASE_SECONDS = 60.0
POLL_SECONDS = 1.0
_UNREADABLE_GRACE_SECONDS = 10.0  # a lock file being written is empty briefly


def _proc_stat(pid: int) -> tuple[str, str] | None:
  """(state, start time since boot) of a process, on Linux; else None."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[0], fields[19]  # fields 3 and 22 of proc(5)


def _machine() -> str:
  """Where process ids can be compared: host, boot, pid namespace."""
  parts = [socket.gethostname()]
  with contextlib.suppress(OSError):
    with open("/proc/sys/kernel/random/boot_id") as f:
      parts.append(f.read().strip())
  with contextlib.suppress(OSError):
    parts.append(os.readlink("/proc/self/ns/pid"))
  return "|".join(parts)


def _alive(pid, start: str | None) -> bool:
  if not liveness.pid_exists(pid):
    return False
  stat = _proc_stat(pid)
  if stat is None:
    return True
  state, started = stat
  return state != "Z" and (start is None or started == start)


def _owner_record(runtime) -> dict:
  stat = _proc_stat(os.getpid())
  return {"token": uuid.uuid4().hex, "host": socket.gethostname(),
          "machine": _machine(), "pid": os.getpid(),
          "pid_start": stat[1] if stat else None,
          "processes": runtime.num_processes,
          "coordinator": (runtime.config.coordinator_address
                          if runtime.config else None),
          "since": time.strftime("%Y-%m-%d %H:%M:%S"),
          "run": os.environ.get(job_env.ENV_RUN_ID),
          "attempt": int(os.environ.get(job_env.ENV_RESTART_COUNT, "0")),
          "command": " ".join(sys.argv)[:200]}


def _describe(owner: dict) -> str:
  job = ""
  if owner.get("processes", 1) > 1:
    job = (f", process 0 of a {owner['processes']}-process job coordinated at "
           f"{owner.get('coordinator')}")
  return (f"process {owner.get('pid')} on host {owner.get('host')}{job}, "
          f"since {owner.get('since')} ({owner.get('command')!r})")


def _read(path: str) -> tuple[dict | None, float | None]:
  """(owner, mtime) of the lock file; (None, None) if there is none."""
  try:
    mtime = os.stat(path).st_mtime
    with open(path) as f:
      owner = json.load(f)
  except FileNotFoundError:
    return None, None
  except (OSError, ValueError):
    return None, mtime
  return (owner if isinstance(owner, dict) else None), mtime


def _probe(directory: str) -> float:
  """Writes and removes a file in `directory`; the file system's time."""
  path = os.path.join(directory, f".jdist-probe-{os.getpid()}-"
                      f"{uuid.uuid4().hex[:8]}")
  with open(path, "w") as f:
    f.write("jdist")
  try:
    return os.stat(path).st_mtime
  finally:
    os.unlink(path)


def _unusable(directory: str, why: str) -> CheckpointDirectoryError:
  return CheckpointDirectoryError(
      f"The checkpoint directory {directory} cannot be used: {why}. Point the "
      "callback at a directory this process can create and write to.")


def _prepare(directory: str) -> None:
  """Creates `directory` if needed and checks this process can write it."""
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise _unusable(directory, "it is a file, not a directory")
  try:
    os.makedirs(directory, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise _unusable(directory, "a part of its path is a file") from None
  except OSError as e:
    raise _unusable(directory, f"it cannot be created ({e.strerror})") from None
  try:
    _probe(directory)
  except OSError as e:
    raise _unusable(directory, f"this process cannot write to it "
                    f"({e.strerror})") from None


def _create(path: str, owner: dict) -> bool:
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, "w") as f:
    json.dump(owner, f)
    f.flush()
    os.fsync(f.fileno())
  return True


def _break(path: str, stale: dict | None) -> None:
  """Removes the lock if it is still the stale one (not a new owner's)."""
  owner, _ = _read(path)
  if (owner or {}).get("token") == (stale or {}).get("token"):
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)


def _note(message: str) -> None:
  print(f"jdist: {message}", file=sys.stderr, flush=True)


def _earlier_attempt(owner: dict, me: dict) -> bool:
  """Whether `owner` is a process of an earlier attempt of `me`'s job."""
  attempt = owner.get("attempt")
  return (me["run"] is not None and owner.get("run") == me["run"] and
          isinstance(attempt, int) and attempt < me["attempt"])


def _in_use(directory: str, owner: dict, me: dict, evidence: str):
  if owner.get("pid") == me["pid"] and owner.get("machine") == me["machine"]:
    who = ("this process, which already writes checkpoints there (another "
           "callback of this fit, or a fit running in another thread)")
  else:
    who = f"another running job: {_describe(owner)}"
  return CheckpointInUseError(
      f"The checkpoint directory {directory} is in use by {who}; {evidence}. "
      "Two jobs writing one directory overwrite each other's checkpoints, and "
      "the first to finish deletes the other's. Give this job its own "
      "directory, or stop the other job first.")


def _take(directory: str, me: dict) -> str:
  """Takes the lock of `directory` for `me`; returns its path."""
  path = os.path.join(directory, LOCK_NAME)
  watched = None  # (token, mtime) of another machine's lock being watched
  while True:
    if _create(path, me):
      return path
    owner, mtime = _read(path)
    if mtime is None:
      continue  # released meanwhile
    age = _probe(directory) - mtime
    if owner is None:  # being written, or not a lock of ours
      if age < _UNREADABLE_GRACE_SECONDS:
        time.sleep(0.1)
        continue
      _note(f"{path} is unreadable and {age:.0f} s old; replacing it.")
      _break(path, None)
      continue
    if _earlier_attempt(owner, me):
      _note(f"{directory} was locked by {_describe(owner)}, in attempt "
            f"{owner['attempt']} of this job, which has ended; taking it over.")
      _break(path, owner)
      continue
    if owner.get("machine") == me["machine"]:
      if _alive(owner.get("pid"), owner.get("pid_start")):
        raise _in_use(directory, owner, me,
                      "that process is running on this machine")
    elif age <= LEASE_SECONDS:
      if watched is not None and watched[0] == owner.get("token") and \
          watched[1] != mtime:
        raise _in_use(directory, owner, me, f"its lock {path} is refreshed by "
                      "its heartbeat")
      if watched is None or watched[0] != owner.get("token"):
        watched = (owner.get("token"), mtime)
        _note(f"{directory} is locked by {_describe(owner)}, on another "
              f"machine, last refreshed {age:.0f} s ago; waiting up to "
              f"{LEASE_SECONDS - age:.0f} s to see whether it still runs.")
      time.sleep(POLL_SECONDS)
      continue
    _note(f"{directory} was locked by {_describe(owner)}, which no longer "
          "runs; taking it over.")
    _break(path, owner)


class DirectoryClaim:
  """This job's claim on a checkpoint directory, from `claim` to `release`
  (`lost`: another job took the lock over, thinking this one dead)."""

  def __init__(self, directory: str, lock_path: str | None = None,
               owner: dict | None = None):
    self.directory = directory
    self.lost = False
    self._path, self._owner = lock_path, owner
    self._stop = threading.Event()
    self._thread = None
    if lock_path is not None:
      self._thread = threading.Thread(target=self._beat, daemon=True,
                                      name="jdist-checkpoint-lock")
      self._thread.start()

  def _ours(self) -> bool:
    owner, _ = _read(self._path)
    return (owner or {}).get("token") == self._owner["token"]

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_SECONDS):
      if not self._ours():
        self.lost = True
        return
      with contextlib.suppress(OSError):
        os.utime(self._path)

  def check(self) -> None:
    """Raises `CheckpointInUseError` if another job took the directory over."""
    if self.lost:
      owner, _ = _read(self._path)
      raise CheckpointInUseError(
          f"Another job took the checkpoint directory {self.directory} over "
          f"while this one ran ({_describe(owner or {})}): this job's lock was "
          f"not refreshed for {LEASE_SECONDS:g} s (was it suspended?). Not "
          "writing there any more: two jobs would overwrite each other.")

  def release(self) -> None:
    """Stops the heartbeat and removes the lock if it is still ours."""
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
    if self._path is not None and not self.lost and self._ours():
      with contextlib.suppress(FileNotFoundError):
        os.unlink(self._path)
    self._path = None

  def remove_directory(self) -> None:
    """Deletes the directory and releases it (the lock goes last)."""
    if self._path is None:  # not the lock holder: process 0 deletes
      self.release()
      return
    for entry in os.listdir(self.directory):
      if entry != LOCK_NAME:
        target = os.path.join(self.directory, entry)
        if os.path.isdir(target) and not os.path.islink(target):
          shutil.rmtree(target, ignore_errors=True)
        else:
          with contextlib.suppress(OSError):
            os.unlink(target)
    self.release()
    with contextlib.suppress(OSError):
      os.rmdir(self.directory)  # fails if a new owner has claimed it since


def claim(directory: str, tidy=None) -> DirectoryClaim:
  """Claims `directory` for this job's checkpoints (every process calls it);
  process 0 runs `tidy(directory)` once it holds the lock.

  Raises:
    jdist.CheckpointDirectoryError: some process cannot write the directory.
    jdist.CheckpointInUseError: another running job owns it.
  """
  runtime = runtime_lib.current()
  problem = lock_path = None
  me = _owner_record(runtime)
  try:
    _prepare(directory)
    if runtime.process_id == 0:
      lock_path = _take(directory, me)
      if tidy is not None:
        tidy(directory)
  except CheckpointDirectoryError as e:
    problem = {"kind": type(e).__name__, "message": str(e)}
  problems = {runtime.process_id: problem} if problem else {}
  if runtime.is_multiprocess:
    key = f"jdist/checkpoint_claim/{runtime.next_sequence('checkpoint_claim')}/"
    values = runtime.exchange(key, json.dumps(problem), timeout=None,
                              what=f"the claim of {directory}")
    problems = {p: json.loads(v) for p, v in values.items() if json.loads(v)}
  if not problems:
    return DirectoryClaim(directory, lock_path, me)
  if lock_path is not None:
    _break(lock_path, me)  # ours: another process cannot use the directory
  process, first = min(problems.items())
  error = (CheckpointInUseError if first["kind"] == "CheckpointInUseError"
           else CheckpointDirectoryError)
  where = (f"Process {process}: " if runtime.is_multiprocess and
           process != runtime.process_id else "")
  raise error(where + first["message"])
