"""Per-step overhead: a jdist step against the same step written by hand.

The hand-written step is what a JAX expert writes without jdist: `jax.jit` of
`jax.shard_map` over a one-axis mesh, the gradient of the globally scaled loss
(already summed by autodiff), optax update, mirrored in/out specs. The jdist
step is the user's per-replica function under `strategy.function`, fed batches
from `experimental_distribute_dataset` (so it also carries the padding mask and
valid count). Both run the same pre-placed batch; blocks of steps alternate
between the two so that machine noise hits both alike, and the figure is the
median over rounds of the ratio of steps per second.

Per call, it also reports what each call costs the calling thread: its CPU
time per step (the same rounds), and with `--instructions` the instructions
one call executes on it, counted by valgrind's callgrind inside the loop of
calls only (compilation and the device threads left out; callgrind's
instrumentation is turned on only after the warm-up, with
`callgrind_control`, which makes a run several times shorter), on the
device counts of `--devices` (default 2). Instructions are repeatable on a
shared machine; times are not.

Run inside a process with enough fake devices (benchmarks/run.py does this):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/overhead.py

`JDIST_BENCH_SOURCE=DIR` measures the jdist package found in DIR instead of
the installed one (how benchmarks/overhead_before.json was taken, from the
jdist of an earlier commit).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_SOURCE = os.environ.get("JDIST_BENCH_SOURCE")
if _SOURCE:  # before `import jdist`: leave the editable install's finder out
  sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
  sys.path.insert(0, _SOURCE)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jdist  # noqa: E402
from jdist.examples.models import CNN, MLP  # noqa: E402
from jdist.examples.steps import classifier_step  # noqa: E402


def _model_and_data(name: str, batch: int):
  rng = np.random.default_rng(0)
  if name == "mlp":
    model = MLP(hidden=16, classes=10)
    x = rng.standard_normal((batch, 10)).astype(np.float32)
  else:
    model = CNN()
    x = rng.standard_normal((batch, 28, 28, 1)).astype(np.float32)
  y = rng.integers(0, 10, batch).astype(np.int32)
  params = model.init(jax.random.key(0), x[:1])["params"]
  return model, params, x, y


def hand_written(model, tx, devices, global_batch):
  """`(place, step_once)` of the hand-written step; `step_once(carry)` runs
  one step and returns the next carry."""
  mesh = Mesh(np.array(devices), ("r",), axis_types=(AxisType.Auto,))

  def body(params, opt, x, y):
    def loss_fn(p):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, y).sum() / global_batch
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt)
    return optax.apply_updates(params, updates), opt, loss[None]

  step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(), P(), P("r"), P("r")),
      out_specs=(P(), P(), P("r"))))

  def place(params, opt, x, y):
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("r"))
    return (jax.device_put(params, rep), jax.device_put(opt, rep),
            jax.device_put(x, shard), jax.device_put(y, shard), None)

  # The same CPU-deadlock guard jdist uses: wait for step k-1
  # after dispatching step k, when a CPU mesh has several devices.
  throttle = devices[0].platform == "cpu" and len(devices) > 1

  def step_once(carry):
    params, opt, x, y, previous = carry
    params, opt, loss = step(params, opt, x, y)
    if throttle:
      if previous is not None:
        previous.block_until_ready()
      previous = loss
    return params, opt, x, y, previous

  return place, step_once


def with_jdist(model, tx, devices):
  """`(place, step_once)` of the same step under `strategy.function`."""
  strategy = jdist.MirroredStrategy(devices)

  step = strategy.function(classifier_step(
      lambda p, x: model.apply({"params": p}, x), tx))

  def place(params, opt, x, y):
    state = strategy.replicate((params, opt))
    batch = next(iter(strategy.experimental_distribute_dataset(
        [{"x": x, "y": y}])))
    return state, batch

  def step_once(carry):
    state, batch = carry
    state, _ = step(state, batch)
    return state, batch

  return place, step_once


def _impls(name: str, n: int, batch: int, which=("hand", "jdist")):
  """`{"hand": ..., "jdist": ...}`: each `(carry, step_once)`, warmed up."""
  devices = jax.local_devices()[:n]
  model, params, x, y = _model_and_data(name, batch)
  tx = optax.sgd(1e-3)
  opt = tx.init(params)
  make = {"hand": lambda: hand_written(model, tx, devices, batch),
          "jdist": lambda: with_jdist(model, tx, devices)}
  out = {}
  for k in which:
    place, step_once = make[k]()
    carry = place(params, opt, x, y)
    for _ in range(3):  # compile and warm up
      carry = step_once(carry)
    jax.block_until_ready(carry)
    out[k] = carry, step_once
  return out


def measure(name: str, n: int, *, batch: int, steps: int, rounds: int) -> dict:
  impls = _impls(name, n, batch)
  carries = {k: carry for k, (carry, _) in impls.items()}
  times = {k: [] for k in impls}
  thread = {k: [] for k in impls}  # the calling thread's CPU time per step
  for r in range(rounds):
    order = ("hand", "jdist") if r % 2 == 0 else ("jdist", "hand")
    for k in order:
      step_once = impls[k][1]
      start, cpu = time.perf_counter(), time.thread_time()
      carry = carries[k]
      for _ in range(steps):
        carry = step_once(carry)
      jax.block_until_ready(carry)
      carries[k] = carry
      times[k].append((time.perf_counter() - start) / steps)
      thread[k].append((time.thread_time() - cpu) / steps)
  ratios = [h / j for h, j in zip(times["hand"], times["jdist"])]
  return {"model": name, "devices": n, "batch": batch,
          "hand_steps_per_s": 1 / statistics.median(times["hand"]),
          "jdist_steps_per_s": 1 / statistics.median(times["jdist"]),
          "ratio": statistics.median(ratios),
          "ratio_spread": [min(ratios), max(ratios)],
          "hand_thread_us": 1e6 * statistics.median(thread["hand"]),
          "jdist_thread_us": 1e6 * statistics.median(thread["jdist"])}


def count_calls(which: str, calls: int, n: int = 2) -> None:
  """Runs `calls` steps of one implementation (MLP, batch 256, `n` devices)
  inside `functools.reduce`, the one function callgrind counts in."""
  carry, step_once = _impls("mlp", n, 256, (which,))[which]
  if os.environ.get("JDIST_INSTRUMENT_LATE"):
    _instrument_now()
  jax.block_until_ready(functools.reduce(lambda c, _: step_once(c),
                                         range(calls), carry))


def _instrument_now() -> None:
  """Turns callgrind's instrumentation on in this process (started without
  it, `--instr-atstart=no`: importing and compiling run at a fraction of
  callgrind's cost). Callgrind reads the command while this process runs,
  so it spins until the command has been answered."""
  control = subprocess.Popen(["callgrind_control", "-i", "on",
                              str(os.getpid())], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  while control.poll() is None:
    sum(range(1000))



def instructions(calls: int, n: int = 2, keep: str | None = None) -> dict:
  """Instructions per call on the calling thread, hand-written and jdist,
  counted by callgrind on `n` devices (None without valgrind).

  Args:
    keep: a directory to keep callgrind's files in (`callgrind_annotate`
      them for the instructions per function), or None.
  """
  valgrind = shutil.which("valgrind")
  if valgrind is None:
    return None
  out = {"calls": calls, "devices": n}
  # Instrumentation turned on after the warm-up (import and compilation run
  # uninstrumented, several times faster): see `_instrument_now`.
  late = shutil.which("callgrind_control") is not None
  with tempfile.TemporaryDirectory() as tmp:
    tmp = keep or tmp
    for which in ("hand", "jdist"):
      subprocess.run(
          [valgrind, "--tool=callgrind", "--separate-threads=yes",
           *(["--instr-atstart=no"] if late else []),
           "--collect-atstart=no", "--toggle-collect=functools_reduce",
           f"--callgrind-out-file={tmp}/{which}-{n}.%p", sys.executable,
           __file__, "--count-calls", which, str(calls), str(n)],
          check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
          env=dict(os.environ, JDIST_INSTRUMENT_LATE="1" if late else "",
                   XLA_FLAGS=(
                       f"--xla_force_host_platform_device_count={max(n, 2)}")))
      (main_thread,) = glob.glob(f"{tmp}/{which}-{n}.*-01")
      with open(main_thread) as f:
        total = int(re.search(r"^summary: (\d+)", f.read(), re.M).group(1))
      out[which] = total / calls
  return out


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--devices", help="device counts, e.g. 1,2 (default "
                      "1,2,4; with --instructions, 2)")
  parser.add_argument("--steps", type=int, help="steps per round, both models (tests)")
  parser.add_argument("--rounds", type=int, help="rounds, both models (tests)")
  parser.add_argument("--instructions", type=int, metavar="CALLS",
                      help="only count the calling thread's instructions per "
                           "call over CALLS calls (MLP; valgrind)")
  parser.add_argument("--keep-profiles", metavar="DIR",
                      help="with --instructions: keep callgrind's files in DIR")
  parser.add_argument("--count-calls", nargs=3, metavar=("WHICH", "CALLS", "N"),
                      help=argparse.SUPPRESS)  # what --instructions runs
  args = parser.parse_args(argv)
  if args.count_calls:
    count_calls(args.count_calls[0], *map(int, args.count_calls[1:]))
    return None
  if args.instructions:
    counts = [int(d) for d in (args.devices or "2").split(",")]
    found = [instructions(args.instructions, n, args.keep_profiles)
             for n in counts]
    result = found[0] if len(found) == 1 else found
    print(json.dumps(result) if args.json else result)
    return result
  results = []
  for n in (int(d) for d in (args.devices or "1,2,4").split(",")):
    if n > len(jax.local_devices()):
      continue
    results.append(measure("mlp", n, batch=256,
                           steps=args.steps or (100 if args.quick else 400),
                           rounds=args.rounds or (5 if args.quick else 15)))
    results.append(measure("cnn", n, batch=64,
                           steps=args.steps or (3 if args.quick else 10),
                           rounds=args.rounds or (3 if args.quick else 7)))
  if args.json:
    print(json.dumps(results))
  else:
    for r in results:
      print(f"{r['model']:>4} {r['devices']} dev: hand {r['hand_steps_per_s']:9.1f} "
            f"steps/s, jdist {r['jdist_steps_per_s']:9.1f} steps/s, ratio "
            f"{r['ratio']:.3f} [{r['ratio_spread'][0]:.3f}, {r['ratio_spread'][1]:.3f}]"
            f"; calling thread {r['hand_thread_us']:.1f} vs "
            f"{r['jdist_thread_us']:.1f} us/step")
  return results


if __name__ == "__main__":
  main()
