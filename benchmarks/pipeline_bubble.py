"""One schedule's pipeline bubble with each stage in a process of its own,
pinned to a core of its own (benchmarks/pipelines.py runs it once per
schedule, `bubble_in_processes`):

  python -m jdist.launch -n 2 --devices-per-process 1 \\
      benchmarks/pipeline_bubble.py --microbatches 4 --repeats 1 \\
      --width 512 --rows 512 --layers-per-stage 4 --steps 7 [--niceness -20]

Process i keeps to core i (of the cores it may use, in order) from its
first line, before JAX starts a thread: every thread it starts inherits
that, so a stage that computes alone (in the bubble) cannot borrow its
peer's core, as it does when both stages are devices of one process.
Each process runs `pipelines.bubble` on the run's 2 devices (one each: the
stages), recording its own stage's layers; process 0 prints the result as
one JSON line, with the cores each process's threads were allowed
(`cores`: one list per process, read from /proc at the end).
"""

import os

_RANK = int(os.environ.get("JDIST_PROCESS_ID", "0"))
_ALLOWED = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {_ALLOWED[_RANK % len(_ALLOWED)]})

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import jdist  # noqa: E402
import pipelines  # noqa: E402  (this directory's; the measurement itself)


def threads_cores() -> list:
  """The cores any thread of this process may run on."""
  cores = set()
  for tid in os.listdir("/proc/self/task"):
    try:
      cores |= os.sched_getaffinity(int(tid))
    except OSError:  # the thread ended meanwhile
      pass
  return sorted(cores)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name in ("microbatches", "repeats", "width", "rows",
               "layers-per-stage", "steps"):
    parser.add_argument(f"--{name}", type=int, required=True)
  parser.add_argument("--niceness", type=lambda v: None if v == "None"
                      else int(v), default=-20,
                      help="the timed steps' niceness (None: unchanged)")
  args = vars(parser.parse_args(argv))
  jdist.initialize()
  result = pipelines.bubble(jax.devices(), args.pop("microbatches"),
                            args.pop("repeats"), **args)
  mine = np.full(len(_ALLOWED), -1, np.int32)
  cores = threads_cores()
  mine[:len(cores)] = cores
  every = multihost_utils.process_allgather(mine)
  result["cores"] = [[int(c) for c in row if c >= 0] for row in every]
  if jax.process_index() == 0:
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
