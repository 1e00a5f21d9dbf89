"""Sharded optimizer state (ZeRO): memory per device, results, speed.

Trains the same MLP with adam on 4 replicas three ways: mirrored optimizer
state (`optax.adam`), ZeRO-1 (`jdist.ShardedOptimizer`, gradients summed by
autodiff, each replica takes its block) and ZeRO-2 (the optimizer's
`value_and_grad`: gradients reduce-scattered). Reports the optimizer state's
bytes on one device, read from the arrays' addressable shards; the compiled
step's memory analysis (arguments, outputs and temporaries per device); the
collectives in each compiled program; the largest difference of the
parameters from mirrored after the same steps; and steps per second, as the
median over interleaved rounds of the ratio to mirrored.

Run inside a process with 4 fake devices (benchmarks/run.py does this):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/zero_memory.py
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import numpy as np
import optax
from flax import linen as nn

import jdist


class Wide(nn.Module):
  """An MLP whose parameters dominate its memory: 64-512-512-10."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(512)(x))
    x = nn.relu(nn.Dense(512)(x))
    return nn.Dense(10)(x)


def device_bytes(tree, device) -> int:
  """Bytes of `tree`'s arrays that `device` holds (its shards)."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == device)


def _collectives(hlo: str) -> dict:
  names = ("all-reduce", "reduce-scatter", "all-gather")
  # An op's use, not its name (%all-reduce.1) nor its -done half.
  return {n: len(re.findall(rf"\s{n}(-start)?\(", hlo)) for n in names}


def _setup(strategy, mode: str, params, batch):
  model = Wide()
  tx = optax.adam(1e-3)
  if mode != "mirrored":
    tx = jdist.ShardedOptimizer(tx, strategy)
  grad = tx.value_and_grad if mode == "zero2" else jax.value_and_grad

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["x"])
    return jdist.compute_average_loss(
        optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))

  @strategy.function
  def step(params, opt_state, b):
    loss, grads = grad(loss_fn)(params, b)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = strategy.replicate(params)
  return step, params, tx.init(params)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--block", type=int, default=20, help="steps per timed block")
  args = parser.parse_args(argv)
  if args.quick:
    args.rounds, args.block = 1, 2
  strategy = jdist.MirroredStrategy()
  n = strategy.num_replicas_in_sync
  device = strategy.devices[0]
  rng = np.random.default_rng(0)
  batch = 32 * n
  data = [{"x": rng.standard_normal((batch, 64)).astype(np.float32),
           "y": rng.integers(0, 10, batch).astype(np.int32)}
          for _ in range(args.steps)]
  params = Wide().init(jax.random.key(0), data[0]["x"][:1])["params"]
  batches = list(strategy.experimental_distribute_dataset(data))
  modes = ("mirrored", "zero1", "zero2")
  runs, result = {}, {"devices": n, "params": int(sum(
      x.size for x in jax.tree.leaves(params))), "modes": {}}
  for mode in modes:
    step, p, opt = _setup(strategy, mode, params, batches[0])
    compiled = step.lower(p, opt, batches[0]).compile()
    memory = compiled.memory_analysis()
    state_bytes = device_bytes(opt, device)
    for b in batches:  # the same steps for every mode
      p, opt, _ = step(p, opt, b)
    runs[mode] = (step, p, opt)
    result["modes"][mode] = {
        "opt_state_bytes_per_device": state_bytes,
        "params_bytes_per_device": device_bytes(p, device),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "output_bytes": getattr(memory, "output_size_in_bytes", None),
        "collectives": _collectives(compiled.as_text()),
    }
  reference = jax.device_get(runs["mirrored"][1])
  for mode in modes:
    got = jax.device_get(runs[mode][1])
    diff = max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(reference), jax.tree.leaves(got)))
    scale = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(reference))
    result["modes"][mode]["max_param_diff"] = diff
    result["modes"][mode]["param_scale"] = scale
    result["modes"][mode]["state_ratio"] = (
        result["modes"][mode]["opt_state_bytes_per_device"] /
        result["modes"]["mirrored"]["opt_state_bytes_per_device"])
  # Speed: blocks of steps alternate between the modes (the machine's noise
  # hits all alike); each round's ratio is steps/s over mirrored's.
  per_round = {m: [] for m in modes}
  for _ in range(args.rounds):
    rates = {}
    for mode in modes:
      step, p, opt = runs[mode]
      start = time.perf_counter()
      for i in range(args.block):
        p, opt, loss = step(p, opt, batches[i % len(batches)])
      jax.block_until_ready(loss)
      rates[mode] = args.block / (time.perf_counter() - start)
      runs[mode] = (step, p, opt)
    for mode in modes:
      per_round[mode].append(rates[mode] / rates["mirrored"])
  for mode in modes:
    result["modes"][mode]["speed_ratio"] = statistics.median(per_round[mode])
    result["modes"][mode]["speed_spread"] = [min(per_round[mode]),
                                             max(per_round[mode])]
  if args.json:
    print(json.dumps(result))
  else:
    for mode, r in result["modes"].items():
      print(mode, json.dumps(r))


if __name__ == "__main__":
  main()
