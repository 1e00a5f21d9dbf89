"""An elastic job for `jdist launch`: `elastic_job.py OUT_DIR [--fit] [FAULT ...]`.

elastic_train.py's training (a small MLP, SGD with momentum, a global batch
of 16 padded and masked where the replicas do not divide it) over
`jdist.MultiWorkerMirroredStrategy`, one fake CPU device per process, for
STEPS steps. Every SAVE_EVERY steps all processes save the state (parameters
and optimizer state) with `jdist.CheckpointManager` into OUT_DIR/checkpoints;
every attempt resumes from the newest checkpoint, on however many processes
it has, and reads the data from the step it resumes at. With `--fit`, the
same model trains with `jdist.Trainer.fit` and `jdist.BackupAndRestore`
(save_freq=SAVE_EVERY, into OUT_DIR/backup) instead.

Each FAULT is `ATTEMPT:RANK:STEP:WHAT`: in attempt ATTEMPT (`JDIST_RESTART_COUNT`),
process RANK, after step STEP, does WHAT: `kill` (SIGKILL itself), `stop`
(SIGSTOP itself), `hang` (waits forever outside any step, alive), `exit3`
(exits with code 3), `park` (writes OUT_DIR/parked-RANK with its agent's pid,
then waits forever for the test to take its node away).

It prints timestamped markers the tests read: `started <t> pid=<pid>` first,
`imported <t>`, `initialized <t> world=<n> attempt=<k>`,
`resumed <step> <t>` (checkpoint read, data ready), `step <i> <t> world=<n>`
after each step, and `fault <t> <what>` just before a fault; at the end,
process 0 writes OUT_DIR/final.npz.
"""

import os
import sys
import time

print(f"started {time.time():.3f} pid={os.getpid()}", flush=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import signal  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

import elastic_train as train  # noqa: E402
import jdist  # noqa: E402

print(f"imported {time.time():.3f}", flush=True)
OUT = sys.argv[1]
FIT = "--fit" in sys.argv[2:]
FAULTS = [a for a in sys.argv[2:] if a != "--fit"]
strategy = jdist.MultiWorkerMirroredStrategy()

import jax  # noqa: E402

ME, WORLD = jax.process_index(), jax.process_count()
ATTEMPT = int(os.environ.get("JDIST_RESTART_COUNT", "0"))
print(f"initialized {time.time():.3f} world={WORLD} attempt={ATTEMPT}", flush=True)


def fault(step):
  for spec in FAULTS:
    attempt, rank, at, what = spec.split(":")
    if (int(attempt), int(rank), int(at)) == (ATTEMPT, ME, step):
      print(f"fault {time.time():.3f} {what}", flush=True)
      if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      elif what == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
      elif what == "exit3":
        os._exit(3)
      elif what == "park":
        with open(os.path.join(OUT, f"parked-{ME}.tmp"), "w") as f:
          f.write(str(os.getppid()))
        os.replace(os.path.join(OUT, f"parked-{ME}.tmp"),
                   os.path.join(OUT, f"parked-{ME}"))
      if what in ("hang", "park"):
        threading.Event().wait()


class Markers(jdist.Callback):
  """fit's markers and faults, as the loop's (after BackupAndRestore)."""

  def on_train_begin(self, logs=None):
    print(f"resumed {self.model.global_step} {time.time():.3f}", flush=True)

  def on_train_batch_end(self, batch, logs=None):
    i = self.model.global_step - 1
    print(f"step {i} {time.time():.3f} world={WORLD}", flush=True)
    fault(i)


def run_fit() -> dict:
  """`Trainer.fit` with `BackupAndRestore` every SAVE_EVERY steps."""
  backup = jdist.BackupAndRestore(os.path.join(OUT, "backup"),
                                  save_freq=train.SAVE_EVERY)
  return train.fit(strategy, [backup, Markers()])


def run_loop() -> dict:
  """A custom loop with `jdist.CheckpointManager` every SAVE_EVERY steps."""
  manager = jdist.CheckpointManager(os.path.join(OUT, "checkpoints"),
                                    max_to_keep=2, strategy=strategy)
  first = manager.latest_step or 0  # steps done: the next step's index
  if first:  # restored into the state's shapes: no initial state to compute
    state = manager.restore(jax.eval_shape(train.initial_state))
  else:
    state = strategy.replicate(train.initial_state())
  step_fn = strategy.function(train.train_step)
  dataset = train.batches(strategy, first)
  print(f"resumed {first} {time.time():.3f}", flush=True)
  for i, b in zip(range(first, train.STEPS), dataset):
    state, _ = step_fn(state, b)
    jax.block_until_ready(state)
    print(f"step {i} {time.time():.3f} world={WORLD}", flush=True)
    if (i + 1) % train.SAVE_EVERY == 0:
      manager.save(i + 1, state)
    fault(i)
  manager.close()
  return train.host_params(state)


params = run_fit() if FIT else run_loop()
if ME == 0:
  np.savez(os.path.join(OUT, "final.npz"), world=WORLD, attempt=ATTEMPT,
           **params)
print("finished", flush=True)
