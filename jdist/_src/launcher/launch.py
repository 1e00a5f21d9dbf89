"""`jdist launch`: one program as a multi-process job, elastic like torchrun
(docs/elastic.md).

The job is a set of nodes, each run by an agent; a rendezvous, hosted by
this launcher (or by the one on `--rdzv-endpoint`'s host), decides which
nodes run each attempt.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import traceback
from typing import Sequence

from jdist._src.launcher import agent as agents
from jdist._src.launcher import failures
from jdist._src.launcher import launch_args
from jdist._src.launcher import ports
from jdist._src.launcher import rendezvous
from jdist._src.launcher import rendezvous_tcp
from jdist._src.launcher import snapshot_dir

USAGE = launch_args.USAGE
parse_args = launch_args.parse_args
LINGER_SECONDS = 10.0  # the host of the rendezvous waits for the nodes to see the end


def _port_busy(port: int, error: OSError) -> str:
  return (f"jdist launch: port {port} is already in use on this machine "
          f"({error.strerror or error}): another job's coordinator, or another "
          "program, listens there. A second job on the same coordinator port "
          "would join the first job's coordinator and break both, so nothing "
          "was started. Leave out --port (jdist launch picks a free port), or "
          "pass one that is free.")


class _Notices:
  """Prints each restart once, whichever of the launcher's nodes sees it."""

  def __init__(self, lock: threading.Lock, max_restarts: int):
    self._lock = lock
    self._max_restarts = max_restarts
    self._printed = 0

  def __call__(self, view: dict) -> None:
    if view["end"] is not None:
      return  # the final message names every failure
    with self._lock:
      for f in view["failures"][self._printed:]:
        self._printed += 1
        print(failures.restarting(failures.Failure.fromdict(f), self._printed,
                                  self._max_restarts), file=sys.stderr, flush=True)


def launch(args: argparse.Namespace) -> int:
  """Runs the job; returns the launcher's exit code."""
  standalone = args.rdzv_endpoint is None
  if standalone and args.port:
    busy = ports.in_use(ports.bind_address(args.port))
    if busy is not None:
      print(_port_busy(args.port, busy), file=sys.stderr, flush=True)
      return 1
  spec = rendezvous.JobSpec(args.min_nodes, args.max_nodes, args.max_restarts,
                            tuple(launch_args.command(args)))
  state = rendezvous.Rendezvous(
      spec, last_call=args.last_call, join_timeout=args.join_timeout,
      stuck_timeout=args.stuck_timeout)
  host, port = (("127.0.0.1", 0) if standalone
                else launch_args.endpoint(args.rdzv_endpoint))
  server = (rendezvous_tcp.Server(state, host, port) if standalone else
            rendezvous_tcp.Server.host_if_local(state, host, port))
  if server is not None:
    host, port = server.address
    if not standalone:
      print(f"jdist launch: this launcher hosts the job's rendezvous on "
            f"{host}:{port}; the job lives as long as it does.",
            file=sys.stderr, flush=True)
  lock, interrupts = threading.Lock(), []
  handlers = {sig: signal.signal(sig, lambda s, _: interrupts.append(s))
              for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    outcomes = _run_nodes(args, spec, (host, port), lock, interrupts,
                          args.max_nodes if standalone else 1)
  finally:
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
    if server is not None:
      server.close(linger=LINGER_SECONDS)
  _remove_snapshots(outcomes, standalone)
  return _conclude(outcomes, args)


def _remove_snapshots(outcomes: list, standalone: bool) -> None:
  """Removes the job's in-memory snapshots from this host once the job is
  over (it ended, or every node was this launcher's)."""
  over = standalone or any(o.end is not None for o in outcomes)
  if over:
    for run_id in {o.run_id for o in outcomes if o.run_id}:
      snapshot_dir.remove(run_id)


def _run_nodes(args, spec, endpoint, lock, interrupts, count: int) -> list:
  """Runs `count` nodes' agents (the first in this thread); their outcomes."""
  notices = _Notices(lock, args.max_restarts)
  nodes, outcomes = [], [None] * count
  try:
    for i in range(count):  # in order: node i gets the i-th process ids
      client = rendezvous_tcp.Client(*endpoint, timeout=args.join_timeout)
      client.hello(spec.asdict(), nproc=args.nproc_per_node)
      node = agents.Node(
          tuple(launch_args.python_command(args)), args.nproc_per_node,
          local_index=i * args.nproc_per_node,
          devices_per_process=args.devices_per_process, port=args.port,
          grace=args.grace_period, max_restarts=args.max_restarts)
      nodes.append(agents.Agent(client, node, interrupts, lock, notices))
  except rendezvous_tcp.RendezvousError as e:
    return [agents.Outcome(error=str(e))]

  def run(i: int) -> None:
    try:
      outcomes[i] = nodes[i].run()
    except Exception as e:  # a bug in the agent: its node leaves, the job goes on
      traceback.print_exc()
      outcomes[i] = agents.Outcome(error=f"the agent of node {i} failed: {e!r}")

  threads = [threading.Thread(target=run, args=(i,), name=f"jdist-node-{i}")
             for i in range(1, count)]
  for t in threads:
    t.start()
  run(0)
  for t in threads:
    while t.is_alive():  # short joins: the main thread must take signals
      t.join(timeout=0.1)
  return outcomes


def _conclude(outcomes: list, args) -> int:
  """Prints how the job ended for this launcher; its exit code."""
  interrupted = [o for o in outcomes if o.interrupted]
  if interrupted:
    sig = interrupted[0].interrupted
    killed = sorted(r for o in interrupted for r in o.killed)
    detail = (f"; processes {killed} were still running after the grace period "
              f"of {args.grace_period:g} s and were killed" if killed else "")
    print(f"jdist launch: stopped by {signal.Signals(sig).name}, which it "
          f"forwarded to the processes{detail}.", file=sys.stderr, flush=True)
    return 128 + sig
  errors = [o.error for o in outcomes if o.error]
  if errors:
    print(f"jdist launch: {errors[0]}", file=sys.stderr, flush=True)
    return 1
  end = outcomes[0].end
  if end["message"]:
    print(end["message"], file=sys.stderr, flush=True)
  return end["code"]


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of `jdist launch` and `python -m jdist.launch`.

  Example:
    $ jdist launch -n 2 --devices-per-process 2 train.py --epochs 3
    $ jdist launch --nnodes 2:4 --max-restarts 3 train.py
  """
  args = parse_args(sys.argv[1:] if argv is None else argv)
  return launch(args)
