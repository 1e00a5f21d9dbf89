"""What `jdist.Trainer.fit` costs over a hand-written `strategy.function` loop.

Both train the seed MLP with adam on the same synthetic data, same global
batches, same strategy; the hand-written loop only steps and reads the last
loss, while `fit` also shuffles, accumulates loss and accuracy on the devices
and draws a progress bar (verbose=0 here: no terminal in a benchmark).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/fit_overhead.py
    python benchmarks/fit_overhead.py --quick --json   # seconds: a smoke run
    python benchmarks/fit_overhead.py --instructions   # valgrind: per step

With `--instructions`, each loop's instructions per step on the thread that
runs it, on one device, counted by valgrind's callgrind (repeatable on a
shared machine, where times are not): a process per loop, warmed up
(compiled) before callgrind's instrumentation is turned on, counts inside
`functools.reduce` around a run of 1 and one of 3 epochs; the difference
over the steps between them leaves each run's fixed cost out. With
`--against DIR` as well, the same loops are counted again with the jdist
package found in DIR (another checkout), in the same run:

    python benchmarks/fit_overhead.py --instructions 1 --against /path/to/main

`JDIST_BENCH_SOURCE=DIR` measures the jdist package found in DIR instead of
this checkout's (as in benchmarks/overhead.py).

The three loops alternate round by round (each timing a few epochs), so that
the machine's noise hits them alike; a ratio is the median over rounds of
the two loops' speeds in the same round.
"""

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

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
_SOURCE = os.environ.get("JDIST_BENCH_SOURCE")
if _SOURCE:  # before `import jdist`: leave the editable install's finder out
  sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]

import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, _SOURCE or
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jdist  # noqa: E402
import provenance  # noqa: E402  (RESULTS.md's "from which run")
from jdist.examples.data import synthetic  # noqa: E402
from jdist.examples.models import MLP  # noqa: E402
from jdist.examples.steps import classifier_step  # noqa: E402

FULL = {"examples": 32_768, "epochs": 3, "rounds": 15, "one_device": True}
QUICK = {"examples": 1_024, "epochs": 1, "rounds": 1, "one_device": False}
BATCH = 256
LOOPS = ("hand-written", "fit", "fit, shuffle=False")


def hand_written(strategy, x, y):
  model, tx = MLP(), optax.adam(1e-3)
  params = model.init(jax.random.key(0), x[:1])["params"]
  state = strategy.replicate((params, tx.init(params)))

  step = strategy.function(classifier_step(
      lambda p, x: model.apply({"params": p}, x), tx))

  batches = [{"x": x[i:i + BATCH], "y": y[i:i + BATCH]}
             for i in range(0, len(x), BATCH)]
  def run(epochs):
    nonlocal state
    for _ in range(epochs):
      for batch in strategy.experimental_distribute_dataset(batches):
        state, loss = step(state, batch)
    return float(strategy.reduce("sum", loss))
  return run


def with_fit(strategy, x, y, shuffle=True):
  trainer = jdist.Trainer(MLP(), optimizer=optax.adam(1e-3),
                          loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], strategy=strategy)
  def run(epochs):
    return trainer.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=shuffle,
                       verbose=0).history["loss"][-1]
  return run


def compare(runs: dict, epochs: int, rounds: int) -> tuple[dict, dict]:
  """Seconds per round of each loop, the loops alternating, and the CPU
  seconds the loop's thread spent in each round (its own: what a worker
  thread takes off it shows, and other processes' load shows less)."""
  for run in runs.values():
    run(1)  # compile
  seconds = {name: [] for name in runs}
  loop_cpu = {name: [] for name in runs}
  for _ in range(rounds):
    for name, run in runs.items():
      start, cpu = time.perf_counter(), time.thread_time()
      run(epochs)
      seconds[name].append(time.perf_counter() - start)
      loop_cpu[name].append(time.thread_time() - cpu)
  return seconds, loop_cpu


def measure(settings: dict) -> dict:
  x, y = synthetic(settings["examples"], 64, 10)
  steps = settings["epochs"] * (settings["examples"] // BATCH)
  rows = []
  counts = (1,) * settings["one_device"] + (len(jax.local_devices()),)
  for n in dict.fromkeys(counts):
    strategy = jdist.MirroredStrategy(jax.local_devices()[:n])
    seconds, loop_cpu = compare(dict(zip(LOOPS, (
        hand_written(strategy, x, y), with_fit(strategy, x, y),
        with_fit(strategy, x, y, shuffle=False)))),
        settings["epochs"], settings["rounds"])
    hand = seconds[LOOPS[0]]
    rows.append({
        "devices": n, "seconds": seconds,
        "steps_per_s": {k: statistics.median(steps / t for t in v)
                        for k, v in seconds.items()},
        "loop_cpu_us_per_step": {k: statistics.median(v) / steps * 1e6
                                 for k, v in loop_cpu.items()},
        # A loop's speed over the hand-written one's: their times' ratio.
        "vs_hand": {k: statistics.median(h / t for h, t in zip(hand, v))
                    for k, v in seconds.items() if k != LOOPS[0]}})
  return {**settings, "batch": BATCH, "steps_per_round": steps, "rows": rows}


def section(res: dict) -> list:
  """The RESULTS.md section of this benchmark."""
  lines = [
      "## Trainer.fit vs a hand-written loop",
      "",
      provenance.line(res["provenance"]),
      "",
      f"The seed MLP with adam, {res['examples']:,} synthetic examples, global "
      f"batch {res['batch']}: `jdist.Trainer.fit` (shuffling, loss and "
      "accuracy accumulated on the devices, verbose=0) against a "
      "`strategy.function` loop over `experimental_distribute_dataset` that "
      f"only steps. Rounds: {res['rounds']}, of {res['epochs']} epoch(s) each, "
      "the loops alternating; steps/s is the median over rounds, **vs "
      "hand-written** the median of the same round's speed ratios; **loop "
      "thread** the median CPU time per step of the thread that runs the "
      "loop (hand-written / fit / fit, shuffle=False), which a worker "
      "thread's work does not count in.",
      "",
      "| devices | hand-written steps/s | fit steps/s | fit vs hand-written "
      "| fit, shuffle=False steps/s | vs hand-written "
      "| loop thread, us/step |",
      "|---|---|---|---|---|---|---|",
  ]
  for r in res["rows"]:
    sps, vs = r["steps_per_s"], r["vs_hand"]
    cpu = " / ".join(f"{r['loop_cpu_us_per_step'][k]:.0f}" for k in LOOPS)
    lines.append(
        f"| {r['devices']} | {sps[LOOPS[0]]:,.0f} | {sps[LOOPS[1]]:,.0f} | "
        f"**{vs[LOOPS[1]]:.2f}x** | {sps[LOOPS[2]]:,.0f} | "
        f"**{vs[LOOPS[2]]:.2f}x** | {cpu} |")
  return lines


INSTRUCTION_EXAMPLES = 4_096  # 16 steps an epoch
INSTRUCTION_EPOCHS = (1, 3)


def _callgrind(*command: str) -> None:
  """Sends callgrind `command` for this process and waits for its answer
  (callgrind reads it while this process runs code: it spins)."""
  control = subprocess.Popen(["callgrind_control", *command,
                              str(os.getpid())], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  while control.poll() is None:
    sum(range(1000))


def count_steps(which: int) -> None:
  """Runs loop `which` (an index into LOOPS) on one device, after a
  warm-up run, for each of INSTRUCTION_EPOCHS inside `functools.reduce`
  (the one function callgrind counts in), with a callgrind dump after each."""
  strategy = jdist.MirroredStrategy(jax.local_devices()[:1])
  x, y = synthetic(INSTRUCTION_EXAMPLES, 64, 10)
  make = (hand_written, with_fit,
          functools.partial(with_fit, shuffle=False))[which]
  run = make(strategy, x, y)
  run(1)  # compiles
  _callgrind("-i", "on")
  for epochs in INSTRUCTION_EPOCHS:
    functools.reduce(lambda _, e: run(e), [epochs], None)
    _callgrind("-d")


def instructions(loops, keep: str | None = None,
                 source: str | None = None) -> dict | None:
  """Instructions per step of each of `loops` (indices into LOOPS) on the
  thread that runs it (one device), or None without valgrind: the
  difference between the runs of INSTRUCTION_EPOCHS epochs over the steps
  between them, so each run's fixed cost drops out.

  Args:
    keep: a directory to keep callgrind's files in (`callgrind_annotate`
      them for the instructions per function), or None.
    source: a directory whose jdist package is counted (None: this one's).
  """
  valgrind = shutil.which("valgrind")
  if valgrind is None or shutil.which("callgrind_control") is None:
    return None
  steps = INSTRUCTION_EXAMPLES // BATCH
  out = {"devices": 1, "steps_per_epoch": steps,
         "epochs": list(INSTRUCTION_EPOCHS)}
  env = dict(os.environ)
  if source:
    env["JDIST_BENCH_SOURCE"] = source
  with tempfile.TemporaryDirectory() as tmp:
    tmp = keep or tmp
    for i in loops:
      prefix = f"{tmp}/{'against-' if source else ''}{i}"
      subprocess.run(
          [valgrind, "--tool=callgrind", "--separate-threads=yes",
           "--instr-atstart=no", "--collect-atstart=no",
           "--toggle-collect=functools_reduce",
           f"--callgrind-out-file={prefix}.%p", sys.executable, __file__,
           "--count-steps", str(i)], env=env,
          check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
      counts = []
      for dump in (1, 2):  # a dump counts since the one before
        (main_thread,) = glob.glob(f"{prefix}.*.{dump}-01")
        with open(main_thread) as f:
          counts.append(int(re.search(r"^summary: (\d+)", f.read(),
                                      re.M).group(1)))
      out[LOOPS[i]] = (counts[1] - counts[0]) / (
          steps * (INSTRUCTION_EPOCHS[1] - INSTRUCTION_EPOCHS[0]))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="1,024 examples, 1 epoch, 1 round, only on all "
                           "the devices: a smoke run")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line of the results at the end")
  parser.add_argument("--instructions", nargs="?", const="0,1,2",
                      metavar="LOOPS",
                      help="only count the instructions per step of these "
                           "loops (indices, default all; one device; "
                           "valgrind)")
  parser.add_argument("--keep-profiles", metavar="DIR",
                      help="with --instructions: keep callgrind's files in DIR")
  parser.add_argument("--against", metavar="DIR",
                      help="with --instructions: count the loops with DIR's "
                           "jdist package too (e.g. main's checkout)")
  parser.add_argument("--count-steps", type=int,
                      help=argparse.SUPPRESS)  # what --instructions runs
  args = parser.parse_args(argv)
  if args.count_steps is not None:
    count_steps(args.count_steps)
    return
  if args.instructions:
    loops = [int(i) for i in args.instructions.split(",")]
    counts = instructions(loops, args.keep_profiles)
    if args.against and counts is not None:
      counts["against"] = {"source": args.against, **instructions(
          loops, args.keep_profiles, args.against)}
    print(json.dumps(counts))
    return
  provenance.report(lambda: measure(QUICK if args.quick else FULL), section, args.json)


if __name__ == "__main__":
  main()
