"""The processes a `jdist launch` agent starts on its host, one per rank,
their output copied under a `[rank]` prefix."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading

from jdist._src.launcher import job_env

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
TAIL_LINES = 20


def child_env(base: dict, rank: int, n: int, coordinator: str,
              devices_per_process: int | None, *, local_index: int | None = None,
              restart_count: int = 0, max_restarts: int = 0,
              health_file: str | None = None,
              run_id: str | None = None) -> dict:
  """The environment of process `rank` of `n` (`job_env.py`).

  `devices_per_process` K gives it K fake CPU devices, or the accelerators
  K*i..K*i+K-1 with i = `local_index`, its index on its machine.
  """
  env = dict(base)
  env.update({job_env.ENV_COORDINATOR: coordinator,
              job_env.ENV_NUM_PROCESSES: str(n),
              job_env.ENV_PROCESS_ID: str(rank),
              job_env.ENV_RESTART_COUNT: str(restart_count),
              job_env.ENV_MAX_RESTARTS: str(max_restarts),
              "PYTHONUNBUFFERED": "1"})
  if health_file:
    env[job_env.ENV_HEALTH_FILE] = health_file
  if run_id:
    env[job_env.ENV_RUN_ID] = run_id
  k = devices_per_process
  if k:
    i = rank if local_index is None else local_index
    flag = f"--xla_force_host_platform_device_count={k}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    env[job_env.ENV_LOCAL_DEVICE_IDS] = ",".join(
        str(d) for d in range(i * k, i * k + k))
  return env


def die_with_parent():
  """A `preexec_fn` that makes the child die with this thread (Linux only).

  SIGKILL, because a rank may catch anything else (JAX takes SIGTERM); it
  fires when the starting thread ends, so each agent starts its processes
  from the thread that waits for them.
  """
  if not sys.platform.startswith("linux"):
    return None
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None
  prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong,
                    ctypes.c_ulong, ctypes.c_ulong]
  launcher = os.getpid()

  def preexec() -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher:  # the launcher died before prctl took effect
      os._exit(1)

  return preexec


def is_stopped(pid: int) -> bool:
  """Whether `pid` is stopped by a signal (SIGSTOP, a debugger); Linux only."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
  except (OSError, IndexError):
    return False


class RankProcess:
  """One process, with threads copying its output under a `[rank]` prefix."""

  def __init__(self, rank: int, cmd: list, env: dict, lock: threading.Lock,
               preexec=None):
    self.rank = rank
    self.tail = collections.deque(maxlen=TAIL_LINES)
    self.code = None       # exit status, once it ended
    self.ended = None      # when the agent saw it end (wall time)
    self.signalled = False  # the launcher signalled it
    self.stopped = False    # it ended after the launcher signalled it
    self.popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True,
                                  preexec_fn=preexec)
    self.pumps = [
        threading.Thread(target=self._pump, args=(self.popen.stdout, sys.stdout,
                                                  None, lock), daemon=True),
        threading.Thread(target=self._pump, args=(self.popen.stderr, sys.stderr,
                                                  self.tail, lock), daemon=True)]
    for t in self.pumps:
      t.start()

  def _pump(self, stream, out, tail, lock) -> None:
    for raw in iter(stream.readline, b""):
      line = raw.decode(errors="replace").rstrip("\n")
      if tail is not None:
        tail.append(line)
      with lock:
        out.write(f"[{self.rank}] {line}\n")
        out.flush()
    stream.close()

  def poll(self, wall: float) -> int | None:
    """Its exit status, or None while it runs; `wall`: the time now."""
    if self.code is None:
      self.code = self.popen.poll()
      if self.code is not None:
        self.ended, self.stopped = wall, self.signalled
    return self.code

  @property
  def failed(self) -> bool:
    return self.code not in (None, 0)

  def signal(self, sig) -> None:
    if self.popen.poll() is None:
      self.signalled = True
      try:
        os.killpg(self.popen.pid, sig)
      except (ProcessLookupError, PermissionError):
        pass

  def join_output(self, timeout: float = 5.0) -> None:
    for t in self.pumps:
      t.join(timeout=timeout)
