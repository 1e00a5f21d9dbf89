"""The command line of `jdist launch`, checked before anything starts.

torchrun's vocabulary where it has a word (`--nnodes MIN:MAX`,
`--nproc-per-node`, `--max-restarts`, `--rdzv-endpoint`); `-n N` is N nodes
of one process, and `--min-processes M` lowers its minimum.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from jdist._src.launcher import rendezvous

USAGE = ("jdist launch (-n N [--min-processes M] | --nnodes MIN:MAX "
         "[--nproc-per-node K]) [--max-restarts R] [--stuck-timeout S] "
         "[--rdzv-endpoint HOST:PORT] [--devices-per-process K] [--port PORT] "
         "[--grace-period S] (script.py | -m module) [args ...]")
GRACE_SECONDS = 10.0

_HELP = {
    "n": "processes to start on this machine (one per node: --nnodes N:N)",
    "min": "with -n: run on as few as M processes after a failure "
           "(--nnodes M:N)",
    "nnodes": "nodes (hosts) in the job, MIN:MAX or N; without "
              "--rdzv-endpoint, MAX nodes run on this machine",
    "nproc": "processes each node starts (default 1)",
    "restarts": "times the job is started again after a failure (default 0)",
    "stuck": "a process silent (stopped, frozen) or waiting in one step this "
             "long is stuck: the attempt stops (default "
             f"{rendezvous.STUCK_TIMEOUT_SECONDS:g}); set it above your "
             "longest step",
    "rdzv": "run one node of a job on many hosts: the same command on each, "
            "the launcher on HOST hosts the rendezvous",
    "last_call": "seconds the first attempt waits for more than MIN nodes "
                 f"(default {rendezvous.LAST_CALL_SECONDS:g})",
    "join": "seconds an attempt waits for MIN nodes before the job ends "
            f"(default {rendezvous.JOIN_TIMEOUT_SECONDS:g})",
    "devices": "devices each process drives: K fake CPU devices on a CPU, or "
               "accelerators K*i..K*i+K-1 (i: its index on its machine)",
    "port": "coordinator port of process 0 (default: a free one, new for "
            "each attempt)",
    "grace": "seconds the processes get to stop after one fails, or after the "
             "launcher forwards a SIGINT or SIGTERM (time for a job to save), "
             f"before they are killed (default {GRACE_SECONDS:g})",
}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jdist launch", usage=USAGE,
      description="Run one JAX program as a multi-process job (jdist."
                  "initialize()), restarted on the nodes it has when a process "
                  "fails, its host goes away or it is stuck.")
  p.add_argument("-n", "--num-processes", type=int, metavar="N", help=_HELP["n"])
  p.add_argument("--min-processes", type=int, metavar="M", help=_HELP["min"])
  p.add_argument("--nnodes", metavar="MIN:MAX", help=_HELP["nnodes"])
  p.add_argument("--nproc-per-node", type=int, default=None, metavar="K",
                 help=_HELP["nproc"])
  p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                 help=_HELP["restarts"])
  p.add_argument("--stuck-timeout", type=float, metavar="S",
                 default=rendezvous.STUCK_TIMEOUT_SECONDS, help=_HELP["stuck"])
  p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help=_HELP["rdzv"])
  p.add_argument("--last-call", type=float, metavar="S",
                 default=rendezvous.LAST_CALL_SECONDS, help=_HELP["last_call"])
  p.add_argument("--join-timeout", type=float, metavar="S",
                 default=rendezvous.JOIN_TIMEOUT_SECONDS, help=_HELP["join"])
  p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                 help=_HELP["devices"])
  p.add_argument("--port", type=int, default=None, help=_HELP["port"])
  p.add_argument("--grace-period", type=float, default=GRACE_SECONDS,
                 metavar="S", help=_HELP["grace"])
  p.add_argument("-m", dest="module", action="store_true",
                 help="run the target as a module (python -m)")
  p.add_argument("target", help="the script (or module, with -m)")
  p.add_argument("args", nargs=argparse.REMAINDER,
                 help="arguments passed to the script")
  return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The checked arguments, with `min_nodes`, `max_nodes`, `nproc_per_node`.

  Example:
    >>> from jdist._src.launcher import launch_args
    >>> a = launch_args.parse_args(["--nnodes", "2:4", "-m", "train"])
    >>> a.min_nodes, a.max_nodes, a.nproc_per_node, a.max_restarts
    (2, 4, 1, 0)
  """
  argv = list(argv)
  if argv and argv[0] == "launch":
    argv = argv[1:]
  parser = _parser()
  args = parser.parse_args(argv)
  problem = _sizes(args) or _limits(args)
  if problem is None and not args.module and not os.path.exists(args.target):
    problem = f"no such script: {args.target!r} (use -m to run a module)."
  if problem is not None:
    parser.error(problem)
  return args


def _sizes(args) -> str | None:
  """Sets `min_nodes`, `max_nodes`, `nproc_per_node`; or says what is wrong."""
  n, nnodes = args.num_processes, args.nnodes
  if (n is None) == (nnodes is None):
    return ("one of these is required: -n N or --nnodes MIN:MAX (not both)."
            if n is not None else "one of these is required: -n N or "
            "--nnodes MIN:MAX.")
  if n is not None:
    if n < 1:
      return f"-n must be at least 1, got {n}."
    if args.nproc_per_node is not None:
      return ("-n counts processes, one per node; with --nproc-per-node give "
              "the nodes with --nnodes MIN:MAX.")
    low = n if args.min_processes is None else args.min_processes
    if not 1 <= low <= n:
      return f"--min-processes must be from 1 to -n ({n}), got {low}."
    args.min_nodes, args.max_nodes, args.nproc_per_node = low, n, 1
    return None
  if args.min_processes is not None:
    return "--min-processes goes with -n; with --nnodes write MIN:MAX."
  low, sep, high = nnodes.partition(":")
  if not (low.isdigit() and (high.isdigit() if sep else True)):
    return f"--nnodes must be MIN:MAX or N (e.g. 2:4), got {nnodes!r}."
  args.min_nodes, args.max_nodes = int(low), int(high if sep else low)
  if not 1 <= args.min_nodes <= args.max_nodes:
    return (f"--nnodes needs 1 <= MIN <= MAX, got {nnodes!r}.")
  args.nproc_per_node = args.nproc_per_node or 1
  return None


def _limits(args) -> str | None:
  if args.nproc_per_node < 1:
    return "--nproc-per-node must be at least 1."
  if args.devices_per_process is not None and args.devices_per_process < 1:
    return "--devices-per-process must be at least 1."
  if args.max_restarts < 0:
    return f"--max-restarts must be 0 or more, got {args.max_restarts}."
  for name in ("stuck_timeout", "grace_period", "join_timeout"):
    if getattr(args, name) <= 0:
      return f"--{name.replace('_', '-')} must be more than 0 seconds."
  if args.last_call < 0:
    return "--last-call must be 0 seconds or more."
  if args.rdzv_endpoint is not None:
    try:
      endpoint(args.rdzv_endpoint)
    except ValueError as e:
      return str(e)
  return None


def endpoint(text: str) -> tuple:
  """`(host, port)` of "HOST:PORT" (raises ValueError)."""
  host, sep, port = text.rpartition(":")
  if not (sep and host and port.isdigit()):
    raise ValueError(f"--rdzv-endpoint must be HOST:PORT (e.g. "
                     f"10.0.0.1:29400), got {text!r}.")
  return host.strip("[]"), int(port)


def command(args) -> list:
  """The program and its arguments, as every node must run them."""
  target = ["-m", args.target] if args.module else [args.target]
  return [*target, *args.args]


def python_command(args) -> list:
  return [sys.executable, "-u", *command(args)]
