"""What an in-memory snapshot every 10 steps costs the step loop: run under
`jdist launch` (elastic_times.py runs it so).

  python -m jdist.launch -n 2 --devices-per-process 1 benchmarks/snapshot_loop.py

The seed MLP (64 features, Dense 16, Dense 10, a global batch of 64, plain
SGD: multihost_overhead.py's step) in a custom loop over
`jdist.MultiWorkerMirroredStrategy`, STEPS steps a trial (one snapshot's
10 steps: each loop goes on from its own state and step across its
trials, so every trial holds one snapshot taken and one written), without a
`jdist.CheckpointManager`, with one made with `snapshot_every=10` (and no
persistent save in the loop), whose `save` the loop calls at every step
with the parameters (mirrored) and a leaf of as many values split over the
processes (as a `jdist.ShardedOptimizer`'s state is: the part of it each
process holds is what the replicas copy to the next process),
and with the same manager without the replicas on the next process (the
benchmark turns them off inside the manager: there is no option for it).
TRIALS rounds of one trial of each, in an order that turns from round to
round (a round lasts a few tens of milliseconds, so its trials meet the same
load), after WARM_UP rounds not counted; process 0 ends with one JSON line:
the seconds per step of each trial, `{"none": [...], "snapshot": [...],
"unreplicated": [...]}`, by the wall clock and in CPU time of the main
thread (`time.thread_time`: the loop's own work, which the load of other
processes on the machine moves less than the wall clock; a background
thread's is not in it) and of the whole process (`time.process_time`: its
threads, the runtime's and the snapshots' writer's too;
`process_cpu_seconds_per_step`), and the median seconds on process 0 of the
`save` that takes a snapshot (it packs the blocks, or before issue 22's
packing started their copies to the host, and starts the copy to the next
process) and of the next one, which has it written (copy to the host,
checksum, file, rename; and the replica: in the `save` itself when they are
written on the loop's thread, as before issue 22's writer thread), by the
wall clock and in CPU time of the loop's thread (`cpu_take`, `cpu_write`),
and the CPU time of the manager's writer thread per snapshot (`writer_cpu`:
its time over a trial, over the trial's snapshots), for each of the two
managers; `position_seconds`: for each loop, the median seconds of a step
and its `save` by the step's place among the 10 of a snapshot (0: the step
whose `save` takes it, 1: the next, whose `save` hands it to the writer
thread, 2: the step the writer thread writes it beside); `jdist` is where
the jdist it ran is (a checkout of another commit, for a comparison).
`--quick` runs 2 rounds after 1 (a smoke run).
"""

import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jdist  # noqa: E402

strategy = jdist.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

QUICK = "--quick" in sys.argv[1:]
EVERY = 10
# A trial is one snapshot's EVERY steps: the loops take turns every few
# milliseconds, so that a round's trials meet the same load.
STEPS, TRIALS, WARM_UP = (EVERY, 2, 1) if QUICK else (EVERY, 600, 5)


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, 16)) * 0.1, "b1": jnp.zeros(16),
          "w2": jax.random.normal(k2, (16, 10)) * 0.1, "b2": jnp.zeros(10)}


def apply(p, x):
  return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def train_step(params, batch):
  def loss_fn(p):
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        apply(p, batch["x"]), batch["y"])
    return jdist.compute_average_loss(per_example)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


rng = np.random.default_rng(0)
batch = next(iter(strategy.experimental_distribute_dataset(
    [{"x": rng.standard_normal((64, 64)).astype(np.float32),
      "y": rng.integers(0, 10, 64).astype(np.int32)}])))
step = strategy.function(train_step)
params = strategy.replicate(init_params(jax.random.key(0)))
jax.block_until_ready(step(params, batch))  # compiled before the trials
size = sum(x.size for x in jax.tree.leaves(params))
size += -size % len(jax.devices())
split_leaf = jax.make_array_from_callback(
    (size,), jax.sharding.NamedSharding(
        strategy.mesh, jax.sharding.PartitionSpec(strategy.mesh.axis_names[0])),
    lambda i: np.arange(size, dtype=np.float32)[i])


# Seconds of the saves, in timed trials, of each manager.
SPLIT = {k: {"take": [], "write": [], "cpu_take": [], "cpu_write": [],
             "writer_cpu": []} for k in ("snapshot", "unreplicated")}


def writer_seconds(manager) -> float:
  """The CPU seconds of `manager`'s writer thread so far (a look inside:
  its thread, started at its first snapshot), or 0."""
  thread = manager._snapshots._writer._thread if manager else None
  if thread is None:
    return 0.0
  return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def trial(name: str, split=None) -> tuple:
  """Seconds per step of the next STEPS steps of loop `name` (the
  manager's `save` at each), by the wall clock, in the main thread's CPU
  time and in the process's; each step's seconds (and its `save`'s) go to
  POSITIONS by its place among the EVERY steps of a snapshot."""
  manager = managers.get(name)
  state, done = carried[name]
  t, c, pc = time.perf_counter(), time.thread_time(), time.process_time()
  writer = writer_seconds(manager)
  for i in range(done, done + STEPS):
    t0 = time.perf_counter()
    state, _ = step(state, batch)
    if manager is not None:
      t1, c0 = time.perf_counter(), time.thread_time()
      manager.save(i + 1, {"params": state, "split": split_leaf})
      # The save that takes a snapshot, and the next one, which writes it.
      part = {0: "take", 1: "write"}.get((i + 1) % EVERY)
      if part and split is not None:
        split[part].append(time.perf_counter() - t1)
        split[f"cpu_{part}"].append(time.thread_time() - c0)
    POSITIONS[name][(i + 1) % EVERY].append(time.perf_counter() - t0)
  jax.block_until_ready(state)
  carried[name] = (state, done + STEPS)
  if split is not None and writer:
    split["writer_cpu"].append((writer_seconds(manager) - writer) /
                               (STEPS // EVERY))
  return ((time.perf_counter() - t) / STEPS, (time.thread_time() - c) / STEPS,
          (time.process_time() - pc) / STEPS)


# One checkpoint directory for the job (every process names the same one);
# persistent saves never come due in it: only the snapshots are measured.
run_id = os.environ["JDIST_RUN_ID"]
directories = [os.path.join(tempfile.gettempdir(),
                            f"jdist-snapshot-loop-{run_id}-{i}") for i in (0, 1)]
managers = {name: jdist.CheckpointManager(
    d, strategy=strategy, save_every=10 ** 9, snapshot_every=EVERY)
    for name, d in zip(("snapshot", "unreplicated"), directories)}
# No replica on the next process (a look inside: there is no option).
managers["unreplicated"]._snapshots._peer = None
names = ["none", *managers]
times = {name: [] for name in names}
cpu = {name: [] for name in names}
process_cpu = {name: [] for name in names}
carried = {name: (params, 0) for name in names}  # each loop's state, steps
POSITIONS = {name: [[] for _ in range(EVERY)] for name in names}
for _ in range(WARM_UP):
  for name in names:
    trial(name, SPLIT.get(name))
for v in [*SPLIT["snapshot"].values(), *SPLIT["unreplicated"].values()]:
  v.clear()
POSITIONS.update({name: [[] for _ in range(EVERY)] for name in names})
for r in range(TRIALS):
  for name in names[r % 3:] + names[:r % 3]:  # each first in turn
    wall, main, process = trial(name, SPLIT.get(name))
    times[name].append(wall)
    cpu[name].append(main)
    process_cpu[name].append(process)
for manager in managers.values():
  manager.close()
median = lambda v: sorted(v)[len(v) // 2] if v else 0.0
if jax.process_index() == 0:
  for d in directories:
    shutil.rmtree(d, ignore_errors=True)
  print(json.dumps({"steps": STEPS, "trials": TRIALS, "every": EVERY,
                    "jdist": os.path.dirname(os.path.dirname(jdist.__file__)),
                    "seconds_per_step": times,
                    "cpu_seconds_per_step": cpu,
                    "process_cpu_seconds_per_step": process_cpu,
                    "snapshot_seconds": {k: median(v) for k, v in
                                         SPLIT["snapshot"].items()},
                    "unreplicated_seconds": {k: median(v) for k, v in
                                             SPLIT["unreplicated"].items()},
                    "position_seconds": {
                        name: [median(v) for v in POSITIONS[name]]
                        for name in names}}),
        flush=True)
