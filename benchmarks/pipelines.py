"""Pipeline parallelism (issue 37): the bubble of each schedule measured from
the stages' busy time, per-device memory of the compiled step, and speed
against the same step written by hand, on 8 fake CPU devices.

1. Bubble: stacked dense layers (`tanh(h @ w)`) under
   `ModelParallelStrategy(pipeline_axis="stage")` on 2 of the devices (one
   stage per core of a 2-core machine: more stages than cores would share
   them, and a stage's time would measure the sharing). Each layer records
   when each stage starts and ends it, forward and backward
   (`jdist.examples.pipeline_timeline`); a stage's bubble in a train step
   is its wait before its first layer and after its last in each loop
   (forward, backward) over the loops' spans, the mean over stages, the
   median over steps; against (S - 1) / (V * M + S - 1). Its whole idle
   share (1 - busy / span) and a layer's time alone over beside its peer
   are reported with it. The timed steps run at a raised scheduling
   priority (nice -10, where the process may: this machine is shared;
   enough to keep its other jobs from taking the stages' cores, not to
   starve them), each device on one thread
   (`--xla_cpu_multi_thread_eigen=false`: a stage alone would otherwise run
   on both cores, faster than with its peer).
2. Memory per device: the compiled train step's memory analysis (arguments
   and temporaries) of the example GPT with stacked blocks on 4 stages
   (`DeviceMesh((1, 4, 1), ("data", "stage", "model"))`): GPipe, circular,
   each with and without `pipeline_remat`.
3. Speed: the GPT's SGD step under jdist (`strategy.function` of the step
   a one-device user writes, the blocks run by `jdist.pipeline` inside
   `GPT(stacked=True)`) against the same step written by hand: `jax.jit`
   over the mesh, the blocks in a `jax.shard_map` manual over "stage" with
   `lax.ppermute`, the same GPipe loop (bubble iterations skipped with
   `lax.cond`, views recomputed in the backward pass as jdist does), the
   other axes left to XLA; PP (1, 8, 1), PP x TP (1, 4, 2)
   and PP x TP x DP (2, 2, 2). Interleaved rounds; the ratio is jdist's
   steps/s over the hand-written's in the same round.

Run inside a process with 8 fake devices (benchmarks/run.py does this):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python benchmarks/pipelines.py [--quick] [--json]
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # not when a test imports it
  # Each fake device computes on one thread (see the module's docstring);
  # set before JAX starts its backend.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_cpu_multi_thread_eigen=false").strip()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jdist  # noqa: E402
from jdist.examples.models import GPT, GPTBlock, gpt_layout_map  # noqa: E402
from jdist.examples.pipeline_timeline import Timeline, timed  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import provenance  # noqa: E402  (RESULTS.md's "from which run")

CONFIGS = {
    "full": {"bubble": dict(width=1024, rows=512, layers_per_stage=4,
                            steps=7),
             "schedules": [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2)],
             "model": dict(vocab_size=256, max_len=32, embed_dim=128,
                           num_heads=4, num_layers=8, mlp_dim=512),
             "batch": 16, "rounds": 11, "block": 2},
    "quick": {"bubble": dict(width=256, rows=32, layers_per_stage=2,
                             steps=2),
              "schedules": [(4, 1), (4, 2)],
              "model": dict(vocab_size=64, max_len=16, embed_dim=32,
                            num_heads=2, num_layers=8, mlp_dim=64),
              "batch": 16, "rounds": 1, "block": 2},
}
MESHES = {"PP": ((1, 8, 1), 8), "PP x TP": ((1, 4, 2), 4),
          "PP x TP x DP": ((2, 2, 2), 4)}  # mesh, microbatches
AXES = ("data", "stage", "model")
LEARNING_RATE = 0.1


# ------------------------------------------------------------------- bubble


def _set_priority(niceness: int) -> bool:
  """Every thread of this process at `niceness` (Linux sets it per thread);
  False where that is not permitted."""
  try:
    for tid in os.listdir("/proc/self/task"):
      os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
  except (OSError, FileNotFoundError):
    return False
  return True


def bubble(devices, microbatches: int, repeats: int, *, width: int, rows: int,
           layers_per_stage: int, steps: int, niceness: int | None = -10
           ) -> dict:
  """The measured bubble of one schedule on 2 stages (see the docstring);
  the timed steps at `niceness` (None: as the process runs)."""
  stages = 2
  mesh = jdist.DeviceMesh((1, stages), ("data", "stage"), devices[:stages])
  layout_map = jdist.LayoutMap(mesh)
  layout_map["w"] = ("stage", None, None)
  strategy = jdist.ModelParallelStrategy(
      layout_map=layout_map, pipeline_axis="stage",
      num_microbatches=microbatches, num_repeats=repeats)
  timeline = Timeline()
  layer = timed(lambda w, h: jnp.tanh(h @ w), timeline)
  layers = stages * repeats * layers_per_stage

  def step(params, x):
    def loss_fn(p):
      y = jdist.pipeline(layer, p["w"], x)
      return jdist.compute_average_loss(jnp.mean(y ** 2, -1))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

  params = strategy.init(lambda: {"w": jax.random.normal(
      jax.random.key(0), (layers, width, width)) / np.sqrt(width)})
  x = jax.random.normal(jax.random.key(1), (rows * microbatches, width))
  run = strategy.function(step)
  params, _ = jax.block_until_ready(run(params, x))  # compiles
  raised = niceness is not None and _set_priority(niceness)
  fractions, idle, timelines, alone = [], [], [], []
  try:
    for _ in range(steps):
      timeline.clear()
      params, _ = jax.block_until_ready(run(params, x))
      fractions.append(statistics.mean(timeline.bubble_fraction().values()))
      idle.append(statistics.mean(timeline.idle_fraction().values()))
      timelines.append(_relative(timeline))
      alone.append(_alone_over_together(timeline))
  finally:
    if raised:
      _set_priority(0)
  schedule = strategy.pipeline
  median = statistics.median(fractions)
  return {"stages": stages, "microbatches": microbatches, "repeats": repeats,
          "layers": layers, "formula": schedule.bubble_fraction,
          "iterations": schedule.iterations, "measured": median,
          "steps": fractions, "idle": statistics.median(idle),
          "alone_over_together": statistics.median(alone),
          "priority_raised": raised,
          "timeline": timelines[fractions.index(median)
                                if median in fractions else 0]}


def _alone_over_together(timeline: Timeline) -> float:
  """A forward layer's mean time while no other stage works, over its mean
  time while another does (1.0 on cores of their own)."""
  rows = [i for r in timeline.intervals().values() for i in r
          if i.phase == "forward"]
  alone, together = [], []
  for i in rows:
    shared = sum(max(0.0, min(i.end, j.end) - max(i.start, j.start))
                 for j in rows if j.stage != i.stage)
    (together if shared > (i.end - i.start) / 2 else alone).append(
        i.end - i.start)
  if not alone or not together:
    return float("nan")
  return statistics.mean(alone) / statistics.mean(together)


def _relative(timeline: Timeline) -> dict:
  """One step's intervals in ms from its first start, by stage."""
  intervals = timeline.intervals()
  t0 = min(i.start for rows in intervals.values() for i in rows)
  return {str(stage): [(i.phase, round((i.start - t0) * 1e3, 2),
                        round((i.end - t0) * 1e3, 2)) for i in rows]
          for stage, rows in intervals.items()}


# ------------------------------------------------------------- the GPT step


def _tokens(cfg: dict, n: int = 4) -> list:
  rng = np.random.default_rng(0)
  m = cfg["model"]
  return [rng.integers(0, m["vocab_size"], (cfg["batch"], m["max_len"] + 1))
          .astype(np.int32) for _ in range(n)]


def _loss(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def jdist_step(model: GPT):
  """The step a one-device user writes; `GPT(stacked=True)` calls
  `jdist.pipeline`."""
  def step(params, tokens):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return jdist.compute_average_loss(_loss(logits, tokens[:, 1:]).mean(-1))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params,
                        grads), loss
  return step


def pipeline_strategy(cfg: dict, devices, shape: tuple, microbatches: int, *,
                      repeats: int = 1, remat: bool = False):
  mesh = jdist.DeviceMesh(shape, AXES, devices[:int(np.prod(shape))])
  return jdist.ModelParallelStrategy(
      layout_map=gpt_layout_map(mesh, stage_axis="stage"),
      pipeline_axis="stage", num_microbatches=microbatches,
      num_repeats=repeats, pipeline_remat=remat)


def _model(cfg: dict) -> GPT:
  return GPT(**cfg["model"], stacked=True)


def _init(model: GPT):
  return lambda: model.init(jax.random.key(0), np.zeros(
      (1, model.max_len), np.int32))["params"]


def hand_forward(model: GPT, params, tokens, blocks):
  """`GPT(stacked=True)` written out, its blocks run by `blocks`."""
  length = tokens.shape[-1]
  x = (jnp.take(params["token_embed"]["embedding"], tokens, axis=0) +
       params["position_embed"]["embedding"][jnp.arange(length)])
  x = blocks(params["blocks"], x)
  x = nn.LayerNorm().apply({"params": params["final_norm"]}, x)
  return nn.Dense(model.vocab_size).apply({"params": params["head"]}, x)


# Views and casts, recomputed in the backward pass rather than kept (as
# jdist's stages do): kept, each block's parameters sliced from the stage's
# would be saved at every iteration of the loop.
_RECOMPUTED = ("dynamic_slice", "slice", "squeeze", "reshape", "gather",
               "broadcast_in_dim", "transpose", "convert_element_type")


def hand_gpipe(model: GPT, mesh, stages: int, microbatches: int):
  """The blocks as a GPipe written by hand: a map manual over "stage"."""
  block = GPTBlock(model.num_heads, model.mlp_dim)
  m = microbatches

  def layers(w, h):
    per_stage = jax.tree.leaves(w)[0].shape[0]

    def one(h, j):
      p = jax.tree.map(lambda a: a[j], w)
      return block.apply({"params": p}, h), None
    return lax.scan(one, h, jnp.arange(per_stage))[0]

  stage_layers = jax.checkpoint(
      lambda busy, w, h: lax.cond(busy, layers, lambda _, h: h, w, h),
      policy=lambda prim, *_, **__: prim.name not in _RECOMPUTED)

  def per_stage(w, micro):
    s = lax.axis_index("stage")
    micro = lax.pcast(micro, ("stage",), to="varying")  # summed once, after
    buffer, outputs = jnp.zeros_like(micro[0]), jnp.zeros_like(micro)

    def body(t, carry):
      buffer, outputs = carry
      k = t - s
      busy = (k >= 0) & (k < m)
      k = jnp.clip(k, 0, m - 1)
      inputs = jnp.where(s == 0, micro[k], buffer)
      y = stage_layers(busy, w, inputs)
      outputs = outputs.at[k].set(
          jnp.where(busy & (s == stages - 1), y, outputs[k]))
      buffer = lax.ppermute(y, "stage",
                            [(i, i + 1) for i in range(stages - 1)])
      return buffer, outputs

    outputs = lax.fori_loop(0, m + stages - 1, body, (buffer, outputs))[1]
    return lax.psum(outputs, "stage")

  def blocks(w, x):
    rows = x.shape[0]
    micro = x.reshape(rows // m, m, *x.shape[1:]).swapaxes(0, 1)
    out = jax.shard_map(per_stage, mesh=mesh, in_specs=(P("stage"), P()),
                        out_specs=P(), axis_names={"stage"})(w, micro)
    return out.swapaxes(0, 1).reshape(x.shape)
  return blocks


class Setup:
  """One way to run the GPT's step: its step, state and batches."""

  def __init__(self, step, params, batches):
    self.step, self.params, self.batches = step, params, batches
    self.position = 0

  def run_block(self, steps: int) -> float:
    """Seconds for `steps` steps, each step waited for after the next is
    dispatched (XLA:CPU's collectives deadlock with many in flight)."""
    params, last = self.params, None
    start = time.perf_counter()
    for i in range(steps):
      batch = self.batches[(self.position + i) % len(self.batches)]
      params, loss = self.step(params, batch)
      if last is not None:
        jax.block_until_ready(last)
      last = loss
    jax.block_until_ready((params, last))
    seconds = time.perf_counter() - start
    self.params, self.position = params, self.position + steps
    return seconds

  def loss(self) -> float:
    params, loss = self.step(self.params, self.batches[0])
    del params
    return float(jnp.sum(jnp.asarray(getattr(loss, "values", loss))))


def setups(cfg: dict, devices, shape: tuple, microbatches: int) -> dict:
  """The jdist and hand-written setups on one mesh, from the same weights."""
  model = _model(cfg)
  strategy = pipeline_strategy(cfg, devices, shape, microbatches)
  params = strategy.init(_init(model))
  tokens = _tokens(cfg)
  mine = Setup(strategy.function(jdist_step(model)), params,
               list(strategy.experimental_distribute_dataset(tokens)))
  mesh = strategy.mesh
  blocks = hand_gpipe(model, mesh, shape[1], microbatches)

  def hand(params, tokens):
    def loss_fn(p):
      logits = hand_forward(model, p, tokens[:, :-1], blocks)
      return _loss(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params,
                        grads), loss

  shardings = jax.tree.map(lambda a: a.sharding, params)
  batch_sharding = NamedSharding(mesh, P("data"))
  step = jax.jit(hand, in_shardings=(shardings, batch_sharding),
                 out_shardings=(shardings, NamedSharding(mesh, P())))
  theirs = Setup(step, jax.tree.map(jnp.copy, params),
                 [jax.device_put(t, batch_sharding) for t in tokens])
  return {"jdist": mine, "hand": theirs, "strategy": strategy}


def speed(cfg: dict, devices) -> dict:
  """jdist against the hand-written step on each mesh (see the docstring)."""
  out = {}
  for name, (shape, microbatches) in MESHES.items():
    pair = setups(cfg, devices, shape, microbatches)
    runs = {k: pair[k] for k in ("jdist", "hand")}
    first = {k: s.loss() for k, s in runs.items()}  # compiles; same start
    times = {k: [] for k in runs}
    for r in range(cfg["rounds"]):
      for k in (("jdist", "hand") if r % 2 == 0 else ("hand", "jdist")):
        times[k].append(runs[k].run_block(cfg["block"]))
    ratios = [h / j for j, h in zip(times["jdist"], times["hand"])]
    after = {k: s.loss() for k, s in runs.items()}
    out[name] = {
        "mesh": list(shape), "microbatches": microbatches,
        "steps_per_s": {k: cfg["block"] / statistics.median(t)
                        for k, t in times.items()},
        "ratio": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)], "seconds": times,
        "loss_first": first, "loss_after": after,
        "steps": cfg["rounds"] * cfg["block"] + 2}
  return out


def memory(cfg: dict, devices) -> dict:
  """Compiled train step's bytes per device for each schedule, 4 stages."""
  model = _model(cfg)
  step = jdist_step(model)
  tokens = _tokens(cfg, 1)
  out = {}
  for name, microbatches, repeats in (("GPipe", 4, 1), ("GPipe", 8, 1),
                                      ("circular", 4, 2)):
    for remat in (False, True):
      strategy = pipeline_strategy(cfg, devices, (1, 4, 1), microbatches,
                                   repeats=repeats, remat=remat)
      params = strategy.init(_init(model))
      batch = next(iter(strategy.experimental_distribute_dataset(tokens)))
      analysis = strategy.function(step).lower(
          params, batch).compile().memory_analysis()
      key = f"{name} M={microbatches}" + (" V=2" if repeats > 1 else "")
      out.setdefault(key, {})["remat" if remat else "plain"] = {
          "argument_bytes": analysis.argument_size_in_bytes,
          "temp_bytes": analysis.temp_size_in_bytes}
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line at the end")
  args = parser.parse_args(argv)
  return provenance.report(lambda: measure(args), section, args.json)


def measure(args) -> dict:
  """Everything the section shows, for `main`'s arguments."""
  cfg = CONFIGS["quick" if args.quick else "full"]
  devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit("needs 8 devices: XLA_FLAGS="
                     "--xla_force_host_platform_device_count=8")
  started = time.perf_counter()
  log = lambda *a: print(f"[{time.perf_counter() - started:5.0f} s]", *a,
                         file=sys.stderr, flush=True)
  res = {"config": cfg, "devices": len(devices),
         "device_kind": devices[0].device_kind}
  res["bubble"] = []
  for microbatches, repeats in cfg["schedules"]:
    log(f"bubble M={microbatches} V={repeats}")
    res["bubble"].append(bubble(devices, microbatches, repeats,
                                **cfg["bubble"]))
  log("memory")
  res["memory"] = memory(cfg, devices)
  log("speed")
  res["speed"] = speed(cfg, devices)
  res["seconds"] = time.perf_counter() - started
  return res


# ------------------------------------------------------------- RESULTS.md


def _mb(b: float) -> str:
  return f"{b / 2**20:.2f} MB"


def section(res: dict) -> list:
  """The "Pipeline parallelism (issue 37)" section of RESULTS.md."""
  cfg, b = res["config"], res["config"]["bubble"]
  raised = all(r["priority_raised"] for r in res["bubble"])
  lines = [
      "## Pipeline parallelism (issue 37)",
      "",
      provenance.line(res["provenance"]),
      "",
      f"{res['devices']} fake CPU devices ({res['device_kind']}), each "
      "computing on one thread.",
      "",
      "**Bubble**, measured: stacked dense layers (width "
      f"{b['width']}, {b['rows']} rows per microbatch, {b['layers_per_stage']}"
      " layers per virtual stage) on 2 stages (2 devices, one per core). "
      "Each layer records on the host when each stage starts and ends it, "
      "forward and backward (`jdist.examples.pipeline_timeline`). A stage's "
      "bubble is the time it waits before its first layer and after its "
      "last in each loop (forward, backward), over the loops' spans (first "
      "start to last end of any stage); the mean over the stages, the "
      f"median over {b['steps']} train steps"
      + (" run at nice -10" if raised else "") + ". "
      "All idle adds the gaps between a stage's layers (1 - busy / span).",
      "",
      "| schedule | M | V | formula (S-1)/(V*M+S-1) | bubble, measured | "
      "measured / formula | steps' range | all idle | a layer's time alone / "
      "beside its peer |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in res["bubble"]:
    name = "GPipe" if r["repeats"] == 1 else "circular"
    lines.append(
        f"| {name} | {r['microbatches']} | {r['repeats']} | "
        f"{r['formula']:.1%} | **{r['measured']:.1%}** | "
        f"{r['measured'] / r['formula']:.2f}x | "
        f"{min(r['steps']):.1%} to {max(r['steps']):.1%} | "
        f"{r['idle']:.1%} | {r['alone_over_together']:.2f}x |")
  lines += [
      "",
      "The formula assumes every iteration takes one stage's layer time; "
      "the measured bubble is what the stages waited at the loops' ends, "
      "while their peer ran alone: where a layer alone takes less time than "
      "beside its peer (the two devices share the machine's caches and "
      "memory bandwidth, and its cores with other work), the bubble "
      "measures below the formula by about that ratio. "
      "The gaps between a stage's layers (all idle minus the bubble) are "
      "the loop's own work between them: passing the activations on "
      "(`ppermute`), choosing the inputs, keeping the activations for the "
      "backward pass, adding up the parameters' gradients, the callbacks; "
      "and, on a shared machine, a stage that finishes first waiting for "
      "its peer at the iteration's `ppermute`.",
      "",
  ]
  lines += _memory_lines(res)
  lines += _speed_lines(res)
  lines += ["", f"The whole script took {res['seconds']:.0f} s."]
  return lines


def _memory_lines(res: dict) -> list:
  m = res["config"]["model"]
  lines = [
      "**Memory per device**: the example GPT with stacked blocks "
      f"({m['num_layers']} blocks, embed {m['embed_dim']}, {m['max_len']} "
      f"tokens, global batch {res['config']['batch']}) on 4 stages "
      "(`DeviceMesh((1, 4, 1), ('data', 'stage', 'model'))`), the compiled "
      "SGD step's memory analysis: arguments (parameters, batch) and "
      "temporaries (activations kept for the backward pass, gradients).",
      "",
      "| schedule | arguments | temporaries | with `pipeline_remat` | remat / "
      "plain |",
      "|---|---|---|---|---|",
  ]
  for name, r in res["memory"].items():
    plain, remat = r["plain"], r["remat"]
    lines.append(
        f"| {name} | {_mb(plain['argument_bytes'])} | "
        f"{_mb(plain['temp_bytes'])} | {_mb(remat['temp_bytes'])} | "
        f"{remat['temp_bytes'] / plain['temp_bytes']:.2f}x |")
  return lines + [""]


def _speed_lines(res: dict) -> list:
  first = next(iter(res["speed"].values()))
  lines = [
      "**Speed**: the GPT's SGD step, jdist (`strategy.function` of the "
      "one-device step) against the same step by hand (`jax.jit`, the blocks "
      "in a `jax.shard_map` over \"stage\" with `lax.ppermute`, the same "
      "GPipe loop with the same checkpoint policy), same weights, same "
      "batches; "
      f"{len(first['seconds']['jdist'])} interleaved rounds of "
      f"{res['config']['block']} steps; ratio: jdist's steps/s over the "
      "hand-written's in the same round, the median and its range.",
      "",
      "| parallelism | mesh (data, stage, model) | M | jdist steps/s | "
      "hand-written steps/s | jdist / hand | range | loss after, jdist / "
      "hand |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for name, r in res["speed"].items():
    lines.append(
        f"| {name} | {tuple(r['mesh'])} | {r['microbatches']} | "
        f"{r['steps_per_s']['jdist']:.2f} | {r['steps_per_s']['hand']:.2f} "
        f"| **{r['ratio']:.3f}** | {r['ratio_spread'][0]:.3f} to "
        f"{r['ratio_spread'][1]:.3f} | {r['loss_after']['jdist']:.5f} / "
        f"{r['loss_after']['hand']:.5f} |")
  return lines


if __name__ == "__main__":
  main()
