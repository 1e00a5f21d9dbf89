"""Where each process waits, and whether the processes can still meet.

Every process of a run must pass the same sequence of meeting points: the
steps it dispatches (each one's collectives need every process) and the
rendezvous outside XLA (the program check of the k-th compilation, the input
agreement of a dataset's iterator). A process that leaves a loop early or runs
process-dependent code takes another path, and then two processes can wait for
each other forever, each at a point the other has not reached.

The monitor publishes its process's *position* in its beat: what it waits in,
for how long, and which peers have not arrived there. The functions here are
pure: from this process's position and its peers' beats they find a wait that
can never end:

* a cycle of stalled processes, each waiting at a point that the next has not
  reached (process 0 in step 6, which process 1 never dispatched; process 1 in
  the input agreement of a new dataset, which process 0 has not reached);
* a peer that ran this process's step under another function (process 0
  waits in step 6, `train_step`; process 1's step 6 was `eval_step`).

Processes are legitimately at different points for a while (one computes
while the other waits for it): only stalled positions count (each waited
`STALL_SECONDS`), and only edges of "has not arrived there", which a peer that
is merely slower does not create.

A position is a dict (it travels as JSON): `kind` ("step" or "rendezvous"),
`seq` (steps dispatched when the wait began), `what` (the step function's
name, or what the rendezvous is for), `key` (a rendezvous' key prefix),
`waited` (seconds) and `waits_for` (the peers that have not arrived).

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
  """Appends step `seq` of function `name` to `runs` ([name, first, last] runs)."""
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
  """The peers that have not arrived where `position` waits.

  Args:
    position: this process's position (without `waits_for`).
    me: this process.
    beats: `{process: beat}` of every process (`steps`: dispatched).
    published: for a rendezvous, the processes whose value is in the store.
  """
  if position["kind"] == "step":
    return sorted(p for p, b in beats.items()
                  if p != me and b.get("steps", 0) < position["seq"])
  return sorted(p for p in beats if p != me and p not in published)


def _stalled(position) -> bool:
  return bool(position) and position.get("waited", 0) >= STALL_SECONDS


def divergence(me: int, position: dict, beats: dict) -> list | None:
  """A wait of `me` that can never end, or None.

  Args:
    me: this process.
    position: where it waits, with `waits_for`.
    beats: `{process: beat}` of every process (`steps`, `runs`, `at`).

  Returns:
    `[(process, position, reason), ...]`: for a cycle, each process waits at
    its position for the next one (the last for the first), `reason` saying
    why the next has not arrived, beginning with the lowest process id; for
    another function at the same step, `me` (reason None) and the peer, whose
    `reason` names the function it ran.
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
  """A path me -> ... -> me along `waits_for` edges between stalled processes."""
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
