"""A per-process watchdog that turns multi-process hangs into errors.

XLA collectives cannot be cancelled: a process whose peer failed, finished
early or got stuck waits forever. Twice a second the monitor compares this
process's wait with its peers' reports in the key-value store. A rendezvous
outside XLA raises the error in the main thread; a process blocked inside
XLA is ended with the error printed and `os._exit(1)` (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Any, Callable

from jdist._src.runtime import messages
from jdist._src.runtime import positions
from jdist._src.runtime.positions import STALL_SECONDS

TICK_SECONDS = 0.5
LINGER_SECONDS = 3.0    # process 0 hosts the store: it waits for peers to read
EXIT_CODE = 1
REPORT_CHARS = 1000     # of an error's first line, published to the peers


class _Flag:
  """A wait that is not a device computation (a key-value rendezvous)."""

  __slots__ = ("ready", "key")

  def __init__(self, key: str | None):
    self.ready = False
    self.key = key

  def is_ready(self) -> bool:
    return self.ready


def _is_ready(probe) -> bool:
  try:
    return probe.is_ready()
  except Exception:  # deleted (donated to a later step): that step is tracked
    return True


class Monitor:
  """Watches this process's waits and its peers' reports."""

  def __init__(self, client_fn: Callable[[], Any], process_id: int,
               num_processes: int, *, tick: float = TICK_SECONDS):
    self._client_fn = client_fn
    self.process_id = process_id
    self.num_processes = num_processes
    self._tick = tick
    self.dispatched = 0         # steps this process has dispatched
    self._wait = None           # (seq, what, started, probe, timeout)
    self._previous = None       # the wait before it
    self._beats = 0
    self._dead = set()          # peers found dead: process 0 need not wait
    self._ending = False
    # A peer's failure, for a rendezvous of the main thread to raise.
    self.peer_failure: str | None = None
    # Positions that can never meet, for a rendezvous of the main thread to raise.
    self.diverged: str | None = None
    self._runs = []             # [(step function, first, last)] (positions.py)
    self._suspect = None        # a divergence seen once, confirmed at the next tick
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, name="jdist-monitor",
                                    daemon=True)
    self._thread.start()

  # --- called by the main thread --------------------------------------------

  def track_step(self, what: str, probe, timeout: float | None) -> None:
    """Records a dispatched step whose output `probe` is ready at its end."""
    self.dispatched += 1
    positions.record_step(self._runs, what, self.dispatched)
    # Steps run in order; with step k+1 dispatched, step k may still run.
    self._previous = self._wait
    self._wait = (self.dispatched, what, time.monotonic(), probe, timeout)

  @contextlib.contextmanager
  def waiting(self, what: str, key: str | None = None):
    """Marks a rendezvous outside XLA on `key` (+ each process's id), for `what`
    (the caller enforces its own timeout)."""
    flag, saved = _Flag(key), (self._previous, self._wait)
    self._previous = None
    self._wait = (self.dispatched, what, time.monotonic(), flag, None)
    try:
      yield
    finally:
      flag.ready = True
      self._previous, self._wait = saved

  def health(self) -> dict:
    """Steps dispatched and the wait this process is in, for the health file
    (read from another thread: only fields replaced whole)."""
    wait = self._blocking_wait()
    at = None
    if wait is not None:
      seq, what, started, probe, _ = wait
      at = {"kind": "rendezvous" if isinstance(probe, _Flag) else "step",
            "seq": seq, "what": what,
            "waited": round(time.monotonic() - started, 2)}
    return {"steps": self.dispatched, "wait": at, "ending": self._ending}

  def _blocking_wait(self):
    """The oldest unfinished wait: the one that blocks this process."""
    return next((w for w in (self._previous, self._wait)
                 if w is not None and not _is_ready(w[3])), None)

  @property
  def ending(self) -> bool:
    """Whether this process is being ended (by the monitor or an error)."""
    return self._ending

  def finish(self) -> None:
    """Tells the peers this process reached the end of its program."""
    self._wait = self._previous = None
    self._set(f"jdist/done/{self.process_id}",
              json.dumps({"steps": self.dispatched}))

  def stop(self) -> None:
    """Stops the thread and waits for it (after the runtime shut down): a thread
    inside the runtime's client at interpreter exit aborts the process."""
    self._stop.set()
    if threading.current_thread() is not self._thread:
      self._thread.join(timeout=10 * self._tick)

  def fail(self, error: str) -> None:
    """Reports this process's uncaught error to the peers and ends the process;
    names the peer instead when one failed first or went silent."""
    if not self._begin_end():
      return
    try:
      failed = self._reports(self._client_fn(), "failed")
      if not failed and messages.is_runtime_error(error):
        silent = self._silent_peers()
        failed = self._reports(self._client_fn(), "failed")
        self._dead.update(silent)
        if silent and not failed:
          error = messages.silent(silent, error)
          print(error, file=sys.stderr)
      if failed and failed[0][1].get("error") != error.splitlines()[0][:REPORT_CHARS]:
        print(messages.failure(*failed[0]), file=sys.stderr)
      self._publish("ack" if failed else "failed", error)
    finally:
      self._exit()

  def _silent_peers(self) -> list:
    """Peers whose beat does not move over a few ticks (presumably dead)."""
    client = self._client_fn()
    before = dict(self._reports(client, "beat"))
    time.sleep(3 * self._tick)
    after = dict(self._reports(client, "beat"))
    done = dict(self._reports(client, "done"))
    return [p for p in range(self.num_processes)
            if p != self.process_id and p not in done and
            after.get(p, {}).get("n") == before.get(p, {}).get("n")]

  # --- the thread -------------------------------------------------------------

  def _run(self) -> None:
    while not self._stop.wait(self._tick):
      if self._client_fn() is None:
        return  # the distributed runtime was shut down
      try:
        self._tick_once()
      except Exception:  # the runtime is going away; nothing left to watch
        if self._client_fn() is None:
          return

  def _tick_once(self) -> None:
    client = self._client_fn()
    if client is None:
      return
    wait = self._blocking_wait()
    stalled = (wait is not None and not self._ending and
               time.monotonic() - wait[2] >= STALL_SECONDS)
    beats = dict(self._reports(client, "beat")) if stalled else {}
    at = self._position(client, wait, beats) if stalled else None
    # Beat even while ending: the peers must not take this process for dead.
    self._beats += 1
    mine = {"n": self._beats, "steps": self.dispatched,
            "runs": list(self._runs), "at": at}
    self._set(f"jdist/beat/{self.process_id}", json.dumps(mine))
    if not self._ending:
      self._check(client, wait, at, {**beats, self.process_id: mine})

  def _position(self, client, wait, beats: dict) -> dict:
    """Where this process waits (`positions.py`), with who has not arrived."""
    seq, what, started, probe, _ = wait
    rendezvous = isinstance(probe, _Flag)
    at = {"kind": "rendezvous" if rendezvous else "step", "seq": seq,
          "what": what, "key": probe.key if rendezvous else None,
          "waited": round(time.monotonic() - started, 1)}
    published = set()
    if rendezvous and probe.key:
      published = {int(k.rsplit("/", 1)[-1])
                   for k, _ in client.key_value_dir_get(probe.key)}
    peers = dict(beats)
    peers.update({p: {"steps": 0} for p in range(self.num_processes)
                  if p not in peers and p != self.process_id})
    at["waits_for"] = ([] if rendezvous and not probe.key else  # unknown
                       positions.waits_for(at, self.process_id, peers, published))
    return at

  def _check(self, client, wait, at, beats: dict) -> None:
    failed = self._reports(client, "failed")
    if failed:
      message = messages.failure(*failed[0])
      if wait is not None and isinstance(wait[3], _Flag):
        self.peer_failure = message  # the rendezvous raises it
        return
      stuck = wait is not None and time.monotonic() - wait[2] > STALL_SECONDS
      if self.peer_failure is None or stuck:
        self._end(message, publish=False)
      return  # raised already: the main thread deals with it (or exits)
    if wait is None:
      return
    seq, what, started, probe, timeout = wait
    waited = time.monotonic() - started
    if waited < STALL_SECONDS:
      return
    # A finished peer that never ran this step (or never comes to this
    # rendezvous) will not join it.
    rendezvous = isinstance(probe, _Flag)
    done = [(p, i) for p, i in self._reports(client, "done")
            if rendezvous or i.get("steps", 0) < seq]
    if done:
      self._end(messages.ran_fewer_steps(self.process_id, seq, what, done), publish=True)
    self._check_divergence(at, beats, rendezvous)
    if timeout is not None and waited > timeout:
      self._end(messages.timeout(self.process_id, self.num_processes, seq, what,
                                   timeout, beats, EXIT_CODE), publish=True)

  def _check_divergence(self, at, beats: dict, rendezvous: bool) -> None:
    """Ends the run when positions can never meet at two ticks in a row."""
    finding = positions.divergence(self.process_id, at, beats) if at else None
    signature = finding and [(p, a and (a["kind"], a["seq"], a.get("key")))
                             for p, a, _ in finding]
    confirmed = signature and signature == self._suspect
    self._suspect = signature
    if not confirmed:
      return
    message = messages.diverged(finding)
    if rendezvous:
      self.diverged = message  # the rendezvous raises it where it can be caught
    else:
      self._end(f"jdist.CollectiveTimeoutError: {message}", publish=True)

  def _reports(self, client, kind: str) -> list:
    out = []
    for key, value in client.key_value_dir_get(f"jdist/{kind}/"):
      pid = int(key.rstrip("/").rsplit("/", 1)[-1])
      if pid != self.process_id:
        try:
          out.append((pid, json.loads(value)))
        except ValueError:
          out.append((pid, {"error": value}))
    return sorted(out)

  def _set(self, key: str, value: str) -> None:
    client = self._client_fn()
    if client is not None:
      client.key_value_set(key, value, allow_overwrite=True)

  def _begin_end(self) -> bool:
    with self._lock:
      if self._ending:
        # The other thread is already ending the process; let it finish.
        if threading.current_thread() is not self._thread:
          while True:
            time.sleep(1)
        return False
      self._ending = True
      return True

  def _publish(self, kind: str, message: str) -> None:
    try:
      self._set(f"jdist/{kind}/{self.process_id}",
                json.dumps({"error": message.splitlines()[0][:REPORT_CHARS],
                            "steps": self.dispatched}))
      if self.process_id == 0:
        self._linger()
    except Exception:
      pass

  def _exit(self) -> None:
    try:
      sys.stderr.flush()
      sys.stdout.flush()
    finally:
      os._exit(EXIT_CODE)

  def _end(self, message: str, *, publish: bool) -> None:
    """Prints `message`, lets the peers know, and ends the process."""
    if not self._begin_end():
      return
    try:
      print(message, file=sys.stderr)
      self._publish("failed" if publish else "ack", message)
    finally:
      self._exit()

  def _linger(self) -> None:
    """Process 0 hosts the key-value store: gives the peers time to read it."""
    client = self._client_fn()
    deadline = time.monotonic() + LINGER_SECONDS
    while client is not None and time.monotonic() < deadline:
      seen = self._dead | {p for kind in ("failed", "ack")
                           for p, _ in self._reports(client, kind)}
      if len(seen) >= self.num_processes - 1:
        return
      time.sleep(0.1)
