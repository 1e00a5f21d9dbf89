"""Mixed precision: the loss curve, the compiled step's memory, the speed.

The seed CNN (Conv 32, Conv 64, Dense 64, Dense 10) on scikit-learn's digits
under the three policies ("float32", "mixed_bfloat16", "mixed_float16"):

- **Loss curve.** `jdist.Trainer(..., dtype_policy=...)` fits 5 epochs on 2
  replicas from the same weights, batch 64, on the first 1792 examples (28
  full batches) and on all 1797 (a last batch of 5, whose full-size adam step
  makes the curve jumpy: rounding then decides where it jumps); the training
  loss per epoch, and its largest relative difference from float32's.
- **Memory on CPU.** A custom-loop step (`strategy.function`, adam, float32
  master weights, the model run in the policy's dtype, float16 with
  `jdist.loss_scale_optimizer`) is compiled for 2 replicas and its memory
  analysis read on one device: temporaries (activations, gradients, scratch)
  and the activations the backward pass keeps (`jax.vjp`'s residuals).
- **Memory on TPU (when libtpu can be imported).** The same per-replica step
  body compiled ahead of time for one TPU v5e chip without a TPU (JAX's
  deviceless compilation from `jax.experimental.topologies`). The
  data-parallel step adds only the gradient all-reduce to this program, so
  its per-device memory is this one's.
- **Speed on CPU.** Steps per second of each policy over float32's, the
  median of interleaved rounds. XLA's CPU backend has no fast low-precision
  path: it converts bfloat16/float16 matrix products and convolutions to
  float32, so nothing faster is expected here.

Run inside a process with 2 fake devices (benchmarks/run.py does this):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/mixed_precision.py
For the TPU rows, make libtpu importable: `pip install --target DIR libtpu`
and `PYTHONPATH=DIR` (make bench does both); JAX_PLATFORMS=cpu keeps JAX off
the TPU runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from jdist.examples.data import load_digits
from jdist.examples.models import CNN

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)


def loss_curves(x, y, epochs: int) -> dict:
  """Per-epoch training loss of `fit` under each policy (2 replicas)."""
  out = {}
  for policy in POLICIES:
    trainer = jdist.Trainer(CNN(), optimizer=optax.adam(1e-3), loss=LOSS,
                            strategy=jdist.MirroredStrategy(),
                            dtype_policy=policy, seed=0)
    history = trainer.fit(x, y, batch_size=64, epochs=epochs, verbose=0)
    out[policy] = {"loss": [float(v) for v in history.history["loss"]]}
  ref = np.asarray(out["float32"]["loss"])
  for policy in POLICIES:
    got = np.asarray(out[policy]["loss"])
    out[policy]["max_rel_diff"] = float(np.max(np.abs(got - ref) / ref))
  return out


def make_body(policy_name: str, model, tx):
  """One replica's training step under the policy, as a custom loop writes
  it: parameters and inputs cast to the compute dtype, logits back to
  float32, the loss scaled when the policy needs it (float16)."""
  policy = jdist.DTypePolicy(policy_name)

  def loss_fn(params, batch, opt_state, average):
    logits = model.apply({"params": policy.cast_to_compute(params)},
                         policy.cast_to_compute(batch["x"]))
    loss = average(optax.softmax_cross_entropy_with_integer_labels(
        policy.cast_to_variable(logits), batch["y"]))
    if policy.needs_loss_scaling:
      return opt_state.loss_scale.scale_loss(loss), loss
    return loss, loss

  def body(params, opt_state, batch, average):
    grads, loss = jax.grad(loss_fn, has_aux=True)(params, batch, opt_state,
                                                  average)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def residual_bytes(params, batch):
    """Bytes the forward pass keeps for the backward pass."""
    fn = lambda p: loss_fn(p, batch, None if not policy.needs_loss_scaling
                           else tx.init(params), jnp.mean)[1]
    backward = jax.eval_shape(lambda p: jax.vjp(fn, p)[1], params)
    return int(sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize
                   for r in jax.tree.leaves(backward)))

  return body, residual_bytes


def optimizer(policy_name: str):
  """adam, with dynamic loss scaling where the policy needs it."""
  tx = optax.adam(1e-3)
  if jdist.DTypePolicy(policy_name).needs_loss_scaling:
    tx = jdist.loss_scale_optimizer(tx)
  return tx


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes),
          "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes)}


def cpu_steps(x, y, batch_sizes, rounds: int, block: int) -> dict:
  """Compiled memory and speed of the jdist step on this process's devices."""
  strategy = jdist.MirroredStrategy()
  model = CNN()
  params0 = model.init(jax.random.key(0), x[:1])["params"]
  rng = np.random.default_rng(0)
  out = {"replicas": strategy.num_replicas_in_sync, "batches": {}}
  for batch in batch_sizes:
    idx = rng.integers(0, len(x), batch)
    data = {"x": x[idx], "y": y[idx]}
    (placed,) = list(strategy.experimental_distribute_dataset([data]))
    row, runs = {}, {}
    for name in POLICIES:
      tx = optimizer(name)
      body, residual_bytes = make_body(name, model, tx)
      step = strategy.function(lambda p, o, b, body=body: body(
          p, o, b, jdist.compute_average_loss))
      params = strategy.replicate(params0)
      # Mirrored as the steps return it: the lowered program is the one the
      # calls run (an unplaced step count compiled a second program, in the
      # first timed block).
      opt_state = strategy.replicate(tx.init(params0))
      compiled = step.lower(params, opt_state, placed).compile()
      per_replica = batch // strategy.num_replicas_in_sync
      row[name] = dict(_memory(compiled), residual_bytes=residual_bytes(
          params0, {"x": data["x"][:per_replica], "y": data["y"][:per_replica]}))
      params, opt_state, loss = step(params, opt_state, placed)  # warm up
      jax.block_until_ready(loss)
      runs[name] = [step, params, opt_state]
    per_round = {name: [] for name in POLICIES}
    for _ in range(rounds):
      rates = {}
      for name in POLICIES:
        step, params, opt_state = runs[name]
        start = time.perf_counter()
        for _ in range(block):
          params, opt_state, loss = step(params, opt_state, placed)
        jax.block_until_ready(loss)
        rates[name] = block / (time.perf_counter() - start)
        runs[name] = [step, params, opt_state]
      for name in POLICIES:
        per_round[name].append(rates[name] / rates["float32"])
    for name in POLICIES:
      r = row[name]
      r["temp_ratio"] = r["temp_bytes"] / row["float32"]["temp_bytes"]
      r["residual_ratio"] = (r["residual_bytes"] /
                             row["float32"]["residual_bytes"])
      r["speed_ratio"] = statistics.median(per_round[name])
      r["speed_spread"] = [min(per_round[name]), max(per_round[name])]
    out["batches"][str(batch)] = row
  return out


def tpu_memory(batch_sizes, topology: str = "v5e:2x2") -> dict:
  """The per-replica step compiled for one TPU chip, without a TPU."""
  try:
    from jax.experimental import topologies
    device = topologies.get_topology_desc(topology, "tpu").devices[0]
  except Exception as e:  # no libtpu, or it cannot describe the topology
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  model = CNN()
  sharding = jax.sharding.SingleDeviceSharding(device)
  params0 = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"])
  spec = lambda t: jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), t)
  out = {"device": str(getattr(device, "device_kind", topology)),
         "batches": {}}
  for batch in batch_sizes:
    data = spec({"x": jax.ShapeDtypeStruct((batch, 8, 8, 1), jnp.float32),
                 "y": jax.ShapeDtypeStruct((batch,), jnp.int32)})
    row = {}
    for name in POLICIES:
      tx = optimizer(name)
      body, _ = make_body(name, model, tx)
      params = spec(params0)
      opt_state = spec(jax.eval_shape(tx.init, params0))
      fn = jax.jit(lambda p, o, b, body=body: body(p, o, b, jnp.mean))
      compiled = fn.trace(params, opt_state, data).lower(
          lowering_platforms=("tpu",)).compile()
      row[name] = _memory(compiled)
    for name in POLICIES:  # small steps keep their temporaries on chip: 0
      full = row["float32"]["temp_bytes"]
      row[name]["temp_ratio"] = row[name]["temp_bytes"] / full if full else None
    out["batches"][str(batch)] = row
  return out


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--block", type=int, default=10)
  parser.add_argument("--batches", default="256,2048",
                      help="global batch sizes for the CPU memory and speed")
  parser.add_argument("--tpu-batches", default="8192,32768")
  args = parser.parse_args(argv)
  if args.quick:
    args.epochs, args.rounds, args.block, args.batches = 1, 1, 2, "256"
    args.tpu_batches = "8192"
  x, y = load_digits(image=True)
  if args.quick:  # a smoke run: 8 full batches, and 8 plus one of 5
    x, y = x[:517], y[:517]
  full = len(x) // 64 * 64
  result = {
      "curves": loss_curves(x[:full], y[:full], args.epochs),
      "curves_all": loss_curves(x, y, args.epochs),
      "examples": [full, len(x)],
      "cpu": cpu_steps(x, y, [int(b) for b in args.batches.split(",")],
                       args.rounds, args.block),
      "tpu": tpu_memory([int(b) for b in args.tpu_batches.split(",")]),
      "epochs": args.epochs,
  }
  if args.json:
    print(json.dumps(result))
  else:
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
