"""A pipeline whose stages are the processes, as an elastic job:
`jdist launch --nnodes 2 --max-restarts 1 --devices-per-process 2
elastic_pipeline_job.py OUT [FAULT ...]`.

model_parallel_train.py's pipelined model (four stacked tanh layers run by
`jdist.pipeline` as 2 GPipe stages over a "stage" axis across the two
processes, 2 replicas inside each) trains for its STEPS steps in a custom
loop, with a `jdist.CheckpointManager` checkpoint every SAVE_EVERY steps in
OUT/checkpoints. Every attempt starts from the newest checkpoint, restored
into the layout the strategy gives the state (each process reads its stage's
layers), and reads the data from the step it resumes at.

Each FAULT is `ATTEMPT:RANK:STEP:kill` (elastic_job.py's syntax): in attempt
ATTEMPT (`JDIST_RESTART_COUNT`), process RANK SIGKILLs itself after step
STEP (counted from 0) and its checkpoint. Each process prints
`resumed <step> attempt=<k> pid=<pid>` and `loss <i> <value>` after step i; process 0
writes the final parameters and momentum, gathered, to OUT/final.npz.
"""

import os
import signal
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

import jdist
import model_parallel_train as train_lib

OUT, FAULTS = sys.argv[1], sys.argv[2:]
SAVE_EVERY = 2
ATTEMPT = int(os.environ.get("JDIST_RESTART_COUNT", "0"))


def fault(step: int) -> None:
  """SIGKILLs this process if a FAULT names this attempt, process, step."""
  me = (ATTEMPT, jax.process_index(), step)
  for spec in FAULTS:
    attempt, rank, at, what = spec.split(":")
    if (int(attempt), int(rank), int(at)) == me and what == "kill":
      print(f"fault {step} kill", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)


def main():
  strategy = train_lib.strategy_pipeline()  # stages across the processes
  params = strategy.init(train_lib.init_pipeline_params)
  state = (params, strategy.init(train_lib.OPTIMIZER.init, params))
  manager = jdist.CheckpointManager(os.path.join(OUT, "checkpoints"),
                                    strategy=strategy, save_every=SAVE_EVERY)
  first = manager.latest_step or 0
  if first:
    state = manager.restore(state)  # into the layouts of `state`
  print(f"resumed {first} attempt={ATTEMPT} pid={os.getpid()}", flush=True)
  step = strategy.function(train_lib.pipeline_step)
  data = strategy.experimental_distribute_dataset(train_lib.batches()[first:])
  for i, batch in enumerate(data, first):
    params, opt_state, loss = step(*state, batch)
    state = (params, opt_state)
    print(f"loss {i} {float(strategy.reduce('sum', loss)):.9g}", flush=True)
    manager.save(i + 1, state)
    fault(i)
  manager.close()
  whole = multihost_utils.process_allgather(state, tiled=True)
  if jax.process_index() == 0:
    leaves = jax.tree_util.tree_flatten_with_path(whole)[0]
    np.savez(os.path.join(OUT, "final.npz"), attempt=ATTEMPT,
             **{jax.tree_util.keystr(p): x for p, x in leaves})
  print("finished", flush=True)


main()
