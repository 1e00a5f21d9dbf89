"""What ended each attempt of a launched job, and the launcher's last words.

`classify` names the one failure that caused the rest.

Example:
  >>> from jdist._src.launcher import failures
  >>> killed = failures.RankRecord(rank=2, code=-9, own=True, ended=1.0)
  >>> peer = failures.RankRecord(rank=0, code=-9, own=False, ended=2.0)
  >>> f = failures.classify(0, 4, [killed, peer])
  >>> f.summary()
  'process 2 of 4 failed (killed by SIGKILL)'
"""

from __future__ import annotations

import dataclasses
import re
import signal

_PEER_FAILURE = re.compile(r"jdist\.PeerFailureError: process (\d+) ")


def describe(code: int) -> str:
  """An exit status in words: "exit code 3", "killed by SIGKILL"."""
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit code {code}"


def exit_code(code: int) -> int:
  """A process's status as a shell's exit code (128 + signal)."""
  return 128 - code if code < 0 else code


@dataclasses.dataclass(frozen=True)
class RankRecord:
  """How one process of an attempt ended, as its agent saw it: its exit
  status (negative: a signal), whether it ended before the launcher
  signalled it (`own`), when, and the end of its error output."""

  rank: int
  code: int
  own: bool
  ended: float
  tail: tuple = ()

  @property
  def failed(self) -> bool:
    return self.code != 0

  def blames(self) -> int | None:
    """The process its `jdist.PeerFailureError` names, if it printed one."""
    for line in reversed(self.tail):
      m = _PEER_FAILURE.search(line)
      if m:
        return int(m.group(1))
    return None

  def asdict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def fromdict(cls, d: dict) -> "RankRecord":
    return cls(**{**d, "tail": tuple(d.get("tail", ()))})


def culprit(records: list) -> RankRecord | None:
  """The process whose failure ended the others.

  SIGKILLed ones first (a broken peer may exit first), then the first whose
  error is not a `jdist.PeerFailureError`, else the one such an error names.

  Example:
    >>> from jdist._src.launcher.failures import RankRecord, culprit
    >>> killed = RankRecord(rank=2, code=-9, own=True, ended=2.0)
    >>> broken = RankRecord(rank=3, code=1, own=True, ended=1.0)
    >>> culprit([broken, killed]).rank
    2
  """
  failed = [r for r in records if r.failed]
  own = sorted((r for r in failed if r.own),
               key=lambda r: (r.code != -signal.SIGKILL, r.ended))
  for r in own:
    if r.blames() is None:
      return r
  by_rank = {r.rank: r for r in records}
  for r in own + failed:
    named = by_rank.get(r.blames())
    if named is not None and named.failed:
      return named
  return (own or failed or [None])[0]


@dataclasses.dataclass(frozen=True)
class Failure:
  """The failure that ended one attempt: `what` happened, the process `rank`
  (or the `node`) at fault, the launcher's exit `code` if the job ends on it,
  and the `tail` of the faulty process's error output."""

  attempt: int
  world: int
  what: str
  rank: int | None = None
  node: str | None = None
  code: int = 1
  tail: tuple = ()

  def summary(self) -> str:
    if self.rank is None:
      return f"node {self.node} {self.what}"
    return f"process {self.rank} of {self.world} failed ({self.what})"

  def asdict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def fromdict(cls, d: dict) -> "Failure":
    return cls(**{**d, "tail": tuple(d.get("tail", ()))})


def classify(attempt: int, world: int, records: list, *, node_lost=None,
             stuck=None, silent=()) -> Failure:
  """The failure that ended an attempt (see the module docstring), from the
  `records` of the processes, a `node_lost` `(node, why)`, the `stuck`
  finding, and the `silent` processes' health."""
  tails = {r.rank: r.tail for r in records}
  if node_lost is not None:
    return Failure(attempt, world, node_lost[1], node=node_lost[0])
  if stuck is not None:
    rank = stuck.ranks[0]
    return Failure(attempt, world, stuck.reason, rank=rank,
                   tail=tails.get(rank, ()))
  if silent:
    worst = max(silent, key=lambda h: h.unresponsive_for)
    return Failure(attempt, world, f"stuck: {worst.describe_silence()}",
                   rank=worst.rank, tail=tails.get(worst.rank, ()))
  r = culprit(records)
  if r is None:
    return Failure(attempt, world, "ended without a cause on record")
  return Failure(attempt, world, describe(r.code), rank=r.rank,
                 code=exit_code(r.code) or 1, tail=r.tail)


def _tail(failure: Failure) -> str:
  return "\n".join(f"  | {line}" for line in failure.tail) or "  | (no error output)"


def restarting(failure: Failure, restart: int, max_restarts: int) -> str:
  """The line printed when a failed attempt is restarted."""
  return (f"jdist launch: attempt {failure.attempt}: {failure.summary()}; "
          f"restarting the job (restart {restart} of at most {max_restarts}).")


def completed(failures: list) -> str:
  """The line printed when a job that was restarted completes."""
  n = len(failures)
  each = "; ".join(f"attempt {f.attempt}: {f.summary()}" for f in failures)
  return (f"jdist launch: the job completed after {n} restart"
          f"{'s' if n != 1 else ''} ({each}).")


def final(failures: list, max_restarts: int, why: str | None = None) -> str:
  """The one message that ends a failed job, naming each failure (`why`: why
  the job cannot go on, if not because the restarts ran out)."""
  last = failures[-1] if failures else None
  if (len(failures) == 1 and max_restarts == 0 and why is None and
      last.rank is not None):
    return (f"jdist launch: {last.summary()}; the other processes were "
            f"stopped. The end of its error output:\n{_tail(last)}")
  head = why or (
      f"the job failed {len(failures)} times, and --max-restarts "
      f"{max_restarts} allows {max_restarts} restart"
      f"{'s' if max_restarts != 1 else ''}")
  lines = [f"jdist launch: {head}."]
  if failures:
    lines.append("Each failure:")
    lines += [f"  attempt {f.attempt}: {f.summary()}" for f in failures]
  if last is not None and last.rank is not None:
    lines.append(f"The end of process {last.rank}'s error output in attempt "
                 f"{last.attempt}:\n{_tail(last)}")
  return "\n".join(lines)
