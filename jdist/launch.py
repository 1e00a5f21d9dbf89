"""`jdist launch` / `python -m jdist.launch`: run one program as a multi-process job.

N local processes (`-n N`), or an elastic job of `--nnodes MIN:MAX` nodes that
is started again, up to `--max-restarts` times, on the nodes it has when a
process dies, its node goes away or it is stuck (`--stuck-timeout`); with
`--rdzv-endpoint HOST:PORT` the same command runs one node on each host.
Each process reads `JDIST_RESTART_COUNT` to know it is a restart.

Example:
  $ python -m jdist.launch -n 2 --devices-per-process 2 train.py --epochs 3
  $ python -m jdist.launch --nnodes 2:4 --max-restarts 3 train.py
"""

import sys

from jdist._src.launcher.launch import main

__all__ = ["main"]

if __name__ == "__main__":
  sys.exit(main())
