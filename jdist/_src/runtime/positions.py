"""Where each process waits, and whether the processes can still meet.

Pure functions that find a cycle of processes stalled `STALL_SECONDS`, each
waiting where the next has not arrived, or a peer that ran another function
as this step. A position is a JSON dict (`kind`, `seq`, `what`, `key`,
`waited`, `waits_for`).

Example:
  >>> from jdist._src.runtime import positions
  >>> step = {"kind": "step", "seq": 6, "what": "train", "waited": 3.0}
  >>> agreement = {"kind": "rendezvous", "seq": 5, "key": "k/", "waited": 3.0,
  ...              "what": "the input agreement of dataset d", "waits_for": [0]}
  >>> beats = {0: {"steps": 7}, 1: {"steps": 5, "at": agreement}}
  >>> me = dict(step, waits_for=positions.waits_for(step, 0, beats, set()))
  >>> [(p, at["what"]) for p, at, _ in positions.divergence(0, me, beats)]
  [(0, 'train'), (1, 'the input agreement of dataset d')]
"""

from __future__ import annotations

STALL_SECONDS = 2.0  # a wait this long makes the monitor compare positions
RUNS_KEPT = 8        # step-function runs each process publishes


def record_step(runs: list, name: str, seq: int) -> None:
  """Appends step `seq` of function `name` to `runs` (`(name, first, last)`)."""
  if runs and runs[-1][0] == name and runs[-1][2] == seq - 1:
    runs[-1] = (name, runs[-1][1], seq)
  else:
    runs.append((name, seq, seq))
    del runs[:-RUNS_KEPT]


def step_name(runs, seq: int) -> str | None:
  """The function a process ran as its step `seq`, if its `runs` still say."""
  for name, first, last in runs or ():
    if first <= seq <= last:
      return name
  return None


def waits_for(position: dict, me: int, beats: dict, published: set) -> list:
  """The peers that have not arrived where `position` waits: by their steps
  dispatched (`beats`), or for a rendezvous by the values `published`."""
  if position["kind"] == "step":
    return sorted(p for p, b in beats.items()
                  if p != me and b.get("steps", 0) < position["seq"])
  return sorted(p for p in beats if p != me and p not in published)


def _stalled(position) -> bool:
  return bool(position) and position.get("waited", 0) >= STALL_SECONDS


def divergence(me: int, position: dict, beats: dict) -> list | None:
  """A wait of `me` that can never end, or None.

  Returns:
    `[(process, position, reason), ...]`: for a cycle, each process waiting
    for the next (from the lowest id), with why the next has not arrived; for
    another function at the same step, `me` and the peer that ran it.
  """
  if not _stalled(position):
    return None
  if position["kind"] == "step":
    for p, beat in sorted(beats.items()):
      if p == me:
        continue
      ran = step_name(beat.get("runs"), position["seq"])
      if beat.get("steps", 0) >= position["seq"] and ran not in (
          None, position["what"]):
        return [(me, position, None),
                (p, beat.get("at"), f"process {p} ran {ran} as its step "
                 f"{position['seq']}")]
  at = {p: b.get("at") for p, b in beats.items()
        if p != me and _stalled(b.get("at"))}
  at[me] = position
  path = _cycle(me, at)
  if path is None:
    return None
  first = path.index(min(path))  # every process describes the cycle alike
  path = path[first:] + path[:first]
  out = []
  for i, p in enumerate(path):
    nxt = path[(i + 1) % len(path)]
    out.append((p, at[p], _not_arrived(at[p], nxt, beats.get(nxt))))
  return out


def _cycle(me: int, at: dict) -> list | None:
  """A path me -> ... -> me along `waits_for` edges of stalled processes."""
  stack, seen = [(me, [me])], set()
  while stack:
    p, path = stack.pop()
    for q in at[p].get("waits_for", ()):
      if q == me:
        return path
      if q in at and q not in seen:
        seen.add(q)
        stack.append((q, path + [q]))
  return None


def _not_arrived(position: dict, peer: int, beat: dict | None) -> str:
  if position["kind"] == "step":
    steps = (beat or {}).get("steps", 0)
    return (f"which process {peer} never started (it dispatched {steps} "
            f"step{'s' if steps != 1 else ''})")
  return f"which process {peer} has not reached"
