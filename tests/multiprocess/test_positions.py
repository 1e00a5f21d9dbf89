"""When processes that wait count as diverged, and when they do not.

The real-process cases are in test_multiprocess.py; these pin the rules that
keep processes that are merely at different points for a while from being
stopped (the monitor compares the positions every process publishes).
"""

from jdist._src.runtime import messages, positions


def step(seq, name="train_step", waited=3.0, waits_for=()):
  return {"kind": "step", "seq": seq, "what": name, "key": None,
          "waited": waited, "waits_for": list(waits_for)}


def rendezvous(key, seq, waited=3.0, waits_for=()):
  return {"kind": "rendezvous", "seq": seq, "key": key, "waited": waited,
          "what": f"the input agreement of dataset {key}",
          "waits_for": list(waits_for)}


def beat(steps, at=None, runs=None):
  return {"steps": steps, "at": at,
          "runs": runs if runs is not None else [["train_step", 1, steps]]}


def test_two_processes_waiting_at_points_the_other_has_not_reached():
  me = step(6, waits_for=[1])
  beats = {0: beat(7), 1: beat(5, rendezvous("eval/1/", 5, waits_for=[0]))}
  finding = positions.divergence(0, me, beats)
  assert [p for p, _, _ in finding] == [0, 1]
  text = messages.diverged(finding)
  assert ("process 0 waits in step 6 (train_step), which process 1 never "
          "started (it dispatched 5 steps); process 1 waits in the input "
          "agreement of dataset eval/1/, which process 0 has not reached.") in text
  # Process 1 finds the same cycle and describes it the same way.
  mine = dict(beats[1]["at"])
  assert messages.diverged(positions.divergence(
      1, mine, {0: beat(7, me), 1: beats[1]})) == text


def test_a_cycle_through_three_processes():
  beats = {0: beat(4), 1: beat(4, rendezvous("b/", 4, waits_for=[2])),
           2: beat(4, rendezvous("c/", 4, waits_for=[0]))}
  finding = positions.divergence(0, rendezvous("a/", 4, waits_for=[1]), beats)
  assert [p for p, _, _ in finding] == [0, 1, 2]


def test_a_peer_that_ran_another_function_as_this_step():
  runs = [["train_step", 1, 5], ["eval_step", 6, 6]]
  finding = positions.divergence(0, step(6), {0: beat(6), 1: beat(6, None, runs)})
  assert ("process 0 waits in step 6 (train_step), but process 1 ran eval_step "
          "as its step 6 (it is now running (no wait))") in messages.diverged(finding)


def test_processes_that_are_only_apart_for_a_while_are_left_alone():
  slow_peer = {0: beat(6), 1: beat(5)}  # process 1 computes; it will come
  assert positions.divergence(0, step(6, waits_for=[1]), slow_peer) is None
  # Both stalled, but not for each other: process 1 waits in step 7, which
  # process 0 dispatched before it went on to the next input agreement.
  ahead = {0: beat(8), 1: beat(7, step(7, waits_for=[]))}
  assert positions.divergence(
      0, rendezvous("d/2/", 8, waits_for=[1]), ahead) is None
  # Not stalled long enough (yet): a peer that just arrived, or this process.
  fresh = {0: beat(6), 1: beat(5, rendezvous("e/", 5, waited=0.5, waits_for=[0]))}
  assert positions.divergence(0, step(6, waits_for=[1]), fresh) is None
  fresh[1]["at"]["waited"] = 3.0
  assert positions.divergence(0, step(6, waited=1.0, waits_for=[1]), fresh) is None
  # Two processes waiting for a third one that is busy: no cycle.
  busy = {0: beat(3), 1: beat(3, rendezvous("f/", 3, waits_for=[2])), 2: beat(2)}
  assert positions.divergence(0, rendezvous("f/", 3, waits_for=[2]), busy) is None


def test_runs_of_steps():
  runs = []
  for seq, name in enumerate(["a", "a", "a", "b", "a"], start=1):
    positions.record_step(runs, name, seq)
  assert runs == [("a", 1, 3), ("b", 4, 4), ("a", 5, 5)]
  assert [positions.step_name(runs, s) for s in (2, 4, 5, 6)] == ["a", "b", "a",
                                                                 None]
  for seq in range(6, 6 + 2 * positions.RUNS_KEPT):
    positions.record_step(runs, "ab"[seq % 2], seq)
  assert len(runs) == positions.RUNS_KEPT
