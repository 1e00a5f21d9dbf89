"""An elastic job for `jdist launch`:
`elastic_job.py OUT_DIR [--fit] [--save-every N] [--snapshot-every N] [FAULT ...]`.

elastic_train.py's training (a small MLP, SGD with momentum, a global batch
of 16 padded and masked where the replicas do not divide it) over
`jdist.MultiWorkerMirroredStrategy`, one fake CPU device per process, for
STEPS steps. Every SAVE_EVERY steps all processes save the state (parameters
and optimizer state) with `jdist.CheckpointManager` into OUT_DIR/checkpoints;
every attempt resumes from the newest checkpoint, on however many processes
it has, and reads the data from the step it resumes at. With `--fit`, the
same model trains with `jdist.Trainer.fit` and `jdist.BackupAndRestore`
(save_freq=SAVE_EVERY, into OUT_DIR/backup) instead. `--save-every N` saves
to OUT_DIR/checkpoints every N steps instead, and `--snapshot-every N` also
keeps a snapshot in memory every N steps (`CheckpointManager`'s
`save_every` and `snapshot_every`; process 0 prints `snapshots <directory>`,
where they are; the saved state then also holds a probe, a leaf split over
the processes, and its twin in int4, which a restore checks); with `--fit`,
`BackupAndRestore`'s `save_freq` and `snapshot_every`.

Each FAULT is `ATTEMPT:RANK:STEP:WHAT`: in attempt ATTEMPT (`JDIST_RESTART_COUNT`),
process RANK, after step STEP, does WHAT: `kill` (SIGKILL itself), `stop`
(SIGSTOP itself), `hang` (waits forever outside any step, alive), `exit3`
(exits with code 3), `park` (writes OUT_DIR/parked-RANK with its agent's pid,
then waits forever for the test to take its node away), `savekill` (SIGKILLs
itself in the middle of `CheckpointManager.save` of checkpoint STEP, the
step after which it is saved: see `kill_mid_save`), `snapkill` (the same,
while it writes its part of the in-memory snapshot of step STEP, in the
loop or in fit: see `arm_snapshot_kill`).

It prints timestamped markers the tests read: `started <t> pid=<pid>` first,
`imported <t>`, `initialized <t> world=<n> attempt=<k>`,
`writing <tmp dir> <its entries>` (a `savekill`, just before the kill),
`resumed <step> <t>` (checkpoint read, data ready), `step <i> <t> world=<n>`
after each step, and `fault <t> <what>` just before a fault (also written to
OUT_DIR/fault-ATTEMPT). At its first step after a restart, process 0 prints
`restart <s> s from the fault to the first step (started +<s>, imported
+<s>, initialized +<s>, resumed +<s>)`: how long the job took to train again,
and when this process had started, imported jdist, joined the job and read
its checkpoint. At the end, process 0 writes OUT_DIR/final.npz.
"""

import os
import sys
import time

MARKS = {"started": time.time()}  # this process's times, for `restart`
print(f"started {MARKS['started']:.3f} pid={os.getpid()}", flush=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import contextlib  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

import numpy as np  # noqa: E402

import elastic_train as train  # noqa: E402
import jdist  # noqa: E402

MARKS["imported"] = time.time()
print(f"imported {MARKS['imported']:.3f}", flush=True)
OUT = sys.argv[1]
ARGS = sys.argv[2:]


def option(name: str, default=None):
  """The value of `name N` in ARGS (removed from it), or `default`."""
  if name not in ARGS:
    return default
  at = ARGS.index(name)
  value = int(ARGS[at + 1])
  del ARGS[at:at + 2]
  return value


FIT = "--fit" in ARGS
SAVE_EVERY = option("--save-every", train.SAVE_EVERY)
SNAPSHOT_EVERY = option("--snapshot-every")
FAULTS = [a for a in ARGS if a != "--fit"]
strategy = jdist.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

ME, WORLD = jax.process_index(), jax.process_count()
ATTEMPT = int(os.environ.get("JDIST_RESTART_COUNT", "0"))
MARKS["initialized"] = time.time()
print(f"initialized {MARKS['initialized']:.3f} world={WORLD} attempt={ATTEMPT}",
      flush=True)


def resumed(step):
  MARKS["resumed"] = time.time()
  print(f"resumed {step} {MARKS['resumed']:.3f}", flush=True)


def restart_report():
  """Process 0's first step after a restart: seconds from the fault before
  it to this step, and from the fault to each of this process's markers."""
  path = os.path.join(OUT, f"fault-{ATTEMPT - 1}")
  if ME != 0 or not os.path.exists(path):
    return
  with open(path) as f:
    fault_at = float(f.read())
  now = time.time()
  parts = [f"{name} +{t - fault_at:.2f}" for name, t in MARKS.items()]
  print(f"restart {now - fault_at:.2f} s from the fault to the first step "
        f"({', '.join(parts)}) world={WORLD}", flush=True)


def after_step(i, first: bool):
  """The markers and faults after step `i` (`first`: of this attempt)."""
  say(f"step {i} {time.time():.3f} world={WORLD}")  # (the writer thread's
  # `writing` line may come at the same time)
  if first:
    restart_report()
  fault(i)


def my_fault(step, kinds) -> str | None:
  """This process's fault of a kind in `kinds` at `step` in this attempt."""
  for spec in FAULTS:
    attempt, rank, at, what = spec.split(":")
    if (int(attempt), int(rank), int(at)) == (ATTEMPT, ME, step) and \
        what in kinds:
      return what
  return None


def say(line):
  """Prints `line` in one write to the file: whole, also from another
  thread (a print writes its text and its end apart, and another thread's
  line could come between them, unbuffered; every print here flushes, so
  nothing printed before waits in the buffer)."""
  os.write(sys.stdout.fileno(), f"{line}\n".encode())


def announce(what):
  """Prints the fault's marker and writes OUT_DIR/fault-ATTEMPT."""
  now = time.time()
  say(f"fault {now:.3f} {what}")
  with open(os.path.join(OUT, f"fault-{ATTEMPT}.tmp"), "w") as f:
    f.write(f"{now:.3f}")
  os.replace(os.path.join(OUT, f"fault-{ATTEMPT}.tmp"),
             os.path.join(OUT, f"fault-{ATTEMPT}"))


def fault(step):
  what = my_fault(step, ("kill", "stop", "exit3", "hang", "park"))
  if what is None:
    return
  announce(what)
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


@contextlib.contextmanager
def kill_mid_save(step, directory):
  """With a `savekill` fault at `step`: SIGKILLs this process inside the
  save it wraps, once orbax's temporary directory for the step is there
  and holds an item that orbax is still writing.

  The test hook: a profile function (`sys.setprofile`, on this thread only,
  for this save only) looks at the directory at each Python call or return
  inside the save. Deterministic: process 0 creates the temporary directory
  and renames it only after every process has written its part, so the
  killed process, whichever it is, dies before the rename.
  """
  if my_fault(step, ("savekill",)) is None:
    yield
    return
  prefix = f"{step}.orbax-checkpoint-tmp"

  def writing() -> list:
    """The step's temporary directory and what it holds, while an item
    (the state's arrays, or the metadata) is still being written in its
    own temporary directory there."""
    for entry in os.scandir(directory):
      inside = sorted(os.listdir(entry.path)) \
          if entry.name.startswith(prefix) else []
      if any(".orbax-checkpoint-tmp" in name for name in inside):
        return [entry.name, *inside]
    return []

  def seen():
    found = writing()
    return found and f"writing {' '.join(found)}"

  with _killed_when(seen, "savekill"):
    yield


def arm_snapshot_kill(step):
  """With a `snapkill` fault at `step`, called once the in-memory snapshot
  of `step` is taken: SIGKILLs this process while its part of that
  snapshot is being written (its temporary file is there, complete, not
  yet renamed). The part is handed to the manager's writer thread by the
  save (or fit's batch end) after the one that took it, and written on
  that thread: the hook wraps the module's file writer (a look inside),
  on every thread, until the kill."""
  if my_fault(step, ("snapkill",)) is None:
    return
  from jdist._src.checkpoint.snapshots import files  # noqa: PLC0415 (hook)
  tmp = f".tmp-{ME}-{os.getpid()}.snap"
  write_all = files.write_all

  def killing_write_all(path, buffers, *spare):
    written = write_all(path, buffers, *spare)
    header = bytes(buffers[0])
    if os.path.basename(path) == tmp and \
        f'"step": {step}, '.encode() in header and \
        f'"rank": {ME}, '.encode() in header:  # its file (its part)
      directory = os.path.dirname(path)
      say(f"writing {tmp} {os.path.getsize(path)} "
          f"{' '.join(sorted(os.listdir(directory)))}")
      announce("snapkill")
      os.kill(os.getpid(), signal.SIGKILL)
    return written

  files.write_all = killing_write_all


@contextlib.contextmanager
def _killed_when(seen, fault: str):
  """Inside the block, on this thread: at each Python call or return, asks
  `seen()`; once it gives a line, prints it, announces `fault` and
  SIGKILLs this process."""
  def look(frame, event, arg):
    line = seen()
    if line:
      sys.setprofile(None)
      print(line, flush=True)
      announce(fault)
      os.kill(os.getpid(), signal.SIGKILL)

  sys.setprofile(look)
  try:
    yield
  finally:
    sys.setprofile(None)


class Markers(jdist.Callback):
  """fit's markers and faults, as the loop's (after BackupAndRestore)."""

  def on_train_begin(self, logs=None):
    self.first = self.model.global_step
    resumed(self.first)

  def on_train_batch_end(self, batch, logs=None):
    i = self.model.global_step - 1
    after_step(i, i == self.first)
    arm_snapshot_kill(i + 1)  # (BackupAndRestore, before, took it)


def run_fit() -> dict:
  """`Trainer.fit` with `BackupAndRestore` every SAVE_EVERY steps (and a
  snapshot in memory every SNAPSHOT_EVERY)."""
  backup = jdist.BackupAndRestore(os.path.join(OUT, "backup"),
                                  save_freq=SAVE_EVERY,
                                  snapshot_every=SNAPSHOT_EVERY)
  return train.fit(strategy, [backup, Markers()])


def probe(step):
  """With `--snapshot-every`, saved with the state: a leaf split over the
  processes (12 values: 4 or 3 processes hold a block each) that depends
  on the step, so that a restore proves each process's block came back."""
  sharding = NamedSharding(strategy.mesh, P(strategy.mesh.axis_names[0]))
  values = np.arange(12, dtype=np.float32) * 0.5 + step
  return jax.make_array_from_callback((12,), sharding, lambda i: values[i])


def probe4(step):
  """The probe's twin in int4 (half a byte a value on the device, a byte in
  numpy): the replicas' byte packing of a type under a byte wide."""
  sharding = NamedSharding(strategy.mesh, P(strategy.mesh.axis_names[0]))
  values = probe4_values(step)
  return jax.make_array_from_callback((12,), sharding, lambda i: values[i])


def probe4_values(step):
  return ((np.arange(12) + step) % 16 - 8).astype(jnp.int4)


def saved(step, state):
  return ({"state": state, "probe": probe(step), "probe4": probe4(step)}
          if SNAPSHOT_EVERY else state)


def restored(manager, step):
  """The state `manager` restores (at `step`), into the state's shapes: no
  initial state to compute. Checks the probe, with the state."""
  like = jax.eval_shape(train.initial_state)
  if not SNAPSHOT_EVERY:
    return manager.restore(like)
  got = manager.restore({"state": like,
                         "probe": jax.ShapeDtypeStruct((12,), np.float32),
                         "probe4": jax.ShapeDtypeStruct((12,), jnp.int4)})
  for name, want in (("probe", np.arange(12, dtype=np.float32) * 0.5 + step),
                     ("probe4", probe4_values(step))):
    if not np.array_equal(np.asarray(got[name].addressable_data(0)), want):
      raise SystemExit(f"the {name} restored at step {step} is "
                       f"{np.asarray(got[name].addressable_data(0))}, not "
                       f"{want}")
  return got["state"]


def run_loop() -> dict:
  """A custom loop with `jdist.CheckpointManager` every SAVE_EVERY steps."""
  manager = jdist.CheckpointManager(
      os.path.join(OUT, "checkpoints"), max_to_keep=2, strategy=strategy,
      save_every=SAVE_EVERY, snapshot_every=SNAPSHOT_EVERY)
  if SNAPSHOT_EVERY and ME == 0:
    print(f"snapshots {manager._snapshots.directory}", flush=True)
  first = manager.latest_step or 0  # steps done: the next step's index
  if first:
    state = restored(manager, first)
  else:
    state = strategy.replicate(train.initial_state())
  step_fn = strategy.function(train.train_step)
  dataset = train.batches(strategy, first)
  resumed(first)
  for i, b in zip(range(first, train.STEPS), dataset):
    state, _ = step_fn(state, b)
    jax.block_until_ready(state)
    # Every step: the manager saves at multiples of SAVE_EVERY and keeps a
    # snapshot at multiples of SNAPSHOT_EVERY.
    with kill_mid_save(i + 1, manager.directory):
      manager.save(i + 1, saved(i + 1, state))
    arm_snapshot_kill(i + 1)
    after_step(i, i == first)
  manager.close()
  return train.host_params(state)


params = run_fit() if FIT else run_loop()
if ME == 0:
  np.savez(os.path.join(OUT, "final.npz"), world=WORLD, attempt=ATTEMPT,
           **params)
print("finished", flush=True)
