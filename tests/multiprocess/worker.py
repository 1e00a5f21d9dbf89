"""One process of a multi-process test: `python worker.py MODE OUT_DIR`.

Started by the tests in this directory (directly or through `jdist launch`),
two processes with two fake CPU devices each. The cluster comes from jdist's
environment variables. Results go to OUT_DIR/<mode>-<process>.npz (with
`train_all`, one file per training); failures go to stderr, where the tests
look for them.
"""

import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import jdist  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
TIMEOUT = float(os.environ.get("WORKER_TIMEOUT", "0")) or None

if MODE == "no_coordinator":
  jdist.initialize(initialization_timeout=3)
  raise AssertionError("initialize() returned without a coordinator")

if MODE == "hold":  # joins, then holds the run until OUT/release exists
  jdist.initialize(initialization_timeout=30)
  print("joined", flush=True)
  for _ in range(600):
    if os.path.exists(os.path.join(OUT, "release")):
      break
    time.sleep(0.1)
  print("released", flush=True)
  sys.exit(0)

strategy = jdist.MultiWorkerMirroredStrategy(
    communication_options=jdist.CommunicationOptions(timeout_seconds=TIMEOUT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jdist.examples.data import batches, load_digits  # noqa: E402
from jdist.examples.models import MLP  # noqa: E402
from test_conformance import classifier_step, make_state  # noqa: E402

ME = jax.process_index()
VICTIM = int(os.environ.get("WORKER_VICTIM", "1"))
NAME = MODE  # of the training running: its results go to OUT/NAME-<process>.npz


def save(**arrays):
  np.savez(os.path.join(OUT, f"{NAME}-{ME}.npz"), **arrays)


def host(tree):
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def digits():
  x, y = load_digits(image=False)
  return batches(x[:1280], y[:1280], 64)


def train_global(strategy=strategy):
  """The conformance training; every process iterates the same global batches."""
  data = digits()
  step = strategy.function(classifier_step)
  state = strategy.replicate(make_state(MLP(), data[0]["x"]))
  losses = []
  for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
    if i == 0 and ME == 0:  # inspecting the program on one process only
      assert step.lower(state, batch).compile().cost_analysis() is not None
    state, out = step(state, batch)
    losses.append(strategy.reduce("sum", out["loss"]))
  flat = jax.tree_util.tree_flatten_with_path(host(state.params))[0]
  save(losses=np.array([np.asarray(l.addressable_data(0)) for l in losses]),
       **{jax.tree_util.keystr(p): v for p, v in flat})


def train_interleaved():
  """train_global with the replicas alternating between the processes, as a
  TPU pod's ring may order them (each process's replicas are not contiguous)."""
  own = [sorted((d for d in jax.devices() if d.process_index == p),
                key=lambda d: d.id) for p in (0, 1)]
  devices = [d for pair in zip(*own) for d in pair]
  assert [d.process_index for d in devices] == [0, 1, 0, 1]
  train_global(jdist.Strategy(devices))


def train_sharded():
  """Adam with its state split over the 4 replicas of both processes."""
  from test_sharded_optimizer import _train  # the tests' custom loop
  tx = jdist.ShardedOptimizer(optax.adam(1e-2), strategy)
  state, losses, _ = _train(strategy, tx, digits()[:10], own_grads=True)
  from jax.experimental import multihost_utils
  moments = state.opt_state.value[0].mu
  mu = moments["Dense_0"]["kernel"]
  flat = jax.tree_util.tree_flatten_with_path(host(state.params))[0]
  whole = jax.tree_util.tree_flatten_with_path(  # every process's blocks
      multihost_utils.process_allgather(moments, tiled=True))[0]
  save(losses=np.array(losses), mu_blocks=np.array(
      [s.data.shape for s in mu.addressable_shards]),
       **{jax.tree_util.keystr(p): v for p, v in flat},
       **{"mu" + jax.tree_util.keystr(p): np.asarray(v) for p, v in whole})


def per_process_shards():
  """Each process's own per-replica batches; process 1's data ends first."""
  x, y = load_digits(image=False)
  shards = {0: (x[:400], y[:400]), 1: (x[400:560], y[400:560])}
  return shards


def train_per_process():
  shards = per_process_shards()

  def dataset_fn(ctx):
    assert ctx.num_input_pipelines == 2 and ctx.num_replicas_in_sync == 4
    xs, ys = shards[ctx.input_pipeline_id]
    return batches(xs, ys, ctx.get_per_replica_batch_size(64))

  step = strategy.function(classifier_step)
  count = strategy.function(
      lambda batch: jax.numpy.sum(jdist.get_replica_context().example_mask))
  state = strategy.replicate(make_state(MLP(), shards[0][0][:16]))
  seen, steps = 0, 0
  for batch in strategy.distribute_datasets_from_function(dataset_fn):
    state, _ = step(state, batch)
    seen += int(np.asarray(strategy.reduce("sum", count(batch)).addressable_data(0)))
    steps += 1
  flat = jax.tree_util.tree_flatten_with_path(host(state.params))[0]
  save(seen=seen, steps=steps, **{jax.tree_util.keystr(p): v for p, v in flat})


TRAININGS = ("train_global", "train_interleaved", "train_sharded",
             "train_per_process")


def train_all():
  """The trainings above, one after the other, in one run: each saves its
  results as if it had run alone (one start of the processes for the tests
  that read them)."""
  global NAME
  for NAME in TRAININGS:
    MODES[NAME]()


def mismatch():
  """Process 1 uses another learning rate: same shapes, different program."""
  data = digits()[:3]
  step = strategy.function(classifier_step)
  state = strategy.replicate(make_state(MLP(), data[0]["x"], lr=1e-2 * (1 + ME)))
  for batch in strategy.experimental_distribute_dataset(data):
    state, _ = step(state, batch)
  print("mismatch: ran to the end", flush=True)


def misbehave(at_step: int, action):
  data = digits()
  step = strategy.function(classifier_step)
  state = strategy.replicate(make_state(MLP(), data[0]["x"]))
  # Both processes start the loop together: on a loaded machine one may
  # reach it seconds after the other, and the timeout (WORKER_TIMEOUT) would
  # then fire at the first input agreement, not where the test misbehaves.
  multihost_utils.sync_global_devices("misbehave: the loop starts")
  for i, batch in enumerate(strategy.experimental_distribute_dataset(data * 20)):
    if ME == VICTIM and i == at_step:
      print(f"process {ME} misbehaves at step {i}", flush=True)
      action()
    state, out = step(state, batch)
  print("ran to the end", flush=True)


def crash():
  raise RuntimeError(f"boom in process {ME}")


def kill():
  import signal
  os.kill(os.getpid(), signal.SIGKILL)


def stuck():
  time.sleep(60)


def early_exit():
  """Process 1 runs 5 steps, process 0 all: the classic uneven-loop bug."""
  data = digits()
  step = strategy.function(classifier_step)
  state = strategy.replicate(make_state(MLP(), data[0]["x"]))
  ds = strategy.distribute_datasets_from_function(
      lambda ctx: batches(*load_digits(image=False), 16))
  for i, batch in enumerate(ds):
    if ME == 1 and i == 5:
      break
    state, _ = step(state, batch)
  print("loop ended", flush=True)


def evaluate_step(state, batch):
  """The loss of the current parameters, summed over the replicas."""
  logits = state.apply_fn({"params": state.params}, batch["x"], train=False)
  per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return jdist.get_replica_context().all_reduce(
      "sum", jdist.compute_average_loss(per_example))


def leaves_training_early(evaluation: str):
  """Process 1 leaves its training loop after 5 steps and goes on to evaluate
  while process 0 is still in training step 6; no timeout_seconds.

  `evaluation` is how: "dataset" (a new distributed dataset, then the
  evaluation step: the reported case) or "new_step" (the evaluation step,
  first called, on the batch at hand).
  """
  data = digits()
  step = strategy.function(classifier_step)
  evaluate = strategy.function(evaluate_step)
  state = strategy.replicate(make_state(MLP(), data[0]["x"]))
  for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
    if ME == 1 and i == 5:
      break
    state, out = step(state, batch)
    strategy.reduce("sum", out["loss"])
  print(f"process {ME} evaluates at {time.time():.3f}", flush=True)  # wall
  if evaluation == "dataset":
    for batch in strategy.experimental_distribute_dataset(data[:2]):
      strategy.reduce("mean", evaluate(state, batch))
  else:
    jax.block_until_ready(strategy.reduce("mean", evaluate(state, batch)))
  print("ran to the end", flush=True)


def uneven_global():
  data = digits()[:10 - 4 * ME]
  step = strategy.function(classifier_step)
  state = strategy.replicate(make_state(MLP(), data[0]["x"]))
  for batch in strategy.experimental_distribute_dataset(data):
    state, _ = step(state, batch)


def caught(error_type, run):
  """Runs `run`; prints the jdist error it raises as a user catching it would."""
  try:
    run()
  except error_type as e:
    print(f"caught {type(e).__module__}.{type(e).__name__}: {e}", flush=True)
    raise


def rendezvous_after(delay: float):
  """Process 1 reaches the first input agreement `delay` seconds late."""
  data = digits()[:4]
  if ME == 1:
    time.sleep(delay)
  for _ in strategy.experimental_distribute_dataset(data):
    pass


def peer_fails_at_rendezvous():
  """Process 1 fails while process 0 waits for it in the input agreement."""
  if ME == 1:
    time.sleep(4)
    raise RuntimeError("boom before the first batch")
  caught(jdist.PeerFailureError, lambda: rendezvous_after(0))


MODES = {
    "train_global": train_global,
    "train_interleaved": train_interleaved,
    "train_per_process": train_per_process,
    "train_sharded": train_sharded,
    "train_all": train_all,
    "mismatch": mismatch,
    "crash": lambda: misbehave(3, crash),
    "kill": lambda: misbehave(3, kill),
    "stuck": lambda: misbehave(3, stuck),
    "early_exit": early_exit,
    "uneven_global": uneven_global,
    **{f"leaves_training_early_{how}": functools.partial(leaves_training_early, how)
       for how in ("dataset", "new_step")},
    "peer_fails_at_rendezvous": peer_fails_at_rendezvous,
    "late_at_rendezvous": lambda: caught(jdist.CollectiveTimeoutError,
                                         lambda: rendezvous_after(20)),
}

if __name__ == "__main__":
  MODES[MODE]()
