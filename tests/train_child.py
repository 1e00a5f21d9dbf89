"""A training job run as a child process by the checkpoint and preemption tests.

    python tests/train_child.py BACKUP_DIR OUT.npz
        [--mode slow|crash-in-finalize|file-size-limit]
        [--processes N --process-id I --port P] [--pause-at K --until PATH]
        [--save-freq N]

Trains the MLP on 1,000 digits for 3 epochs of 16 steps on 4 replicas (4 fake
devices, or N processes with 4/N each) with BackupAndRestore every 4 steps
(every N with --save-freq), prints "step K" after each step and a line per
epoch (process 0), logs epochs to OUT.npz.csv (process 0, appending) and
writes the final parameters to OUT.npz. With --pause-at, it waits after step
K until the file PATH exists.

The tests run a job that is not interrupted (a relaunch) with
`--save-freq 16`: a backup costs more than several steps, and what they
check of such a job (the step it resumed at, the steps it ran, its final
parameters, the backups deleted at its end) does not depend on how often it
saves.
"""

import argparse
import os
import resource
import signal
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("backup")
parser.add_argument("out")
parser.add_argument("--mode", default="plain")
parser.add_argument("--processes", type=int, default=1)
parser.add_argument("--process-id", type=int, default=0)
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--pause-at", type=int, default=0)
parser.add_argument("--until", default="")
parser.add_argument("--save-freq", type=int, default=4)
args = parser.parse_args()
# Ctrl-C as from a terminal, even when the test runs where SIGINT is ignored
# (a background job: its children inherit that, and Python keeps it so).
signal.signal(signal.SIGINT, signal.default_int_handler)

devices = 4 // args.processes
# The suite's compiler flags (conftest.py), so that this process compiles
# what the test's reference compiled.
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('JDIST_TEST_XLA_FLAGS', '')} "
    f"--xla_force_host_platform_device_count={devices}").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jdist  # noqa: E402

if args.processes > 1:  # joins the run before JAX starts its backend
  strategy = jdist.MultiWorkerMirroredStrategy(
      jdist.cluster_resolver.SimpleClusterResolver(
          f"127.0.0.1:{args.port}", args.processes, args.process_id))
else:
  strategy = jdist.MirroredStrategy()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jdist.examples.data import load_digits  # noqa: E402
from jdist.examples.models import MLP  # noqa: E402

if args.mode == "crash-in-finalize":
  # Die like a killed process while the second checkpoint is being committed:
  # its files are written, the rename that finalises it has not happened.
  from orbax.checkpoint._src.path import atomicity
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def dying_finalize(self, *a, **k):
    if os.path.basename(str(self.get_final())) == "8":  # the step directory
      os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self, *a, **k)

  atomicity.AtomicRenameTemporaryPath.finalize = dying_finalize


class Progress(jdist.Callback):
  def on_train_begin(self, logs=None):
    self.ran = 0

  def on_train_batch_end(self, batch, logs=None):
    self.ran += 1
    print(f"step {self.model.global_step}", flush=True)
    if args.mode == "slow":
      time.sleep(0.1)
    if args.mode == "file-size-limit" and self.model.global_step == 5:
      # From now on no file may grow past 1 KB: the next save fails (EFBIG).
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      resource.setrlimit(resource.RLIMIT_FSIZE,
                         (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    if self.model.global_step == args.pause_at:
      deadline = time.monotonic() + 120
      while not os.path.exists(args.until) and time.monotonic() < deadline:
        time.sleep(0.05)

  def on_train_end(self, logs=None):
    print(f"ran {self.ran} steps", flush=True)


x, y = load_digits(image=False)
trainer = jdist.Trainer(MLP(), optimizer=optax.adam(1e-2),
                        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                        metrics=["accuracy"], strategy=strategy, seed=0)
backup = jdist.BackupAndRestore(args.backup, save_freq=args.save_freq)
try:
  trainer.fit(x[:1000], y[:1000], batch_size=64, epochs=3, verbose=2,
              callbacks=[Progress(), jdist.TerminateOnNaN(), backup,
                         jdist.CSVLogger(args.out + ".csv", append=True)])
except SystemExit:
  print(f"exit at step {trainer.global_step}", flush=True)
  raise
params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), trainer.params)
if jax.process_index() == 0:
  np.savez(args.out, **{f"p{i}": p for i, p in enumerate(jax.tree.leaves(params))})
print(f"done {trainer.global_step} {int(trainer.state.step.addressable_data(0))}",
      flush=True)
sys.exit(0)
