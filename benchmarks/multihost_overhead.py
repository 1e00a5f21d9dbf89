"""What multi-process jdist costs: run under `jdist launch`, or alone.

  python -m jdist.launch -n 2 --devices-per-process 2 benchmarks/multihost_overhead.py
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/multihost_overhead.py
  ... benchmarks/multihost_overhead.py --quick --json   # a smoke run: seconds

Measures, for a tiny MLP step (64 features, Dense 16, Dense 10, batch 64):
the jdist step against the same step hand-written with jax.jit + shard_map
(same throttle), a bare cross-replica psum, the step monitor's share, the
program check at the first call, the per-process input agreement, and the
fingerprint that lets processes compare the global batches they read
(alone, for batches of several sizes, and as a share of iterating
experimental_distribute_dataset across processes).
Process 0 prints the medians (and minima) of 9 alternating trials; on a
shared machine the minimum is the better estimate of the intrinsic cost.
`--quick` runs 5 steps in 1 trial (too few to quote); `--json` ends process
0's output with one JSON line of the figures it printed.
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jdist  # noqa: E402

strategy = jdist.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jdist._src.input import agreement  # noqa: E402
from jdist._src.runtime import program_check  # noqa: E402

QUICK = "--quick" in sys.argv[1:]
STEPS, TRIALS = (5, 1) if QUICK else (200, 9)
REPEATS = 20 if QUICK else 2000  # fingerprints per timing
report = {"steps": STEPS, "trials": TRIALS}  # what --json prints
ME = jax.process_index()
AXIS = strategy.axis_name
N = strategy.num_replicas_in_sync


def say(*args):
  if ME == 0:
    print(*args, flush=True)


def init_params(key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, 16)) * 0.1, "b1": jnp.zeros(16),
          "w2": jax.random.normal(k2, (16, 10)) * 0.1, "b2": jnp.zeros(10)}


def apply(p, x):
  return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def jdist_step(params, batch):
  def loss_fn(p):
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        apply(p, batch["x"]), batch["y"])
    return jdist.compute_average_loss(per_example)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def hand_body(params, x, y, n_valid):
  def loss_fn(p):
    per_example = optax.softmax_cross_entropy_with_integer_labels(apply(p, x[0]), y[0])
    return jnp.sum(per_example) / n_valid
  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss[None]


hand_step = jax.jit(jax.shard_map(
    hand_body, mesh=strategy.mesh, in_specs=(P(), P(AXIS), P(AXIS), P()),
    out_specs=(P(), P(AXIS)), check_vma=True))
psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, AXIS), mesh=strategy.mesh,
                             in_specs=P(AXIS), out_specs=P(), check_vma=True))

rng = np.random.default_rng(0)
x = rng.standard_normal((64, 64)).astype(np.float32)
y = rng.integers(0, 10, 64).astype(np.int32)
batch = next(iter(strategy.experimental_distribute_dataset([{"x": x, "y": y}])))
params = strategy.replicate(init_params(jax.random.key(0)))
n_valid = strategy.replicate(np.float32(64))

checks = []
original_check = program_check.StepGuard.check_program


def timed_check(self, name, closed_jaxpr):
  t = time.perf_counter()
  text = str(closed_jaxpr)
  t_text = time.perf_counter() - t
  original_check(self, name, closed_jaxpr)
  checks.append((time.perf_counter() - t, t_text, len(text)))


program_check.StepGuard.check_program = timed_check
step = strategy.function(jdist_step)
if jax.process_count() > 1:  # start together: the check then costs no waiting
  from jax.experimental import multihost_utils
  multihost_utils.sync_global_devices("first call")
t = time.perf_counter()
jax.block_until_ready(step(params, batch))
first_call = time.perf_counter() - t


def loop(call):
  prev = None
  t = time.perf_counter()
  for _ in range(STEPS):
    out = call()
    leaf = jax.tree.leaves(out)[-1]
    if prev is not None:
      prev.block_until_ready()  # jdist's CPU throttle, for a fair comparison
    prev = leaf
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / STEPS * 1e6


def run_jdist():
  return loop(lambda: step(params, batch))


def run_hand():
  return loop(lambda: hand_step(params, batch.values["x"], batch.values["y"],
                                n_valid))


ones = jax.make_array_from_process_local_data(
    NamedSharding(strategy.mesh, P(AXIS)),
    np.ones(len(jax.local_devices()), np.float32), (N,))


def run_psum():
  return loop(lambda: psum(ones))


def run_untracked():
  saved = step._guard
  step._guard = None  # what the step costs without the monitor's bookkeeping
  try:
    return run_jdist()
  finally:
    step._guard = saved


runs = {"jdist step": run_jdist, "hand-written jit+shard_map": run_hand,
        "bare psum": run_psum}
if step._guard is not None:
  runs["jdist step, monitor off"] = run_untracked
hand_step(params, batch.values["x"], batch.values["y"], n_valid)
for fn in runs.values():
  fn()  # warm up
times = {k: [] for k in runs}
for _ in range(TRIALS):
  for k, fn in runs.items():
    times[k].append(fn())
med = {k: statistics.median(v) for k, v in times.items()}
best = {k: min(v) for k, v in times.items()}
where = (f"{jax.process_count()} processes x {len(jax.local_devices())} devices"
         if jax.process_count() > 1 else f"1 process x {N} devices")
hand_name = "hand-written jit+shard_map"
report.update(where=where, us_per_step={k: {"median": med[k], "min": best[k]}
                                        for k in med},
              first_call_ms=first_call * 1e3,
              jdist_vs_hand=med[hand_name] / med["jdist step"])
say(f"== {where}, {STEPS} steps x {TRIALS} trials, us/step: median (min)")
for k, v in med.items():
  say(f"{k:32s} {v:9.1f} ({best[k]:.1f})")
hand = "hand-written jit+shard_map"
say(f"jdist / hand-written speed: {med[hand] / med['jdist step']:.3f} median, "
    f"{best[hand] / best['jdist step']:.3f} min")
if "jdist step, monitor off" in med:
  off = "jdist step, monitor off"
  say(f"monitor bookkeeping: {med['jdist step'] - med[off]:+.1f} us/step median, "
      f"{best['jdist step'] - best[off]:+.1f} min")
say(f"first call (trace + program check + compile): {first_call * 1e3:.0f} ms")
if checks:
  total, t_text, size = checks[0]
  report["program_check_ms"] = {"total": total * 1e3, "jaxpr_text": t_text * 1e3,
                                "jaxpr_chars": size}
for total, t_text, size in checks:
  # Every process reports: the later one to arrive waits least (no skew).
  print(f"[process {ME}] program check: {total * 1e3:.1f} ms, of which printing "
        f"the jaxpr ({size} chars) {t_text * 1e3:.1f} ms", flush=True)

if jax.process_count() > 1:
  lat = []
  for i in range(200):
    t = time.perf_counter()
    strategy.runtime.exchange(f"bench/{i}/", "x", timeout=60, what="a benchmark")
    lat.append((time.perf_counter() - t) * 1e6)
  report["exchange_us"] = {"median": statistics.median(lat), "min": min(lat),
                          "window": agreement.WINDOW}
  say(f"one key-value exchange (both processes): median {statistics.median(lat):.0f}"
      f" us, min {min(lat):.0f} us; per step at the default window of "
      f"{agreement.WINDOW}: ~{statistics.median(lat) / agreement.WINDOW:.0f} us")
  per_replica = [{"x": x[:16], "y": y[:16]}] * 400  # 200 steps per process

  def iterate(window):
    saved = agreement.WINDOW
    agreement.WINDOW = window
    try:
      t = time.perf_counter()
      n = sum(1 for _ in strategy.distribute_datasets_from_function(
          lambda ctx: per_replica))
      return (time.perf_counter() - t) / n * 1e6
    finally:
      agreement.WINDOW = saved

  iterate(8)
  res = {w: statistics.median(iterate(w) for _ in range(3)) for w in (8, 1, 400)}
  report["agreement_us_per_step"] = {str(w): v for w, v in res.items()}
  say("input agreement, us per step of distribute_datasets_from_function "
      "(200 steps, no training):")
  for w, v in res.items():
    say(f"  window {w:3d}: {v:7.1f}")
  say(f"  => agreement cost per step at the default window 8: "
      f"{res[8] - res[400]:+.1f} us (one exchange: ~{res[1] - res[400]:.0f} us)")


# --- the global batches' fingerprint ------------------------------------------
# Across processes, experimental_distribute_dataset hashes a bounded sample of
# each global batch (every row, a few elements of each) so that the processes
# can compare the batches they read. Its cost alone, per batch:
shapes = {
    "MLP batch: x 64x64 float32, y 64": (
        {"x": x, "y": y}),
    "digits images: x 256x8x8x1 float32, y 256": (
        {"x": rng.standard_normal((256, 8, 8, 1)).astype(np.float32),
         "y": rng.integers(0, 10, 256)}),
    "ImageNet-sized: x 128x224x224x3 uint8, y 128": (
        {"x": rng.integers(0, 255, (128, 224, 224, 3), dtype=np.uint8),
         "y": rng.integers(0, 1000, 128)}),
}


def time_fingerprint(leaves, repeats=REPEATS):
  t = time.perf_counter()
  for _ in range(repeats):
    agreement.fingerprint(leaves)
  return (time.perf_counter() - t) / repeats * 1e6


say(f"fingerprint of one global batch, us (median of {TRIALS} trials, min):")
for name, batch_ in shapes.items():
  leaves = [np.asarray(v) for v in jax.tree.leaves(batch_)]
  agreement.fingerprint(leaves)
  trials = [time_fingerprint(leaves) for _ in range(TRIALS)]
  report.setdefault("fingerprint_us", {})[name] = {
      "median": statistics.median(trials), "min": min(trials)}
  say(f"  {name:48s} {statistics.median(trials):7.1f} ({min(trials):.1f})")

if jax.process_count() > 1:
  global_batches = [{"x": x, "y": y}] * 200

  def iterate_global(fingerprinted):
    """us per batch of a pass over 200 global batches (no training)."""
    saved = agreement.fingerprint
    if not fingerprinted:  # today's input path before the fingerprint
      agreement.fingerprint = lambda leaves: None
    try:
      t = time.perf_counter()
      n = sum(1 for _ in strategy.experimental_distribute_dataset(global_batches))
      return (time.perf_counter() - t) / n * 1e6
    finally:
      agreement.fingerprint = saved

  iterate_global(True)
  runs_ = {True: [], False: []}
  for _ in range(TRIALS):  # alternating, so both see the same load
    for fingerprinted in (False, True):
      runs_[fingerprinted].append(iterate_global(fingerprinted))
  med_ = {k: statistics.median(v) for k, v in runs_.items()}
  report["global_batches_us"] = {
      ("with" if k else "without"): {"median": med_[k], "min": min(v)}
      for k, v in runs_.items()}
  say("experimental_distribute_dataset across processes, us per batch "
      f"(200 batches of 64, no training; median of {TRIALS}, min):")
  say(f"  without the fingerprint {med_[False]:7.1f} ({min(runs_[False]):.1f})")
  say(f"  with the fingerprint    {med_[True]:7.1f} ({min(runs_[True]):.1f})")
  say(f"  => fingerprint cost per batch: {med_[True] - med_[False]:+.1f} us "
      f"median ({(med_[True] / med_[False] - 1) * 100:+.1f}%), "
      f"{min(runs_[True]) - min(runs_[False]):+.1f} us min")

if "--json" in sys.argv[1:]:
  say(json.dumps(report))
