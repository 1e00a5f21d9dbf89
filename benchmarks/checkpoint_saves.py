"""What a checkpoint save costs: its time, the content hash's share of it,
and the memory each save leaves behind.

  python benchmarks/checkpoint_saves.py [--quick] [--json]

Time: a `jdist.CheckpointManager(max_to_keep=2)` on 2 fake CPU devices
saves a mirrored state of four float32 leaves and a step, of 64 KiB and of
50 MiB in all, TRIALS times each after one save not counted; for each, the
median seconds of a save, of the program that computes the leaves' content
hashes and finiteness (what a save reads the state for, `content_hash.py`),
and of the float sums that checkpoints of formats 1-3 held instead, timed
alternately with it (the ratio says what the hash costs over the sums).

Memory: three fresh processes each make a flax `TrainState` of the seed
MLP (64-16-10, adam: 12 leaves), mirrored on the 2 devices, and save it
WARM_UP times, then SAVES more times: to a `jdist.CheckpointManager(
max_to_keep=3)` and to orbax's `CheckpointManager` used directly with the
same two items (the arrays, and a JSON), their resident memory read every
SAMPLE_EVERY saves (the growth per save is the least-squares slope of those
readings); and, in the third, jdist's saves under `tracemalloc`: the
Python memory allocated during the saves and still held after them whose
allocating stack has a frame of jdist and none of orbax or tensorstore (what
jdist itself keeps per save). `--quick`: a few saves of each, in this
process (a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state

import jdist
import provenance  # (benchmarks/provenance.py: which run a section is from)
from jdist._src.checkpoint import checkpointer as ckpt_lib
from jdist._src.checkpoint import content_hash
from jdist._src.checkpoint import metadata
from jdist.examples.models import MLP

SIZES = {"64 KiB": 64 << 10, "50 MiB": 50 << 20}
DEVICES = 2


def _strategy():
  return jdist.MirroredStrategy(jax.local_devices()[:DEVICES])


def _state(strategy, nbytes: int) -> dict:
  n = nbytes // 4 // 4
  return strategy.replicate({
      "a": jnp.full((n,), 0.5), "b": jnp.arange(n, dtype=jnp.float32),
      "c": jnp.zeros((n // 2, 2)), "d": jnp.ones((n,), jnp.int32),
      "step": jnp.int32(3)})


def _median_seconds(f, trials: int) -> float:
  times = []
  for _ in range(trials):
    t = time.perf_counter()
    jax.block_until_ready(f())
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def save_times(trials: int, sizes: dict) -> dict:
  """`{size: {"save", "hash", "sums"}}`: median seconds of a save, of the
  content hash program, and of the float sums, on one state of each size."""
  strategy = _strategy()
  out = {}
  for label, nbytes in sizes.items():
    state = _state(strategy, nbytes)
    leaves = jax.tree.leaves(state)
    directory = tempfile.mkdtemp(prefix="jdist-bench-ckpt-")
    with jdist.CheckpointManager(directory, max_to_keep=2,
                                 strategy=strategy) as manager:
      step = iter(range(1, 10 ** 6))
      manager.save(next(step), state)  # compiles the hash program
      jax.block_until_ready(metadata._sums(leaves))
      save = _median_seconds(lambda: manager.save(next(step), state), trials)
    hashes, sums = [], []
    for _ in range(trials):  # alternately: the same load for both
      hashes.append(_median_seconds(lambda: content_hash.digests(leaves), 1))
      sums.append(_median_seconds(lambda: metadata._sums(leaves), 1))
    shutil.rmtree(directory)
    out[label] = {"bytes": sum(x.nbytes for x in leaves), "save": save,
                  "hash": statistics.median(hashes),
                  "sums": statistics.median(sums),
                  "hash_over_sums": statistics.median(
                      h / s for h, s in zip(hashes, sums))}
  return out


def _train_state(strategy):
  model = MLP(hidden=16)
  params = model.init(jax.random.key(0), jnp.ones((1, 64)))["params"]
  return strategy.replicate(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)))


def _resident_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _saver(kind: str, directory: str, state):
  """`(save(step), close())` of a jdist or a bare orbax manager."""
  if kind.startswith("jdist"):
    manager = jdist.CheckpointManager(directory, max_to_keep=3,
                                      strategy=_strategy())
    return (lambda step: manager.save(step, state)), manager.close
  manager = ocp.CheckpointManager(
      directory, item_names=("state", "meta"),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=3, create=True, enable_async_checkpointing=False))
  names, stored, _, _ = ckpt_lib.storable_leaves(state)
  arrays = ckpt_lib._nest(names, stored)

  def save(step):
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(arrays),
        meta=ocp.args.JsonSave({"step": step})), force=True)
    manager.wait_until_finished()
  return save, manager.close


def _own(stat) -> bool:
  files = [frame.filename for frame in stat.traceback]
  return (any(f"{os.sep}jdist{os.sep}" in f for f in files) and not any(
      f"{os.sep}{lib}{os.sep}" in f for f in files
      for lib in ("orbax", "tensorstore")))


def memory_child(kind: str, warm_up: int, saves: int, every: int) -> dict:
  """One process's measurement (`kind`: jdist, orbax or jdist-traced)."""
  state = _train_state(_strategy())
  directory = tempfile.mkdtemp(prefix="jdist-bench-ckpt-")
  save, close = _saver(kind, directory, state)
  for step in range(1, warm_up + 1):
    save(step)
  gc.collect()
  traced = kind == "jdist-traced"
  if traced:
    tracemalloc.start(64)
    before = tracemalloc.take_snapshot()
  samples = [(0, _resident_bytes())]
  for i in range(1, saves + 1):
    save(warm_up + i)
    if i % every == 0:
      samples.append((i, _resident_bytes()))
  gc.collect()
  out = {"samples": samples}
  if traced:
    stats = tracemalloc.take_snapshot().compare_to(before, "traceback")
    out["own_bytes"] = sum(s.size_diff for s in stats if _own(s))
    out["traced_bytes"] = sum(s.size_diff for s in stats)
    tracemalloc.stop()
  close()
  shutil.rmtree(directory)
  return out


def _slope(samples: list) -> float:
  """Bytes per save: the least-squares slope of `(saves, bytes)`."""
  x = np.array([s for s, _ in samples], float)
  y = np.array([b for _, b in samples], float)
  return float(np.polyfit(x, y, 1)[0]) if len(x) > 1 else 0.0


def _child(kind: str, warm_up: int, saves: int, every: int) -> dict:
  proc = subprocess.run(
      [sys.executable, __file__, "--child", kind, "--warm-up", str(warm_up),
       "--saves", str(saves), "--every", str(every)],
      capture_output=True, text=True, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def memory(warm_up: int, saves: int, every: int, fresh: bool = True) -> dict:
  """The three memory measurements, each in a fresh process (`fresh`), or
  one after the other in this one (a smoke run)."""
  out = {"warm_up": warm_up, "saves": saves, "every": every}
  for kind in ("jdist", "orbax", "jdist-traced"):
    res = (_child if fresh else memory_child)(kind, warm_up, saves, every)
    if kind == "jdist-traced":
      out["jdist_own_bytes_per_save"] = res["own_bytes"] / saves
      out["traced_bytes_per_save"] = res["traced_bytes"] / saves
    else:
      out[kind] = {"bytes_per_save": _slope(res["samples"]),
                   "samples": res["samples"]}
  return out


def section(res: dict) -> list:
  """The "Checkpoint saves" section of RESULTS.md."""
  mem = res["memory"]
  kib = lambda b: f"{b / 1024:.1f}"
  lines = [
      "## Checkpoint saves: time, the content hash, memory per save",
      "",
      provenance.line(res["provenance"]),
      "",
      f"{DEVICES} fake CPU devices. Time: a `jdist.CheckpointManager` saving a mirrored state (four "
      "float32 leaves and a step); medians of "
      f"{res['trials']} saves, and of the save's one program that computes "
      "every leaf's content hash and finiteness, against the float sums that "
      "checkpoints of formats 1-3 held (timed alternately; the ratio is the "
      "median of the pairs'). The hash reads a mirrored leaf on one device; "
      "the float sums ran on every device.",
      "",
      "| state | save | content hash | float sums | hash / sums |",
      "|---|---|---|---|---|",
  ]
  for label, t in res["time"].items():
    lines.append(
        f"| {label} ({t['bytes']:,} bytes) | {t['save'] * 1e3:.1f} ms | "
        f"{t['hash'] * 1e3:.2f} ms | {t['sums'] * 1e3:.2f} ms | "
        f"{t['hash_over_sums']:.1f}x |")
  lines += [
      "",
      f"Memory: {mem['saves']} saves after {mem['warm_up']}, each in a fresh "
      "process, of a flax `TrainState` (the seed MLP with adam, 12 leaves); "
      "resident memory read every "
      f"{mem['every']} saves, its growth per save a least-squares slope. "
      "jdist's own: Python memory allocated during jdist's saves and held "
      "after them, allocated with a jdist frame on the stack and none of "
      "orbax or tensorstore (`tracemalloc`).",
      "",
      "| saves through | resident memory per save |",
      "|---|---|",
      f"| `jdist.CheckpointManager(max_to_keep=3)` | "
      f"{kib(mem['jdist']['bytes_per_save'])} KiB |",
      f"| orbax's `CheckpointManager`, the same two items | "
      f"{kib(mem['orbax']['bytes_per_save'])} KiB |",
      f"| jdist's own Python allocations still held | "
      f"{kib(mem['jdist_own_bytes_per_save'])} KiB (of "
      f"{kib(mem['traced_bytes_per_save'])} KiB traced) |",
  ]
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--child")
  parser.add_argument("--warm-up", type=int, default=30)
  parser.add_argument("--saves", type=int, default=300)
  parser.add_argument("--every", type=int, default=25)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(memory_child(args.child, args.warm_up, args.saves,
                                  args.every)))
    return
  if args.quick:
    measure = lambda: {"trials": 2, "time": save_times(2, {"64 KiB": 64 << 10}),
                       "memory": memory(1, 2, 1, fresh=False)}
  else:
    measure = lambda: {"trials": 7, "time": save_times(7, SIZES),
                       "memory": memory(args.warm_up, args.saves, args.every)}
  provenance.report(measure, section, args.json)


if __name__ == "__main__":
  main()
