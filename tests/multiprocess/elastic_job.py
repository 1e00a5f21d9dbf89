"""An elastic job for `jdist launch`: `python elastic_job.py OUT_DIR [FAULT ...]`.

Linear regression trained with SGD over `jdist.MultiWorkerMirroredStrategy`
(one fake CPU device per process), for STEPS steps. Process 0 saves a
checkpoint of its own every SAVE_EVERY steps (numpy, written to a temporary
file and renamed, so a kill never leaves half of one); every attempt resumes
from the newest. `checkpoint_load`/`checkpoint_save` are where the Trainer's
`BackupAndRestore` or a `jdist.CheckpointManager` take over for an exact
continuation.

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

import jdist  # noqa: E402

print(f"imported {time.time():.3f}", flush=True)
OUT = sys.argv[1]
STEPS, SAVE_EVERY, BATCH = 100, 10, 12
strategy = jdist.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ME, WORLD = jax.process_index(), jax.process_count()
ATTEMPT = int(os.environ.get("JDIST_RESTART_COUNT", "0"))
print(f"initialized {time.time():.3f} world={WORLD} attempt={ATTEMPT}", flush=True)
CHECKPOINT = os.path.join(OUT, "checkpoint.npz")


def checkpoint_load():
  """(next step, weights) from the newest checkpoint, or from scratch."""
  if not os.path.exists(CHECKPOINT):
    return 0, np.zeros(4, np.float32)
  with np.load(CHECKPOINT) as z:
    return int(z["step"]) + 1, z["w"]


def checkpoint_save(step, w):
  if ME == 0:
    tmp = CHECKPOINT + ".tmp.npz"
    np.savez(tmp, step=step, w=np.asarray(w.addressable_data(0)))
    os.replace(tmp, CHECKPOINT)


def batch(step):
  rng = np.random.default_rng(step)  # the data depend on the step only
  x = rng.normal(size=(BATCH, 4)).astype(np.float32)
  return {"x": x, "y": x @ np.array([1.0, -2.0, 3.0, 0.5], np.float32)}


def train_step(w, b):
  def loss(w):
    return jdist.compute_average_loss((b["x"] @ w - b["y"]) ** 2)
  value, grad = jax.value_and_grad(loss)(w)
  return w - 0.05 * grad, value


def fault(step):
  for spec in sys.argv[2:]:
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


first, w = checkpoint_load()
step_fn = strategy.function(train_step)
w = strategy.replicate(jnp.asarray(w))
dataset = strategy.experimental_distribute_dataset(
    [batch(i) for i in range(first, STEPS)])
print(f"resumed {first} {time.time():.3f}", flush=True)
for i, b in zip(range(first, STEPS), dataset):
  w, loss = step_fn(w, b)
  jax.block_until_ready(w)
  print(f"step {i} {time.time():.3f} world={WORLD}", flush=True)
  if (i + 1) % SAVE_EVERY == 0:
    checkpoint_save(i, w)
  fault(i)
if ME == 0:
  np.savez(os.path.join(OUT, "final.npz"), w=np.asarray(w.addressable_data(0)),
           world=WORLD, attempt=ATTEMPT)
print("finished", flush=True)
