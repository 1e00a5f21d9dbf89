"""Starting real processes on 127.0.0.1 for the multi-process tests.

Every process gets a timeout and is killed (with its process group) in a
`finally`, so a failing test never leaves processes behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from conftest import xla_flags  # the suite's compiler flags
from jdist._src.launcher.agent import WORKDIR_PREFIX

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "worker.py")
PYTHON = sys.executable


@dataclasses.dataclass
class Result:
  returncode: int | None   # None: killed by the harness at its timeout
  stdout: str
  stderr: str
  seconds: float
  ended: float             # wall time (time.time()) when it was seen to end

  @property
  def output(self) -> str:
    return self.stdout + self.stderr


def remove_node_files(pid: int) -> None:
  """Removes the health files' directory of launcher `pid`'s node agent,
  which a launcher killed with SIGKILL (a node taken away) leaves behind
  (the next `jdist launch` on the machine would remove it)."""
  for path in glob.glob(os.path.join(tempfile.gettempdir(),
                                     f"{WORKDIR_PREFIX}{pid}-*")):
    shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
  from jdist._src.launcher.ports import free_port as pick
  return pick()


def base_env(devices: int = 2, **extra) -> dict:
  # (JDIST_TESTS_* stay: a process that imports the tests' conftest, as
  # worker.py's `train_sharded` does, then uses the suite's compilation
  # cache instead of making a directory of its own that it would leave.)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JDIST_", "TF_CONFIG", "XLA_FLAGS"))
         or k.startswith("JDIST_TESTS_")}
  env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]),
             XLA_FLAGS=xla_flags(devices))
  env.update({k: str(v) for k, v in extra.items()})
  return env


def run_processes(cmds_envs, *, timeout: float) -> list:
  """Starts each `(cmd, env)`; waits for all, killing any still alive at `timeout`."""
  procs, outs = [], []
  start = time.monotonic()
  try:
    for cmd, env in cmds_envs:
      out = tempfile.TemporaryFile()
      err = tempfile.TemporaryFile()
      outs.append((out, err))
      procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err,
                                    start_new_session=True, cwd=ROOT))
    ended, walls = [None] * len(procs), [None] * len(procs)
    while any(e is None for e in ended) and time.monotonic() - start < timeout:
      for i, p in enumerate(procs):
        if ended[i] is None and p.poll() is not None:
          ended[i], walls[i] = time.monotonic() - start, time.time()
      time.sleep(0.05)
  finally:
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      p.wait()
      remove_node_files(p.pid)
  results = []
  for p, (out, err), t, wall in zip(procs, outs, ended, walls):
    out.seek(0)
    err.seek(0)
    results.append(Result(p.returncode if t is not None else None,
                          out.read().decode(errors="replace"),
                          err.read().decode(errors="replace"),
                          t if t is not None else timeout,
                          wall if wall is not None else time.time()))
    out.close()
    err.close()
  return results


def run_workers(mode: str, out_dir, *, timeout: float, n: int = 2,
                devices: int = 2, only=None, port=None, **env) -> list:
  """Runs `worker.py mode out_dir` as processes 0..n-1 of one run."""
  port = port or free_port()
  jobs = []
  for rank in (range(n) if only is None else only):
    e = base_env(devices, JDIST_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                 JDIST_NUM_PROCESSES=n, JDIST_PROCESS_ID=rank, **env)
    jobs.append(([PYTHON, WORKER, mode, str(out_dir)], e))
  return run_processes(jobs, timeout=timeout)


def run_launcher(args, *, timeout: float, devices_env: int = 1, **env) -> Result:
  """Runs `python -m jdist.launch *args`."""
  cmd = launcher_cmd(args)
  return run_processes([(cmd, base_env(devices_env, **env))], timeout=timeout)[0]


class Background:
  """A process started in the background; the test reads its output as it
  comes. Use it in a `with`: it is killed (with its process group) on exit."""

  def __init__(self, cmd, env):
    self.out = tempfile.TemporaryFile()
    self.popen = subprocess.Popen(cmd, env=env, stdout=self.out,
                                  stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=ROOT)

  def output(self) -> str:
    self.out.seek(0)
    return self.out.read().decode(errors="replace")

  def wait_for(self, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in self.output():
      if self.popen.poll() is not None or time.monotonic() > deadline:
        raise AssertionError(f"never printed {text!r}:\n{self.output()[-3000:]}")
      time.sleep(0.05)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    if self.popen.poll() is None:
      try:
        os.killpg(self.popen.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.popen.wait()
    remove_node_files(self.popen.pid)
    self.out.close()


def launcher_cmd(args) -> list:
  return [PYTHON, "-m", "jdist.launch", *map(str, args)]


def children(pid: int) -> list:
  """The processes whose parent is `pid` (Linux /proc)."""
  out = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[1]) == pid:
        out.append(int(entry))
  return out


def alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie, waiting to be reaped, has ended)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def wait_gone(pids, timeout: float) -> list:
  """Waits up to `timeout` s for `pids` to end; returns those still alive."""
  deadline = time.monotonic() + timeout
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  return [p for p in pids if alive(p)]


def kill_all(pids) -> None:
  """Kills `pids` and their process groups (test teardown)."""
  for pid in [p for p in pids if alive(p)]:
    for kill in (os.killpg, os.kill):
      try:
        kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def launched(args, ready, *, devices_env: int = 1, **env):
  """`jdist launch *args` in the background, once it printed each of `ready`.

  Yields `(launcher, pids of its processes)`; kills them all on exit (the
  processes too, which may have outlived the launcher).
  """
  ranks = []
  with Background(launcher_cmd(args), base_env(devices_env, **env)) as launcher:
    try:
      for text in ready:
        launcher.wait_for(text, timeout=60)
      ranks = children(launcher.popen.pid)
      yield launcher, ranks
    finally:
      kill_all(ranks)


def hosts_on_one_rendezvous(stack, job_args, n: int = 4) -> list:
  """`n` launchers (`--nnodes 2:n --max-restarts 3`, one device each), one
  per simulated host, on one rendezvous hosted by the first; entered in
  `stack` (a `contextlib.ExitStack`), which ends them. Returns them, the
  host first."""
  args = ["--nnodes", f"2:{n}", "--max-restarts", 3, "--rdzv-endpoint",
          f"127.0.0.1:{free_port()}", "--devices-per-process", 1, *job_args]
  cmd, env = launcher_cmd(args), base_env(1)
  host = stack.enter_context(Background(cmd, env))
  host.wait_for("hosts the job's rendezvous", timeout=60)
  return [host] + [stack.enter_context(Background(cmd, env))
                   for _ in range(n - 1)]
