"""The agent of one node (a host; on one machine `jdist launch` simulates
several): starts its processes for each attempt, reports their health, and
stops them when the attempt stops.

Processes may be blocked in collectives that never return: they get
`SETTLE_SECONDS` to end on their own; then one a signal cannot reach
(stopped, silent, or waiting for its peers) is killed, and the others get
SIGINT and are killed after `--grace-period`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable

from jdist._src.launcher import failures
from jdist._src.launcher import health
from jdist._src.launcher import liveness
from jdist._src.launcher import ports
from jdist._src.launcher import ranks
from jdist._src.launcher.rendezvous_tcp import Client, RendezvousError

WORKDIR_PREFIX = "jdist-node-"  # + the launcher's pid: its processes' health files
_WORKDIR = re.compile(re.escape(WORKDIR_PREFIX) + r"(\d+)-\w+")
SETTLE_SECONDS = 1.0     # after a failure, for the others to end on their own
POLL_SECONDS = 0.05      # the agent looks at its processes this often
REPORT_SECONDS = 0.2     # and reports to the rendezvous this often


@dataclasses.dataclass(frozen=True)
class Node:
  """How a node runs its processes: their command, how many, the machine-local
  index of the first (for its devices), the launcher's options, and the
  coordinator port it offers (None: a free one each attempt)."""

  cmd: tuple
  nproc: int
  local_index: int = 0
  devices_per_process: int | None = None
  port: int | None = None
  grace: float = 10.0
  max_restarts: int = 0


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How an agent's part of the job ended: the rendezvous' `end`, the signal
  that `interrupted` the launcher and the processes `killed` after the grace
  period, the `error` that stopped this node, and the job's `run_id`."""

  end: dict | None = None
  interrupted: int | None = None
  killed: tuple = ()
  error: str | None = None
  run_id: str | None = None


class Agent:
  """Runs one node's processes for each attempt of the job.

  `client` has said hello to the rendezvous; `interrupts` holds the signals
  the launcher received; `lock` serialises its output; `notify` is called
  with each view of the job (the launcher prints restarts).
  """

  def __init__(self, client: Client, node: Node, interrupts: list,
               lock: threading.Lock, notify: Callable[[dict], None]):
    self._client = client
    self._node = node
    self._interrupts = interrupts
    self._lock = lock
    self._notify = notify
    self._procs: list = []
    self._preexec = ranks.die_with_parent()
    self._lost: RendezvousError | None = None
    self._run_id: str | None = None

  def run(self) -> Outcome:
    """Takes part in attempts until the job ends; never leaves a process."""
    _remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    try:
      outcome = self._attempts(workdir)
    except RendezvousError as e:
      outcome = Outcome(error=str(e))
    finally:
      for p in self._procs:
        p.signal(signal.SIGKILL)
      shutil.rmtree(workdir, ignore_errors=True)
      self._client.close()  # to the rendezvous, this node has gone
    return dataclasses.replace(outcome, run_id=self._run_id)

  def _attempts(self, workdir: str) -> Outcome:
    done = -1
    view = self._join()
    while True:
      self._notify(view)
      if view["end"] is not None:
        return Outcome(end=view["end"])
      if view["gone"]:
        return Outcome(error=f"the rendezvous dropped this node: it {view['gone']}")
      if self._interrupts:
        return self._leave(self._interrupts[0], ())
      run = view["run"]
      if run and view["attempt"] > done:
        done = view["attempt"]
        self._run_id = run.get("run_id") or self._run_id
        # Stopped before this node saw it run (a peer failed at once): no
        # process to start, nothing to report but that.
        records, interrupted = (([], False) if view["stop"] else
                                self._run_attempt(done, run, workdir))
        view = self._client.request(
            "finish", attempt=done, records=[r.asdict() for r in records])
        if interrupted:
          killed = tuple(r.rank for r in records if r.code == -signal.SIGKILL)
          return self._leave(self._interrupts[0], killed)
        if view["end"] is None:
          view = self._join()
        continue
      view = self._client.request("view", since=view["version"])

  def _join(self) -> dict:
    return self._client.request("join", port=self._node.port or ports.free_port())

  def _leave(self, sig: int, killed: tuple) -> Outcome:
    name = signal.Signals(sig).name
    self._client.request("leave", why=f"its launcher was stopped by {name}")
    return Outcome(interrupted=sig, killed=killed)

  # --- one attempt ----------------------------------------------------------------

  def _run_attempt(self, attempt: int, run: dict, workdir: str):
    """Runs the node's processes of `attempt`; returns (records, interrupted)."""
    node, first = self._node, run["first_rank"]
    self._procs, watches = [], []
    for i in range(run["nproc"]):
      rank = first + i
      path = os.path.join(workdir, f"{attempt}-{rank}.json")
      env = ranks.child_env(
          os.environ, rank, run["world"], run["coordinator"],
          node.devices_per_process, local_index=node.local_index + i,
          restart_count=attempt, max_restarts=node.max_restarts,
          health_file=path, run_id=run.get("run_id"))
      self._procs.append(ranks.RankProcess(rank, list(node.cmd), env,
                                           self._lock, self._preexec))
      watches.append(health.Watch(rank, path))
    interrupted = self._supervise(watches)
    for p in self._procs:
      p.join_output()
    if self._lost is not None:
      raise self._lost
    records = [failures.RankRecord(p.rank, p.code, not p.stopped, p.ended,
                                   tuple(p.tail)) for p in self._procs]
    self._procs = []
    return records, interrupted

  def _supervise(self, watches: list) -> bool:
    """Waits for the processes, stopping them when told; True if interrupted."""
    stop = _Stop(self._node.grace)
    last_report, reported_own, forwarded, latest = 0.0, False, 0, {}
    while True:
      now, wall = time.monotonic(), time.time()
      running = [p for p in self._procs if p.poll(wall) is None]
      if not running:
        return forwarded > 0
      own = any(p.failed and not p.stopped for p in self._procs)
      due = now - last_report >= REPORT_SECONDS or (own and not reported_own)
      if self._lost is None and due:
        latest = {w.rank: w.read(now, ranks.is_stopped(p.popen.pid))
                  for w, p in zip(watches, self._procs) if p.code is None}
        if self._report(list(latest.values()), own):
          stop.request(now)
        last_report, reported_own = now, own
      if own:
        stop.request(now)
      if len(self._interrupts) > forwarded:
        forwarded = len(self._interrupts)
        stop.forward(running, self._interrupts[-1], forwarded, now)
      stop.act(running, latest, now)
      time.sleep(POLL_SECONDS)

  def _report(self, healths: list, failing: bool) -> bool:
    """Sends the health; returns whether the attempt must stop."""
    try:
      view = self._client.request(
          "poll", health_reports=[h.asdict() for h in healths], failing=failing)
    except RendezvousError as e:
      self._lost = e  # nobody to report to: stop, then `run` says why
      return True
    self._notify(view)
    return bool(view["stop"] or view["end"] or view["gone"])


class _Stop:
  """When to signal which process, once an attempt must stop."""

  def __init__(self, grace: float):
    self.grace = grace
    self._settle_at = None
    self._kill_at = None
    self._requested = False

  def request(self, now: float) -> None:
    if not self._requested:
      self._requested = True
      self._settle_at = now + SETTLE_SECONDS

  def forward(self, running: list, sig: int, count: int, now: float) -> None:
    for p in running:  # Ctrl-C twice kills; SIGTERM lets JAX's preemption run
      p.signal(signal.SIGKILL if count > 1 else sig)
    self._requested = True
    self._kill_at = min(self._kill_at or float("inf"), now + self.grace)

  def act(self, running: list, latest: dict, now: float) -> None:
    if self._settle_at is not None and now >= self._settle_at:
      self._settle_at = None
      for p in running:
        p.signal(signal.SIGKILL if _cannot_act(latest.get(p.rank))
                 else signal.SIGINT)
      self._kill_at = min(self._kill_at or float("inf"), now + self.grace)
    if self._kill_at is not None and now >= self._kill_at:
      self._kill_at = None
      for p in running:
        p.signal(signal.SIGKILL)


def _remove_stale_workdirs() -> None:
  """Removes the health files of killed launchers (named by their pid)."""
  root = tempfile.gettempdir()
  for name in os.listdir(root):
    m = _WORKDIR.fullmatch(name)
    path = os.path.join(root, name)
    try:
      if m is None or not os.path.isdir(path) or \
          os.stat(path).st_uid != os.getuid():
        continue
    except FileNotFoundError:  # its launcher removed it as it ended
      continue
    if not liveness.pid_exists(int(m.group(1))):
      shutil.rmtree(path, ignore_errors=True)


def _cannot_act(h: health.RankHealth | None) -> bool:
  """Whether a signal and the grace period can do nothing for a process: it is
  stopped or silent, or it waits for peers that stopped (inside XLA it never
  sees the signal)."""
  if h is None:
    return False
  return h.wait is not None or h.unresponsive_for >= health.UNRESPONSIVE_SECONDS
