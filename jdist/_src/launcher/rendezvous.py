"""The rendezvous of an elastic job: which nodes run each attempt, and when
it ends.

A state machine of the agents' requests and a clock, no sockets or threads.
Each attempt goes gathering (until `max_nodes`, or `min_nodes` and
`last_call`), running (process ids in join order), stopping (restart with
the nodes left, or end past `max_restarts`).

Example:
  >>> from jdist._src.launcher import rendezvous
  >>> spec = rendezvous.JobSpec(min_nodes=1, max_nodes=2, max_restarts=0,
  ...                           command=("train.py",))
  >>> r = rendezvous.Rendezvous(spec, run_id="7f3a")
  >>> a = r.hello(spec.asdict(), "10.0.0.1", nproc=1)["member"]
  >>> b = r.hello(spec.asdict(), "10.0.0.2", nproc=1)["member"]
  >>> _ = r.join(a, port=1234); view = r.join(b, port=4321)
  >>> view["phase"], view["run"]
  ('running', {'first_rank': 1, 'nproc': 1, 'world': 2, 'coordinator': '10.0.0.1:1234', 'nodes': 2, 'run_id': '7f3a'})
  >>> r.version  # one change of phase: gathering -> running
  1
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Callable

from jdist._src.launcher import failures
from jdist._src.launcher import health

LAST_CALL_SECONDS = 30.0
JOIN_TIMEOUT_SECONDS = 600.0
STUCK_TIMEOUT_SECONDS = 60.0
NODE_TIMEOUT_SECONDS = 15.0  # at least: a node that does not ask for so long is gone


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """What every node of a job must agree on."""

  min_nodes: int
  max_nodes: int
  max_restarts: int
  command: tuple

  def asdict(self) -> dict:
    return {**dataclasses.asdict(self), "command": list(self.command)}


@dataclasses.dataclass
class _Member:
  id: int
  address: str
  nproc: int
  seen: float
  port: int | None = None
  joined: bool = False
  health: list = dataclasses.field(default_factory=list)
  health_at: float = 0.0        # when it was reported
  gone: str | None = None       # why it left
  told_end: bool = False


class Rendezvous:
  """The state of an elastic job (see the module docstring); `clock` gives
  monotonic seconds, `run_id` names every attempt (default: random)."""

  def __init__(self, spec: JobSpec, *, last_call: float = LAST_CALL_SECONDS,
               join_timeout: float = JOIN_TIMEOUT_SECONDS,
               stuck_timeout: float = STUCK_TIMEOUT_SECONDS,
               clock: Callable[[], float] = time.monotonic,
               run_id: str | None = None):
    self.spec = spec
    # One name for every attempt of the job (torchrun's run id): what an
    # earlier attempt left (a checkpoint directory's lock) is known as ours.
    self.run_id = run_id or uuid.uuid4().hex[:16]
    self._last_call = last_call
    self._join_timeout = join_timeout
    self._stuck_timeout = stuck_timeout
    self._node_timeout = max(stuck_timeout, NODE_TIMEOUT_SECONDS)
    self._clock = clock
    self._members: dict = {}
    self.attempt = 0
    self.phase = "gathering"
    self._round: list = []          # member ids, in rank order
    self._gathering_since = clock()
    self._minimum_since = None
    self._cause: dict = {}          # why the attempt stops (classify's keywords)
    self._records: dict = {}        # member -> how its processes ended
    self._failing: set = set()      # members that reported a failure
    self.failures: list = []
    self.end: dict | None = None
    self.version = 0                # counts the changes of phase

  # --- requests ---------------------------------------------------------------

  def hello(self, spec: dict, address: str, nproc: int) -> dict:
    """A node introduces itself; returns `{"member": id}` or `{"error": ...}`."""
    if spec != self.spec.asdict():
      return {"error": (
          f"this rendezvous runs another job ({_describe(self.spec.asdict())}); "
          f"this node was started for {_describe(spec)}. Start every node with "
          "the same command, and give each job its own --rdzv-endpoint.")}
    if self.end is not None:
      return {"error": "this job has ended."}
    member = _Member(len(self._members), address, int(nproc), self._clock())
    self._members[member.id] = member
    return {"member": member.id}

  def join(self, member: int, port: int) -> dict:
    """The node is ready for the next attempt, offering its coordinator port."""
    m = self._touch(member)
    m.port, m.joined, m.health = port, True, []
    return self.view(member)

  def poll(self, member: int, health_reports: list, failing: bool) -> dict:
    """The node's processes' health (`RankHealth` dicts); what it should do."""
    m = self._touch(member)
    m.health = [health.RankHealth(**h) for h in health_reports]
    m.health_at = m.seen
    if failing and member in self._round:
      self._failing.add(member)
    return self.view(member)

  def finish(self, member: int, attempt: int, records: list) -> dict:
    """Every process of the node ended; `records`: `RankRecord` dicts."""
    m = self._touch(member)
    m.health = []
    if attempt == self.attempt and member in self._round:
      self._records[member] = [failures.RankRecord.fromdict(r) for r in records]
    return self.view(member)

  def leave(self, member: int, why: str) -> None:
    """The node leaves the job (its connection closed, or it was stopped)."""
    m = self._members.get(member)
    if m is not None and m.gone is None:
      m.gone, m.joined = why, False
    self.advance()

  def heard(self, member: int) -> None:
    """The node sent a request: it is alive."""
    self._touch(member)

  def view(self, member: int) -> dict:
    """What a node should do now."""
    self.advance()
    m = self._members[member]
    if self.end is not None:
      m.told_end = True
    mine = member in self._round and self.phase in ("running", "stopping")
    return {"phase": self.phase, "attempt": self.attempt,
            "version": self.version,
            "run": self._assignment(member) if mine else None,
            "stop": mine and self.phase == "stopping",
            "failures": [f.asdict() for f in self.failures], "end": self.end,
            "gone": m.gone}

  def unneeded(self) -> bool:
    """Whether the rendezvous has nothing left to tell: every live node saw how
    the job ended, or the job has no end to tell."""
    return self.end is None or all(m.told_end for m in self._live())

  # --- transitions --------------------------------------------------------------

  def advance(self) -> None:
    """Moves the job on: call it after each request (and from time to time)."""
    now = self._clock()
    for m in self._live():
      if now - m.seen > self._node_timeout:
        m.gone, m.joined = f"stopped answering for {now - m.seen:.0f} s", False
    if self.phase == "gathering":
      self._gather(now)
    elif self.phase == "running":
      self._watch()
    if self.phase == "stopping":
      self._settle()

  def _gather(self, now: float) -> None:
    live = self._live()
    joined = [m for m in live if m.joined]
    lo, hi = self.spec.min_nodes, self.spec.max_nodes
    if len(joined) < lo:
      self._minimum_since = None
      if now - self._gathering_since >= self._join_timeout:
        self._finish_job(1, (
            f"the job cannot go on: {len(joined)} node"
            f"{'s' if len(joined) != 1 else ''} joined attempt {self.attempt}, "
            f"fewer than the minimum of {lo} (--nnodes {lo}:{hi}), and no "
            f"other joined within --join-timeout {self._join_timeout:g} s"))
      return
    if self._minimum_since is None:
      self._minimum_since = now
    restart_ready = self.attempt > 0 and len(joined) == len(live)
    if (len(joined) >= hi or restart_ready or
        now - self._minimum_since >= self._last_call):
      self._start(joined[:hi])

  def _start(self, members: list) -> None:
    self._round = [m.id for m in members]
    for m in members:
      m.joined = False
    self.phase, self._cause = "running", {}
    self._records, self._failing = {}, set()
    self.version += 1

  def _watch(self) -> None:
    members = [self._members[i] for i in self._round]
    lost = next((m for m in members if m.gone), None)
    if lost is not None:
      ranks = list(self._ranks_of(lost))
      which = (f"process{'es' if len(ranks) > 1 else ''} "
               f"{', '.join(str(r) for r in ranks)}")
      self._stop(node_lost=(f"{lost.id} ({lost.address}, {which})",
                            f"went away ({lost.gone})"))
    elif self._failing or any(r.failed for rs in self._records.values()
                              for r in rs):
      self._stop()
    elif len(self._records) == len(members):
      self._finish_job(0, failures.completed(self.failures)
                       if self.failures else None)
    else:
      found = health.judge(self._health_now(), self._stuck_timeout)
      if found is not None:
        self._stop(stuck=found)

  def _health_now(self) -> list:
    """Every process's last report, aged to now."""
    now = self._clock()
    return [h.aged(now - m.health_at) for m in
            (self._members[i] for i in self._round) for h in m.health]

  def _stop(self, **cause) -> None:
    """Stops the attempt, remembering the processes silent at this moment."""
    silent = [h for h in self._health_now()
              if h.unresponsive_for >= min(health.SILENT_SECONDS,
                                           self._stuck_timeout)]
    self._cause = {**cause, "silent": tuple(silent)}
    self.phase = "stopping"
    self.version += 1

  def _settle(self) -> None:
    members = [self._members[i] for i in self._round]
    if any(m.id not in self._records and not m.gone for m in members):
      return
    records = [r for rs in self._records.values() for r in rs]
    world = sum(m.nproc for m in members)
    failure = failures.classify(self.attempt, world, records, **self._cause)
    self.failures.append(failure)
    self._round = []
    if len(self.failures) > self.spec.max_restarts:
      self._finish_job(failure.code, None)
      return
    self.attempt += 1
    self.phase, self._gathering_since = "gathering", self._clock()
    self._minimum_since = None
    self.version += 1

  def _finish_job(self, code: int, message: str | None) -> None:
    if code != 0:
      message = failures.final(self.failures, self.spec.max_restarts, message)
    self.phase, self._round = "ended", []
    self.end = {"code": code, "message": message}
    self.version += 1

  # --- helpers ------------------------------------------------------------------

  def _touch(self, member: int) -> _Member:
    m = self._members[member]
    m.seen = self._clock()
    return m

  def _live(self) -> list:
    return [m for m in self._members.values() if m.gone is None]

  def _ranks_of(self, member: _Member) -> range:
    first = 0
    for i in self._round:
      if i == member.id:
        return range(first, first + member.nproc)
      first += self._members[i].nproc
    return range(0)

  def _assignment(self, member: int) -> dict:
    first = self._members[self._round[0]]
    return {"first_rank": self._ranks_of(self._members[member]).start,
            "nproc": self._members[member].nproc,
            "world": sum(self._members[i].nproc for i in self._round),
            "coordinator": f"{first.address}:{first.port}",
            "nodes": len(self._round), "run_id": self.run_id}


def _describe(spec: dict) -> str:
  command = " ".join(spec.get("command", ()))
  return (f"--nnodes {spec.get('min_nodes')}:{spec.get('max_nodes')} "
          f"--max-restarts {spec.get('max_restarts')} {command}")
