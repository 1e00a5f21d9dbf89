"""Model parallelism (issue 21): memory, communication and speed of
`jdist.ModelParallelStrategy` on the example GPT, 4 fake CPU devices.

The GPT of `jdist.examples.models` with adam, trained three ways on the same
4 devices: mirrored (`jdist.MirroredStrategy`, 4 replicas), FSDP
(`gpt_fsdp_strategy` on `DeviceMesh((1, 4), ("data", "fsdp"))`) and tensor
parallelism (`gpt_layout_map` on `DeviceMesh((1, 4), ("data", "model"))`).

1. Memory per device: parameters, gradients and adam's state, from the
   arrays' shards on one device (the gradients as a step computes them:
   `value_and_grad` under the strategy); and the compiled step's memory
   analysis (arguments, outputs, temporaries).
2. Communication per step, read from the compiled step's HLO
   (`jdist._src.diagnose.hlo.collectives`): each collective's kind, bytes
   and whether the forward pass, the backward pass (`transpose(...)`) or the
   update issued it; tensor parallelism's all-reduces per block, as the
   difference between the GPT with one more block and without.
3. Speed against the same step hand-written the way MaxText does it:
   `jax.jit` with `in_shardings`/`out_shardings` of `NamedSharding`s written
   out in this file (and checked to equal jdist's layouts) on the same mesh;
   interleaved rounds, the ratio jdist / hand-written per round; tokens/s;
   the achieved FLOP/s (XLA's count of the compiled step's FLOPs over the
   measured step time) and the model FLOPs utilization (the GPT's own count,
   `GPT.train_flops`, over the time and the devices' peak from jdist's table
   of the vendors' figures: "n/a" where the table has none, as on CPU).
   And on `DeviceMesh((2, 2), ("data", "model"))` (`gpt_layout_map`, 2
   replicas of 2 devices): adam's state per device mirrored over the
   replicas against split over them by `jdist.ShardedOptimizer`.
4. Against Keras 3 (JAX backend) `keras.distribution.ModelParallel` with the
   equivalent `LayoutMap`, the same GPT from the same weights on the same
   batches (benchmarks/peers/keras_gpt.py in the peers' venv), `model.fit`
   against jdist's custom loop, interleaved.

Run inside a process with 4 fake devices (benchmarks/run.py does this):
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
      python benchmarks/model_parallel.py [--quick] [--json] \\
      [--peers-python .venv-peers/bin/python]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdist
from jdist._src.diagnose import hlo
from jdist._src.planning import peaks, program
from jdist.examples.models import GPT, gpt_fsdp_strategy, gpt_layout_map

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import provenance  # noqa: E402  (RESULTS.md's "from which run")

# The GPT and the global batch (sequences of max_len + 1 tokens: inputs and
# next-token targets); rounds and steps per block against the hand-written
# step and against Keras (whose blocks are `fit` calls: longer blocks spread
# the cost of starting one). "tiny" is for tests; "quick" for `--quick`.
CONFIGS = {
    "full": {"model": dict(vocab_size=256, max_len=64, embed_dim=128,
                           num_heads=4, num_layers=2, mlp_dim=512),
             "batch": 16, "rounds": 9, "block": 8, "keras_rounds": 7,
             "keras_block": 16},
    "quick": {"model": dict(vocab_size=256, max_len=64, embed_dim=128,
                            num_heads=4, num_layers=2, mlp_dim=512),
              "batch": 16, "rounds": 1, "block": 2, "keras_rounds": 1,
              "keras_block": 2},
    "tiny": {"model": dict(vocab_size=64, max_len=16, embed_dim=32,
                           num_heads=4, num_layers=1, mlp_dim=64),
             "batch": 8, "rounds": 1, "block": 2, "keras_rounds": 1,
             "keras_block": 2},
}
KINDS = ("mirrored", "fsdp", "tensor")
LABELS = {"mirrored": "mirrored (4 replicas)", "fsdp": "FSDP 4 (1x4)",
          "tensor": "tensor parallel 4 (1x4)"}
NUM_BATCHES = 4
LEARNING_RATE = 1e-3

# ---------------------------------------------------------------- the setups


def _tokens(cfg: dict) -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  m = cfg["model"]
  return [rng.integers(0, m["vocab_size"], (cfg["batch"], m["max_len"] + 1))
          .astype(np.int32) for _ in range(NUM_BATCHES)]


def _loss(model: GPT, params, tokens):
  """Mean next-token cross-entropy of one replica's sequences, per sequence."""
  logits = model.apply({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]).mean(-1)


@dataclasses.dataclass
class Setup:
  """One way of training the GPT: its step, its state, its batches."""

  kind: str
  strategy: Any
  step: Any             # jdist: a `strategy.function`; hand: a `jax.jit`
  params: Any
  opt_state: Any
  batches: list
  grad_fn: Any = None   # the step's gradients alone (memory)
  position: int = 0     # steps run: the next batch is batches[position % 4]
  host_batches: list | None = None  # if set: placed every step, as a user's
                                    # loop over experimental_distribute_dataset
  _compiled: Any = None
  _lowered: Any = None

  def lowered(self):
    """The step lowered for the setup's state (once): the program before
    XLA's passes."""
    if self._lowered is None:
      self._lowered = self.step.lower(self.params, self.opt_state,
                                      self.batches[0])
    return self._lowered

  def compiled(self):
    """The step compiled for the setup's state (once): its HLO, memory and
    cost analyses."""
    if self._compiled is None:
      self._compiled = self.lowered().compile()
    return self._compiled

  def restarted(self) -> "Setup":
    """The same step and batches, from this setup's current state (arrays
    are immutable: training the copy leaves this one as it is)."""
    return dataclasses.replace(self)


def jdist_setup(kind: str, cfg: dict, devices, *, num_layers=None) -> Setup:
  """The GPT trained by jdist under `kind` ("mirrored", "fsdp", "tensor")."""
  model = GPT(**dict(cfg["model"], **(
      {"num_layers": num_layers} if num_layers is not None else {})))
  tx = optax.adam(LEARNING_RATE)
  init = lambda: model.init(jax.random.key(0), np.zeros(
      (1, cfg["model"]["max_len"]), np.int32))["params"]
  if kind == "mirrored":
    strategy = jdist.MirroredStrategy(devices)
    params = strategy.replicate(init())
    opt_state = strategy.replicate(tx.init(params))
  else:
    if kind == "fsdp":
      strategy = gpt_fsdp_strategy(
          jdist.DeviceMesh((1, len(devices)), ("data", "fsdp"), devices))
    else:
      mesh = jdist.DeviceMesh((1, len(devices)), ("data", "model"), devices)
      strategy = jdist.ModelParallelStrategy(layout_map=gpt_layout_map(mesh),
                                             batch_dim_name="data")
    params = strategy.init(init)
    opt_state = strategy.init(tx.init, params)

  def loss_fn(p, tokens):
    return jdist.compute_average_loss(_loss(model, p, tokens))

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = list(strategy.experimental_distribute_dataset(_tokens(cfg)))
  return Setup(kind, strategy, strategy.function(step), params, opt_state,
               batches, strategy.function(jax.grad(loss_fn)))


# The hand-written layouts (the MaxText way: rules from parameter names to
# PartitionSpecs, `jax.jit` with in/out shardings). Megatron's split, as
# gpt_layout_map; the first rule whose regex matches the whole path counts.
HAND_TENSOR_RULES = (
    (r"token_embed/embedding", P("model", None)),
    (r"block_\d+/attn/(query|key|value)/kernel", P(None, "model", None)),
    (r"block_\d+/attn/(query|key|value)/bias", P("model", None)),
    (r"block_\d+/attn/out/kernel", P("model", None, None)),
    (r"block_\d+/mlp_in/kernel", P(None, "model")),
    (r"block_\d+/mlp_in/bias", P("model")),
    (r"block_\d+/mlp_out/kernel", P("model", None)),
    (r"head/kernel", P(None, "model")),
    (r"head/bias", P("model")),
)


def hand_tensor_spec(path: str, shape: tuple) -> P:
  del shape
  for pattern, spec in HAND_TENSOR_RULES:
    if re.fullmatch(pattern, path):
      return spec
  return P()


def hand_fsdp_spec(path: str, shape: tuple, size: int = 4) -> P:
  """ZeRO-3: the largest dimension that the fsdp axis divides (the first of
  equals), or whole."""
  del path
  dims = [d for d in range(len(shape)) if shape[d] % size == 0]
  if not dims:
    return P()
  best = max(dims, key=lambda d: (shape[d], -d))
  return P(*[("fsdp" if d == best else None) for d in range(len(shape))])


def _specs(tree, rule: Callable) -> Any:
  return jax.tree_util.tree_map_with_path(
      lambda path, x: rule("/".join(str(k.key) for k in path), np.shape(x)),
      tree)


def hand_setup(kind: str, cfg: dict, reference: Setup) -> Setup:
  """The same training hand-written: `jax.jit` with `NamedSharding`s on the
  mesh of `reference` (a jdist setup of the same kind), from the same
  initial parameters; its layouts must equal jdist's."""
  model = GPT(**cfg["model"])
  tx = optax.adam(LEARNING_RATE)
  mesh = reference.strategy.mesh
  size = mesh.shape[{"fsdp": "fsdp", "tensor": "model"}[kind]]
  rule = (hand_tensor_spec if kind == "tensor" else
          lambda path, shape: hand_fsdp_spec(path, shape, size))
  shapes = jax.eval_shape(lambda p: p, reference.params)
  param_specs = _specs(shapes, rule)
  for (path, x), mine, theirs in zip(
      jax.tree_util.tree_flatten_with_path(shapes)[0],
      jax.tree.leaves(param_specs, is_leaf=_is_spec),
      jax.tree.leaves(reference.strategy.shardings(shapes))):
    if not NamedSharding(mesh, mine).is_equivalent_to(theirs, x.ndim):
      raise AssertionError(
          f"the hand-written layout of {jax.tree_util.keystr(path)}, {mine}, "
          f"is not jdist's {theirs.spec}")
  opt_specs = optax.tree_map_params(
      tx, lambda _, spec: spec, jax.eval_shape(tx.init, shapes), param_specs,
      transform_non_params=lambda _: P(), is_leaf=_is_spec)
  shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                     is_leaf=_is_spec)
  batch_axes = ("data", "fsdp") if kind == "fsdp" else "data"
  batch_sharding = NamedSharding(mesh, P(batch_axes, None))

  def step(params, opt_state, tokens):
    loss_fn = lambda p: _loss(model, p, tokens).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  p_sh, o_sh = shard(param_specs), shard(opt_specs)
  jitted = jax.jit(step, in_shardings=(p_sh, o_sh, batch_sharding),
                   out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))
  params = jax.device_put(jax.device_get(reference.params), p_sh)
  opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
  batches = [jax.device_put(t, batch_sharding) for t in _tokens(cfg)]
  return Setup(kind, None, jitted, params, opt_state, batches)


def _is_spec(x) -> bool:
  return isinstance(x, P)


# ---------------------------------------------------------------- 1. memory


def device_bytes(tree, device) -> int:
  """Bytes of `tree`'s arrays that `device` holds (its shards)."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree)
             for s in x.addressable_shards if s.device == device)


def memory(setup: Setup) -> dict:
  """Per-device bytes of one setup on its first device: parameters, adam
  state, gradients (from the arrays' shards) and the compiled step's memory
  analysis."""
  device = jax.tree.leaves(setup.params)[0].addressable_shards[0].device
  grads = setup.grad_fn(setup.params, setup.batches[0])
  analysis = setup.compiled().memory_analysis()
  out = {
      "params_bytes": device_bytes(setup.params, device),
      "opt_state_bytes": device_bytes(setup.opt_state, device),
      "grads_bytes": device_bytes(grads, device),
      "param_bytes_total": sum(x.nbytes for x in jax.tree.leaves(setup.params)),
      "argument_bytes": analysis.argument_size_in_bytes,
      "output_bytes": analysis.output_size_in_bytes,
      "temp_bytes": analysis.temp_size_in_bytes,
  }
  out["state_bytes"] = (out["params_bytes"] + out["opt_state_bytes"]
                        + out["grads_bytes"])
  return out


def zero_on_mesh(cfg: dict, devices) -> dict:
  """adam's state per device (device 0) on `DeviceMesh((2, 2), ("data",
  "model"))` with `gpt_layout_map`: laid out as the parameters and mirrored
  over the 2 replicas (`strategy.init(tx.init, params)`), against split
  over them as well by `jdist.ShardedOptimizer`."""
  model = GPT(**cfg["model"])
  tx = optax.adam(LEARNING_RATE)
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])
  strategy = jdist.ModelParallelStrategy(layout_map=gpt_layout_map(mesh),
                                         batch_dim_name="data")
  params = strategy.init(lambda: model.init(jax.random.key(0), np.zeros(
      (1, cfg["model"]["max_len"]), np.int32))["params"])
  device = devices[0]
  mirrored = strategy.init(tx.init, params)
  sharded = jdist.ShardedOptimizer(tx, strategy).init(params)
  out = {"params_bytes": device_bytes(params, device),
         "mirrored_opt_state_bytes": device_bytes(mirrored, device),
         "sharded_opt_state_bytes": device_bytes(sharded.value, device),
         "opt_state_bytes_total": sum(
             x.nbytes for x in jax.tree.leaves(sharded.value))}
  out["ratio"] = (out["sharded_opt_state_bytes"]
                  / out["mirrored_opt_state_bytes"])
  return out


def memory_ratios(by_kind: dict) -> dict:
  """Each setup's bytes over mirrored's: parameters, the three kinds of
  training state together, and the compiled step's arguments + temporaries."""
  base = by_kind["mirrored"]
  step = lambda m: m["argument_bytes"] + m["temp_bytes"]
  return {k: {"params": m["params_bytes"] / base["params_bytes"],
              "state": m["state_bytes"] / base["state_bytes"],
              "step": step(m) / step(base)} for k, m in by_kind.items()}


# --------------------------------------------------------- 2. communication


def phase(op_name: str) -> str:
  """Which part of the step issued a collective: its JAX operation's name."""
  if "transpose(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  return "update"


def communication(setup: Setup) -> dict:
  """The compiled step's collectives: count and bytes by kind and phase, and
  the parameters' bytes to compare with."""
  found = hlo.collectives(setup.compiled().as_text())
  table = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for c in found:
    row = table[f"{c.kind} {phase(c.op_name)}"]
    row["count"] += 1
    row["bytes"] += c.bytes
  return {"param_bytes": sum(x.nbytes for x in jax.tree.leaves(setup.params)),
          "collectives": dict(sorted(table.items())),
          "ops": [{"kind": c.kind, "bytes": c.bytes, "op_name": c.op_name}
                  for c in found]}


def all_reduces_per_block(cfg: dict, devices, tensor: Setup | None = None
                          ) -> dict:
  """Tensor parallelism's all-reduces in the compiled step of the GPT with
  its blocks (`tensor`, if given, is that setup) and with one block more;
  the difference is one block's."""
  layers = cfg["model"]["num_layers"]
  counts = {}
  for n in (layers, layers + 1):
    setup = (tensor if n == layers and tensor is not None else
             jdist_setup("tensor", cfg, devices, num_layers=n))
    comm = communication(setup)
    counts[n] = collections.Counter()
    for c in comm["ops"]:
      if c["kind"] == "all-reduce":
        counts[n][phase(c["op_name"])] += 1
  one = {p: counts[layers + 1][p] - counts[layers][p]
         for p in ("forward", "backward", "update")}
  return {"layers": layers,
          "total": {str(n): dict(c) for n, c in counts.items()},
          "per_block": one,
          "outside_blocks": {p: counts[layers][p] - layers * one[p]
                             for p in one}}


# ------------------------------------------------------------------ 3. speed


def _run_block(setup: Setup, steps: int) -> float:
  """Seconds for `steps` steps; waits for step k-1 after dispatching k (the
  CPU collectives' rendezvous deadlocks with too many steps in flight)."""
  params, opt, last = setup.params, setup.opt_state, None
  order = [i % NUM_BATCHES for i in range(setup.position,
                                          setup.position + steps)]
  start = time.perf_counter()
  if setup.host_batches is None:
    batches = (setup.batches[i] for i in order)
  else:
    batches = iter(setup.strategy.experimental_distribute_dataset(
        [setup.host_batches[i] for i in order]))
  for batch in batches:
    params, opt, loss = setup.step(params, opt, batch)
    if last is not None:
      jax.block_until_ready(last)
    last = loss
  jax.block_until_ready((params, opt, loss))
  seconds = time.perf_counter() - start
  setup.params, setup.opt_state = params, opt
  setup.position += steps
  return seconds


def interleaved(setups: dict, rounds: int, block: int, *, others=None) -> dict:
  """Seconds per block for each setup (and each `others` callable, which
  runs one block and returns its seconds), the order rotating per round."""
  runners = {name: (lambda s=s: _run_block(s, block))
             for name, s in setups.items()}
  runners.update(others or {})
  names = list(runners)
  times = {n: [] for n in names}
  for r in range(rounds):
    k = r % len(names)
    for n in names[k:] + names[:k]:
      times[n].append(runners[n]())
  return times


def ratio(times: dict, num: str, den: str) -> tuple[float, list]:
  """Median over rounds of `num`'s speed over `den`'s, and [min, max]."""
  r = [d / n for n, d in zip(times[num], times[den])]
  return statistics.median(r), [min(r), max(r)]


def flops_per_step(setup: Setup) -> float:
  """XLA's count of one device's FLOPs in the compiled step."""
  analysis = setup.compiled().cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
    analysis = analysis[0]
  return float(analysis["flops"])


def compute_dtype(setup: Setup) -> str | None:
  """The dtype the step's matrix products take, from the lowered program."""
  return program.compute_dtype(setup.lowered().as_text())


def eval_loss(cfg: dict, params) -> float:
  """Mean next-token cross-entropy on the first batch, float64 on the host."""
  seqs = _tokens(cfg)[0]
  apply = jax.jit(GPT(**cfg["model"]).apply)  # on the default device
  logits = np.asarray(apply({"params": jax.device_get(params)}, seqs[:, :-1]),
                      np.float64)
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return float(-np.take_along_axis(logp, seqs[:, 1:, None], -1).mean())


def max_param_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(jax.device_get(a)),
                             jax.tree.leaves(jax.device_get(b))))


def speed(cfg: dict, setups: dict, *, rounds: int, block: int,
          kinds=("fsdp", "tensor")) -> dict:
  """jdist against the hand-written `jax.jit` for each of `kinds`
  (`setups`: jdist's, by kind, untrained; they are left untrained), with
  jdist's achieved FLOP/s and MFU."""
  out = {}
  tokens = cfg["batch"] * cfg["model"]["max_len"]
  model_flops = GPT(**cfg["model"]).train_flops(
      (cfg["batch"], cfg["model"]["max_len"]))
  for kind in kinds:
    ours = setups[kind].restarted()
    hand = hand_setup(kind, cfg, ours)
    for s in (ours, hand):  # compile and warm up, the same steps each
      _run_block(s, 2)
    times = interleaved({"jdist": ours, "hand": hand}, rounds, block)
    median, spread = ratio(times, "jdist", "hand")
    mesh = ours.strategy.mesh
    dtype = compute_dtype(ours)
    peak = peaks.peak_flops(mesh.devices.flat[0].device_kind, dtype)
    flops = flops_per_step(ours)
    achieved = peaks.throughput(
        flops_per_device=flops, num_devices=mesh.size,
        model_flops=model_flops, peak_per_device=peak,
        seconds_per_step=statistics.median(times["jdist"]) / block)
    out[kind] = {
        "seconds": times, "block": block, "ratio": median,
        "ratio_spread": spread,
        "tokens_per_s": {n: tokens * block / statistics.median(t)
                         for n, t in times.items()},
        "flops_per_device_step": flops, "model_flops_per_step": model_flops,
        "compute_dtype": dtype, "peak_flops_per_device": peak,
        "achieved_flops_per_device": achieved.flops_per_second_per_device,
        "mfu": achieved.mfu,
        "steps": ours.position,
        "loss": {"jdist": eval_loss(cfg, ours.params),
                 "hand": eval_loss(cfg, hand.params)},
        "max_param_diff": max_param_diff(ours.params, hand.params),
    }
  return out


# ------------------------------------------------------------------- 4. Keras


def start_keras(cfg: dict, tensor: Setup, peers_python: str, workdir):
  """Starts benchmarks/peers/keras_gpt.py in the peers' venv on as many
  devices as `tensor`'s mesh, with `tensor`'s parameters as its initial
  weights; it builds, compiles and warms up while this process works.
  Returns the worker, or an error message."""
  peers_python = str(pathlib.Path(peers_python).absolute())  # runs elsewhere
  if not pathlib.Path(peers_python).exists():
    return f"no peers' venv at {peers_python} (`make bench` builds it)"
  sys.path.insert(0, str(HERE))
  try:
    import peers  # its Worker runs a peer program
  finally:
    sys.path.remove(str(HERE))
  weights = pathlib.Path(workdir) / "init.npz"
  flat = {"/".join(str(k.key) for k in path): np.asarray(x) for path, x in
          jax.tree_util.tree_flatten_with_path(jax.device_get(tensor.params))[0]}
  np.savez(weights, **flat)
  fw = peers.Framework("Keras 3 (JAX) ModelParallel, fit", "keras_gpt.py",
                       args=("--config", json.dumps(cfg["model"]),
                             "--batch", str(cfg["batch"]),
                             "--weights", str(weights)))
  return peers.Worker("keras_gpt", fw, peers_python, tensor.strategy.mesh.size,
                      ["gpt"], f"gpt:{KERAS_WARMUP}", pathlib.Path(workdir))


KERAS_WARMUP = 2


def keras_compare(cfg: dict, tensor: Setup, worker, *, rounds: int,
                  block: int, log=print) -> dict:
  """jdist's tensor parallel custom loop (`tensor`, untrained) against
  Keras 3's ModelParallel `fit` (`worker`, from `start_keras`), interleaved,
  from the same weights on the same batches."""
  if isinstance(worker, str):
    return {"error": worker}
  peers = sys.modules["peers"]
  ours = dataclasses.replace(tensor, host_batches=_tokens(cfg))
  try:
    info = worker.recv(peers.READY_TIMEOUT)
    log(f"  keras ready: {info.get('version')}")
    _run_block(ours, KERAS_WARMUP)
    times = interleaved({"jdist": ours}, rounds, block, others={
        "keras": lambda: worker.request(peers.BLOCK_TIMEOUT, op="run",
                                        model="gpt", steps=block)["seconds"]})
    keras_loss = worker.request(peers.BLOCK_TIMEOUT, op="eval", model="gpt")
  except peers.WorkerError as e:
    return {"error": str(e)}
  # Both trained the same steps on the same batches in the same order.
  jdist_loss = eval_loss(cfg, ours.params)
  median, spread = ratio(times, "jdist", "keras")
  tokens = cfg["batch"] * cfg["model"]["max_len"]
  return {"seconds": times, "block": block, "ratio": median,
          "ratio_spread": spread, "version": info.get("version"),
          "keras_layout": info.get("layout"),
          "tokens_per_s": {n: tokens * block / statistics.median(t)
                           for n, t in times.items()},
          "loss": {"jdist": jdist_loss, "keras": keras_loss["loss"]},
          "loss0": {"jdist": eval_loss(cfg, tensor.params),
                    "keras": info["loss0"]["gpt"]},
          "steps": ours.position}


# ------------------------------------------------------------------- main


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line at the end")
  parser.add_argument("--peers-python", default=str(
      HERE.parent / ".venv-peers" / "bin" / "python"))
  parser.add_argument("--no-peers", action="store_true",
                      help="leave out the comparison with Keras")
  args = parser.parse_args(argv)
  return provenance.report(lambda: measure(args), section, args.json)


def measure(args) -> dict:
  """Everything the section shows, for `main`'s arguments."""
  cfg = CONFIGS["quick" if args.quick else "full"]
  devices = jax.devices()[:4]
  if len(devices) < 4:
    raise SystemExit("needs 4 devices: XLA_FLAGS="
                     "--xla_force_host_platform_device_count=4")
  started = time.perf_counter()
  log = lambda *a: print(f"[{time.perf_counter() - started:5.0f} s]", *a,
                         file=sys.stderr, flush=True)
  res = {"config": cfg, "devices": len(devices),
         "device_kind": devices[0].device_kind}
  setups = {k: jdist_setup(k, cfg, devices) for k in KINDS}
  with tempfile.TemporaryDirectory(prefix="jdist-mp-") as tmp:
    if not jax.config.jax_compilation_cache_dir:
      # The steps compiled for their analyses (`Setup.compiled`) are the
      # programs the timed calls compile again: a cache for this run only.
      jax.config.update("jax_compilation_cache_dir", str(
          pathlib.Path(tmp) / "xla-cache"))
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
      jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    worker = None if args.no_peers else start_keras(
        cfg, setups["tensor"], args.peers_python, tmp)
    try:
      log("memory")
      res["memory"] = {k: memory(s) for k, s in setups.items()}
      res["memory_ratios"] = memory_ratios(res["memory"])
      res["zero_on_mesh"] = zero_on_mesh(cfg, devices)
      log("communication")
      res["communication"] = {k: communication(setups[k])
                              for k in ("fsdp", "tensor")}
      for k in res["communication"]:
        res["communication"][k].pop("ops")
      res["tensor_all_reduces"] = all_reduces_per_block(
          cfg, devices, setups["tensor"])
      log("speed")
      res["speed"] = speed(cfg, setups, rounds=cfg["rounds"],
                           block=cfg["block"])
      if worker is not None:
        log("keras")
        res["keras"] = keras_compare(cfg, setups["tensor"], worker,
                                     rounds=cfg["keras_rounds"],
                                     block=cfg["keras_block"], log=log)
    finally:
      if worker is not None and not isinstance(worker, str):
        worker.close()
  res["seconds"] = time.perf_counter() - started
  return res


# ------------------------------------------------------------- RESULTS.md


def _mb(b: float) -> str:
  return f"{b / 2**20:.2f} MB"


def section(res: dict) -> list:
  """The "Model parallelism (issue 21)" section of RESULTS.md."""
  cfg, mem, ratios = res["config"], res["memory"], res["memory_ratios"]
  m = cfg["model"]
  n_params = mem["mirrored"]["param_bytes_total"] // 4
  lines = [
      "## Model parallelism (issue 21)",
      "",
      provenance.line(res["provenance"]),
      "",
      f"{res['devices']} fake CPU devices ({res['device_kind']}) share the "
      "cores. The GPT of "
      f"`jdist.examples.models` ({m['num_layers']} blocks, embed "
      f"{m['embed_dim']}, {m['num_heads']} heads, MLP {m['mlp_dim']}, "
      f"vocabulary {m['vocab_size']}, {m['max_len']} tokens; {n_params:,} "
      f"float32 parameters) with adam, global batch {cfg['batch']} "
      "sequences, three ways on the same 4 devices: mirrored "
      "(`MirroredStrategy`, 4 replicas), FSDP (`gpt_fsdp_strategy` on "
      "`DeviceMesh((1, 4), ('data', 'fsdp'))`) and tensor parallel "
      "(`gpt_layout_map` on `DeviceMesh((1, 4), ('data', 'model'))`).",
      "",
      "**Memory per device** (device 0). Parameters, adam's state and the "
      "gradients (`jax.grad` of the loss under the strategy, which returns "
      "them in their parameters' layouts): bytes of the arrays' shards on "
      "the device. Step: the compiled train step's memory "
      "analysis, arguments (parameters, adam state, the batch) + "
      "temporaries (gradients, activations, gathered parameters).",
      "",
      "| layout | parameters | adam state | gradients | params + grads + adam "
      "| vs mirrored | step: args + temp | vs mirrored |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for k in KINDS:
    r, q = mem[k], ratios[k]
    lines.append(
        f"| {LABELS[k]} | {_mb(r['params_bytes'])} ({q['params']:.2f}x) | "
        f"{_mb(r['opt_state_bytes'])} | {_mb(r['grads_bytes'])} | "
        f"{_mb(r['state_bytes'])} | **{q['state']:.3f}** | "
        f"{_mb(r['argument_bytes'] + r['temp_bytes'])} | {q['step']:.2f} |")
  lines += [
      "",
      f"FSDP holds **{ratios['fsdp']['state']:.3f}x** of mirrored's "
      "parameters + gradients + adam state per device (goal <= 0.30); "
      f"tensor parallel holds **{ratios['tensor']['params']:.3f}x** of the "
      "parameter bytes (goal <= 0.30): layer norms, the position embedding "
      "and the row-split layers' biases stay whole on every device. The "
      "compiled step's memory shrinks less: the activations of one replica "
      f"(tensor parallel: all {cfg['batch']} sequences on every device, "
      f"against {cfg['batch'] // res['devices']} per mirrored replica) and, "
      "under FSDP, the parameters gathered for the forward pass stay live "
      "until the backward pass uses them.",
      "",
  ]
  lines += _zero_on_mesh_lines(res)
  lines += _communication_lines(res)
  lines += _speed_lines(res)
  lines += _keras_lines(res)
  lines += ["", f"The whole script took {res['seconds']:.0f} s."]
  return lines


def _zero_on_mesh_lines(res: dict) -> list:
  if "zero_on_mesh" not in res:  # a run from before this measurement
    return []
  z = res["zero_on_mesh"]
  return [
      "**ZeRO on a 2x2 mesh.** On `DeviceMesh((2, 2), ('data', 'model'))` "
      "(`gpt_layout_map`: 2 replicas of 2 devices), adam's state per device "
      f"(device 0, of {_mb(z['opt_state_bytes_total'])} in all):",
      "",
      "| optimizer state | adam state per device | vs mirrored over the "
      "replicas |",
      "|---|---|---|",
      f"| laid out as the parameters, mirrored over 'data' | "
      f"{_mb(z['mirrored_opt_state_bytes'])} | 1.000 |",
      f"| `ShardedOptimizer`: split over 'data' as well | "
      f"{_mb(z['sharded_opt_state_bytes'])} | **{z['ratio']:.3f}** |",
      "",
  ]


def _communication_lines(res: dict) -> list:
  fsdp = res["communication"]["fsdp"]
  pb = fsdp["param_bytes"]
  lines = [
      "**Communication per step**, read from the compiled step's HLO "
      "(`jdist._src.diagnose.hlo.collectives`): count and bytes (each "
      "collective's result, per device) by kind and by the part of the "
      "step that issued it (the backward pass's operations are "
      "`transpose(...)` in their names).",
      "",
      "| layout | collective | count | bytes | / parameter bytes |",
      "|---|---|---|---|---|",
  ]
  for k in ("fsdp", "tensor"):
    comm = res["communication"][k]
    for name, row in comm["collectives"].items():
      lines.append(f"| {LABELS[k]} | {name} | {row['count']} | "
                   f"{_mb(row['bytes'])} | {row['bytes'] / pb:.2f} |")
  c = fsdp["collectives"]
  ag = sum(r["bytes"] for n, r in c.items() if n.startswith("all-gather"))
  rs = sum(r["bytes"] for n, r in c.items() if n.startswith("reduce-scatter"))
  ar = sum(r["bytes"] for n, r in c.items() if n.startswith("all-reduce"))
  t = res["tensor_all_reduces"]
  one, outside = t["per_block"], t["outside_blocks"]
  lines += [
      "",
      f"FSDP, theory: two all-gathers of the parameters' bytes "
      f"({_mb(2 * pb)}: forward, and again for the backward pass) and one "
      f"reduce-scatter of the gradients ({_mb(pb)} in). XLA:CPU here: "
      f"all-gathers of {ag / pb:.2f}x the parameters' bytes, reduce-scatters "
      f"{rs / pb:.2f}x, all-reduces {ar / pb:.2f}x. Two differences, both "
      "XLA's choices: (1) each parameter is gathered once, in the forward "
      "pass, and the gathered copy is kept for the backward pass (XLA does "
      "not rematerialise it unless told to, e.g. by `jax.checkpoint`), which "
      "saves an all-gather and costs the memory the step's temporaries show; "
      "(2) the gradients' reduce-scatter is an all-reduce of the whole "
      "gradients (the all-reduce combiner merges them into one) after which "
      "each device keeps its block: the SPMD partitioner writes a "
      "reduce-scatter as all-reduce + dynamic-slice, and the pass that turns "
      "that pattern into a reduce-scatter belongs to XLA's GPU pipeline, not "
      "to its CPU one, so on CPU the gradient sum moves the full bytes. The "
      "rest: the token "
      "embedding's gradient, a scatter-add into a table split over the "
      "vocabulary, gathers every sequence's tokens and their activations' "
      "gradients onto each device; a few bytes move token positions.",
      "",
      f"Tensor parallel, Megatron's count: 2 all-reduces per block forward "
      f"(after attention's output projection and after the MLP's second "
      f"layer) and 2 backward (the inputs' gradients of the column-split "
      f"query/key/value and of the MLP's first layer). Measured as the "
      f"difference between the compiled GPT with {t['layers'] + 1} and "
      f"{t['layers']} blocks: **{one['forward']} forward, {one['backward']} "
      f"backward** per block ({one['update']} in the update); the three "
      "query/key/value gradients are one all-reduce of three arrays (the "
      f"combiner). Outside the blocks: {outside['forward']} forward "
      f"(the vocabulary-split token embedding's lookup, and the "
      f"cross-entropy's max and sum over the vocabulary-split logits), "
      f"{outside['backward']} backward (the head's input gradient), "
      f"{outside['update']} in the update.",
      "",
  ]
  return lines


def _speed_lines(res: dict) -> list:
  first = next(iter(res["speed"].values()))
  lines = [
      "**Speed**, jdist against the same training hand-written as MaxText "
      "does it: `jax.jit` with `in_shardings`/`out_shardings` of "
      "`NamedSharding`s from rules written out in the script (checked equal "
      "to jdist's layouts), on the same mesh, from the same weights, the "
      f"same batches; no donation on either side. {len(first['seconds']['jdist'])} "
      f"interleaved rounds of {first['block']} steps; the ratio is "
      "jdist's steps/s over the hand-written's in the same round, the median "
      "[min, max]. Achieved: XLA's count of the compiled step's FLOPs per "
      "device over the median step time. MFU: the model's own count "
      f"(`GPT.train_flops`, {first['model_flops_per_step'] / 1e9:.3f} GFLOP "
      "a step: its matrix products, the causal attention's masked half left "
      "out) over the step time and the devices' peak in the step's dtype "
      f"({first['compute_dtype']}) from jdist's table of the vendors' dense "
      "figures; n/a where the table has none (every CPU).",
      "",
      "| layout | jdist tokens/s | hand-written tokens/s | jdist / hand "
      "| spread | GFLOP per device-step (compiled) | achieved GFLOP/s per "
      "device | MFU | loss after the steps, jdist / hand | max param diff |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for k, r in res["speed"].items():
    mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
    lines.append(
        f"| {LABELS[k]} | {r['tokens_per_s']['jdist']:,.0f} | "
        f"{r['tokens_per_s']['hand']:,.0f} | **{r['ratio']:.3f}** | "
        f"{r['ratio_spread'][0]:.3f} to {r['ratio_spread'][1]:.3f} | "
        f"{r['flops_per_device_step'] / 1e9:.3f} | "
        f"{r['achieved_flops_per_device'] / 1e9:.2f} | {mfu} | "
        f"{r['loss']['jdist']:.5f} / {r['loss']['hand']:.5f} | "
        f"{r['max_param_diff']:.1e} |")
  r = next(iter(res["speed"].values()))
  lines += [
      "",
      f"Both sides ran the same {r['steps']} steps. The parameters differ "
      "by rounding only: adam divides each gradient by its running scale, "
      "so a parameter whose gradient is at the level of rounding noise moves "
      "by up to the learning rate (1e-3) a step, either way; the losses "
      "agree.",
      "",
  ]
  return lines


def _keras_lines(res: dict) -> list:
  k = res.get("keras")
  if k is None:
    return ["**Keras 3**: not run (`--no-peers`)."]
  if "error" in k:
    return [f"**Keras 3**: not measured: {k['error']}"]
  return [
      f"**Against Keras 3** ({k['version']}, JAX backend): "
      "`keras.distribution.ModelParallel` on `DeviceMesh((1, 4), ['batch', "
      "'model'])` with the equivalent `LayoutMap` "
      f"({k['keras_layout']}), the same GPT built from Keras layers, loaded "
      "with the same initial weights, adam, `model.fit` on the same batches "
      "(numpy, one epoch per block), against jdist's tensor parallel custom "
      "loop over `experimental_distribute_dataset` of the same numpy batches "
      f"(placed as it goes). {len(k['seconds']['jdist'])} interleaved rounds of "
      f"{k['block']} steps; the ratio is jdist's speed over Keras's in the "
      "same round, the median [min, max].",
      "",
      "| | jdist tokens/s | Keras tokens/s | jdist / Keras | spread | loss "
      f"after {k['steps']} steps, jdist / Keras |",
      "|---|---|---|---|---|---|",
      f"| tensor parallel 4 | {k['tokens_per_s']['jdist']:,.0f} | "
      f"{k['tokens_per_s']['keras']:,.0f} | **{k['ratio']:.2f}** | "
      f"{k['ratio_spread'][0]:.2f} to {k['ratio_spread'][1]:.2f} | "
      f"{k['loss']['jdist']:.5f} / {k['loss']['keras']:.5f} |",
  ]


if __name__ == "__main__":
  main()
