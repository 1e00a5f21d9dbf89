"""Health reports as the agent reads them: whether a launched process lives,
and where it waits.

Each process rewrites its file ten times a second; `judge` finds a process
silent, stopped or absent where the others waited for `--stuck-timeout`.

Example:
  >>> from jdist._src.launcher import health
  >>> stopped = health.RankHealth(rank=2, silent_for=8.0, steps=31)
  >>> waiting = health.RankHealth(rank=0, silent_for=0.2, steps=32,
  ...     wait={"kind": "step", "seq": 32, "what": "step", "waited": 8.0})
  >>> health.judge([waiting, stopped], timeout=6.0).ranks
  (2,)
"""

from __future__ import annotations

import dataclasses
import json

# A live process silent this long when a peer fails is taken for the cause
# (JAX's heartbeats end the peers of a stopped process after 10 s).
SILENT_SECONDS = 5.0
# Ten beats missed (a process beats every 0.1 s): it is not running now
# (stopped, frozen).
UNRESPONSIVE_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class RankHealth:
  """The agent's view of one process: seconds since its beat moved and since
  it was stopped by a signal, steps dispatched (None: no beat yet), and
  where it waits (`{"kind", "seq", "what", "waited"}`) or None."""

  rank: int
  silent_for: float | None = None
  stopped_for: float | None = None
  steps: int | None = None
  wait: dict | None = None

  def asdict(self) -> dict:
    return dataclasses.asdict(self)

  def aged(self, seconds: float) -> "RankHealth":
    """This report as it stands `seconds` after it was made."""
    later = lambda t: None if t is None else round(t + seconds, 2)
    wait = self.wait and dict(self.wait, waited=self.wait["waited"] + seconds)
    return dataclasses.replace(self, silent_for=later(self.silent_for),
                               stopped_for=later(self.stopped_for), wait=wait)

  @property
  def unresponsive_for(self) -> float:
    """How long it could not have acted on anything (silent or stopped)."""
    return max(self.silent_for or 0.0, self.stopped_for or 0.0)

  def describe_silence(self) -> str:
    how = ("stopped by a signal (SIGSTOP or a debugger)"
           if self.stopped_for is not None else "no sign of life")
    return f"{how} for {self.unresponsive_for:.1f} s{_after(self.steps)}"


def _after(steps: int | None) -> str:
  if steps is None:
    return ", before it joined the job"
  return f", last seen after {steps} step{'s' if steps != 1 else ''}"


class Watch:
  """What the agent remembers of one process's health file between reads."""

  def __init__(self, rank: int, path: str):
    self.rank = rank
    self.path = path
    self._beat = None
    self._moved = None        # monotonic time the beat last changed
    self._stopped_since = None
    self._last = {}

  def read(self, now: float, stopped: bool) -> RankHealth:
    """Reads the file; `stopped`: the process is stopped by a signal now."""
    try:
      with open(self.path) as f:
        self._last = json.loads(f.read())
    except (OSError, ValueError):
      pass  # not written yet, or being replaced: keep the last one
    if self._last.get("left"):  # out of the job's runtime: nothing to judge
      return RankHealth(rank=self.rank)
    beat = self._last.get("n")
    if beat is not None and beat != self._beat:
      self._beat, self._moved = beat, now
    if not stopped:
      self._stopped_since = None
    elif self._stopped_since is None:
      self._stopped_since = now
    wait = self._last.get("wait")
    if wait is not None and self._moved is not None:
      wait = dict(wait, waited=wait.get("waited", 0.0) + now - self._moved)
    return RankHealth(
        rank=self.rank,
        silent_for=None if self._moved is None else round(now - self._moved, 2),
        stopped_for=(None if self._stopped_since is None
                     else round(now - self._stopped_since, 2)),
        steps=self._last.get("steps"), wait=wait)


@dataclasses.dataclass(frozen=True)
class Finding:
  """Processes found stuck: `ranks`, and what each `reason` says."""

  ranks: tuple
  reason: str


def judge(ranks: list, timeout: float) -> Finding | None:
  """The first `Finding` of a stuck process among every process's latest
  health (silent ones first: the others wait for them), or None."""
  for r in sorted(ranks, key=lambda r: r.rank):
    if r.unresponsive_for >= timeout:
      return Finding((r.rank,), f"stuck: {r.describe_silence()}")
  waiting = [r for r in ranks if r.wait and r.wait.get("waited", 0) >= timeout]
  if not waiting:
    return None
  longest = max(waiting, key=lambda r: r.wait["waited"])
  wait = longest.wait
  where = (f"step {wait['seq']} ({wait['what']})" if wait["kind"] == "step"
           else f"{wait['what']}")
  waiters = sorted(r.rank for r in ranks if r.wait and _same_place(r.wait, wait))
  absent = sorted((r for r in ranks if r.rank not in waiters), key=lambda r: r.rank)
  if wait["kind"] == "step":
    absent = [r for r in absent if (r.steps or 0) < wait["seq"]] or absent
  waited = f"{wait['waited']:.1f} s"
  frozen = [r for r in absent if r.unresponsive_for >= UNRESPONSIVE_SECONDS]
  if frozen:  # its own silence reached the timeout in a report not yet sent
    return Finding((frozen[0].rank,), f"stuck: {frozen[0].describe_silence()}")
  if absent:
    return Finding(tuple(r.rank for r in absent), (
        f"stuck: did not reach {where}, where process"
        f"{'es' if len(waiters) > 1 else ''} {_ranks(waiters)} waited {waited} "
        f"for it; it is alive, busy or blocked elsewhere{_after(absent[0].steps)}"
        ))
  return Finding(tuple(waiters), (
      f"stuck: every process waited {waited} in {where}, which all of them "
      "started: a collective inside it does not complete"))


def _same_place(a: dict, b: dict) -> bool:
  return a["kind"] == b["kind"] and a["seq"] == b["seq"] and a["what"] == b["what"]


def _ranks(ranks) -> str:
  return ", ".join(str(r) for r in ranks)
