"""The messages a process prints when a peer fails, finishes early or hangs,
each beginning with the error's public name so logs can be searched."""

from __future__ import annotations


def is_runtime_error(error: str) -> bool:
  """Whether an exception summary is a collective's (XLA runtime) error."""
  return error.split(":", 1)[0].endswith(("JaxRuntimeError", "XlaRuntimeError"))


def silent(peers: list, error: str) -> str:
  """`peers` went silent and this process's collective failed."""
  who = ", ".join(f"process {p}" for p in peers)
  verb = "has" if len(peers) == 1 else "have"
  return (f"jdist.PeerFailureError: {who} {verb} stopped responding (probably "
          "killed: out of memory, a scheduler, a crash); this process's "
          f"collective failed as a result ({error.splitlines()[0][:300]}).")


def failure(pid: int, info: dict) -> str:
  """Peer `pid` reported a failure (`info['error']`)."""
  error = info.get("error", "an error").rstrip(".")
  if error.startswith("jdist."):
    cause = f"process {pid} stopped: {error}"
  else:
    cause = f"process {pid} failed with {error}"
  return (f"jdist.PeerFailureError: {cause}. This process cannot continue "
          "without it (its collectives would never complete), so jdist ends it; "
          f"see process {pid}'s output for the cause.")


def ran_fewer_steps(me: int, seq: int, what: str, done: list) -> str:
  """Peers reached the end of their program while `me` waits in step `seq`."""
  ended = ", ".join(f"process {p} (after {i.get('steps', '?')} steps)"
                    for p, i in done)
  return (f"jdist.CollectiveTimeoutError: process {me} waits in "
          f"{describe(seq, what)}, but {ended} already reached the end of its "
          "program. The processes ran different numbers of steps: every process "
          "must call each step the same number of times (give each process the "
          "same number of batches, or use distribute_datasets_from_function, "
          "which keeps them in step).")


def timeout(me: int, num_processes: int, seq: int, what: str, seconds: float,
            beats: dict, exit_code: int) -> str:
  """Step `seq` did not complete in `seconds`; `beats` has peers' progress."""
  behind = sorted(p for p in range(num_processes)
                  if p != me and beats.get(p, {}).get("steps", 0) < seq)
  if behind:
    who = ", ".join(f"process {p} (dispatched {beats.get(p, {}).get('steps', 0)} "
                    "steps)" for p in behind)
    cause = f"Not started there: {who}; they are alive but stuck or busy elsewhere."
  else:
    cause = ("Every process has started it, so a collective inside it did not "
             "complete (a process may be stuck in it).")
  return (f"jdist.CollectiveTimeoutError: {describe(seq, what)} did not complete "
          f"within timeout_seconds={seconds:g} on process {me}. {cause} An XLA "
          "collective cannot be cancelled, so jdist ends this process (exit code "
          f"{exit_code}); the other processes stop too.")


def describe(seq: int, what: str) -> str:
  """"step 4 (train_step)", or the rendezvous `what` names."""
  return what if what.startswith(("the ", "a ")) else f"step {seq} ({what})"


def _at(position: dict | None) -> str:
  if not position:
    return "running (no wait)"
  return describe(position["seq"], position["what"])


def diverged(finding: list) -> str:
  """The message for processes that can never meet (`positions.divergence`),
  without the error's name (a rendezvous raises it)."""
  (me, mine, first), (_, theirs, reason) = finding[0], finding[1]
  if first is None:  # a peer ran another function as this step
    where = (f"process {me} waits in {_at(mine)}, but {reason} (it is now "
             f"{'in ' if theirs else ''}{_at(theirs)})")
  else:
    where = "; ".join(f"process {p} waits in {_at(at)}, {why}"
                      for p, at, why in finding)
  return (f"The processes took different paths and can never meet: {where}. "
          "Every process must call the same steps and iterate the same "
          "distributed datasets, in the same order: look for a loop that one "
          "process leaves early, or code that depends on jax.process_index(). "
          "jdist stops every process (an XLA collective cannot be cancelled).")
