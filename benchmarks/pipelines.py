"""Pipeline parallelism (issue 37): the bubble of each schedule measured from
the stages' busy time, per-device memory of the compiled step, and speed
against the same step written by hand, on 8 fake CPU devices.

1. Bubble: stacked dense layers (`tanh(h @ w)`) under
   `ModelParallelStrategy(pipeline_axis="stage")` on 2 stages, each stage
   the one device of a process of its own, pinned to a core of its own
   (pipeline_bubble.py under `jdist launch -n 2 --devices-per-process 1`).
   One device of XLA:CPU computes on the process's threads, up to every
   core it may use: with both stages in one process, a stage computing
   alone at a loop's ends takes its peer's core too and runs faster than
   beside it, and the bubble would measure the machine. Each layer records
   when each stage starts and ends it, forward and backward
   (`jdist.examples.pipeline_timeline`; `time.perf_counter`, one clock for
   both processes); a stage's bubble in a train step is its wait before its
   first layer and after its last in each loop (forward, backward) over the
   loops' spans, the mean over stages, the median over steps; against
   (S - 1) / (V * M + S - 1). Its whole idle share (1 - busy / span) and a
   layer's time alone over beside its peer are reported with it. The timed
   steps run at a raised scheduling priority (nice -20, where the process
   may: this machine is shared, and its other jobs would otherwise take
   the stages' cores).
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

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdist
from jdist.examples.models import GPT, GPTBlock, gpt_layout_map
from jdist.examples.pipeline_timeline import Timeline, timed

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import provenance  # noqa: E402  (RESULTS.md's "from which run")

CONFIGS = {
    "full": {"bubble": dict(width=512, rows=512, layers_per_stage=4,
                            steps=15),
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
           layers_per_stage: int, steps: int, niceness: int | None = -20
           ) -> dict:
  """The measured bubble of one schedule on 2 stages (see the docstring),
  the timed steps at `niceness` (None: as the process runs). In a run of
  several processes every process calls it with the run's devices: each
  records its own stage's layers, and every process gets all of them."""
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
  x = np.asarray(jax.random.normal(jax.random.key(1),
                                   (rows * microbatches, width)))
  x = next(iter(strategy.experimental_distribute_dataset([x])))
  run = strategy.function(step)
  params, _ = jax.block_until_ready(run(params, x))  # compiles
  raised = niceness is not None and _set_priority(niceness)
  recorded = []
  try:
    for _ in range(steps):
      timeline.clear()
      params, _ = jax.block_until_ready(run(params, x))
      recorded.append(timeline.events())
  finally:
    if raised:
      _set_priority(0)
  measured = _fractions([Timeline.of(e) for e in _gathered(recorded)],
                        layers_per_stage)
  return {"stages": stages, "microbatches": microbatches, "repeats": repeats,
          "layers": layers, "formula": strategy.pipeline.bubble_fraction,
          "iterations": strategy.pipeline.iterations,
          "niceness": niceness if raised else None, **measured}


def _fractions(timelines: list, layers_per_stage: int) -> dict:
  """The bubble, all idle, the gaps between iterations and alone / beside
  of each step's timeline: their medians, and the median step's timeline
  (ms from its start)."""
  fractions = [statistics.mean(t.bubble_fraction().values())
               for t in timelines]
  median = statistics.median(fractions)
  middle = min(range(len(fractions)),
               key=lambda i: abs(fractions[i] - median))
  return {"measured": median, "steps": fractions,
          "idle": statistics.median(
              statistics.mean(t.idle_fraction().values()) for t in timelines),
          "gaps": statistics.median(
              _gap_share(t, layers_per_stage) for t in timelines),
          "alone_over_together": statistics.median(
              _alone_over_together(t) for t in timelines),
          "timeline": _relative(timelines[middle])}


def _gap_share(timeline: Timeline, layers_per_stage: int) -> float:
  """The loop's own work between a stage's iterations (from its last layer
  of one to its first of the next) as a share of an iteration (first layer
  to first layer): the mean gap over the mean iteration, the forward's and
  the backward's added."""
  gaps, iterations = 0.0, 0.0
  for phase in ("forward", "backward"):
    between = []
    for rows in timeline.intervals().values():
      mine = [i for i in rows if i.phase == phase]
      runs = [mine[k:k + layers_per_stage]
              for k in range(0, len(mine), layers_per_stage)]
      between += [(b[0].start - a[-1].end, b[0].start - a[0].start)
                  for a, b in zip(runs, runs[1:])]
    if not between:
      return float("nan")
    gaps += statistics.mean(g for g, _ in between)
    iterations += statistics.mean(t for _, t in between)
  return gaps / iterations


def _gathered(recorded: list) -> list:
  """Each step's events (`Timeline.events` rows) of every process, in
  every process (each process records its own stage's)."""
  if jax.process_count() == 1:
    return recorded
  counts = multihost_utils.process_allgather(
      np.array([len(e) for e in recorded], np.int32))
  padded = np.zeros((len(recorded), int(counts.max()), 4), np.float64)
  for i, events in enumerate(recorded):
    padded[i, :len(events)] = events
  # As int32 bits: JAX would round float64 times to float32 (no x64).
  every = np.ascontiguousarray(multihost_utils.process_allgather(
      padded.view(np.int32))).view(np.float64)
  return [np.concatenate([every[p, i, :counts[p, i]]
                          for p in range(len(every))])
          for i in range(len(recorded))]


def bubble_in_processes(microbatches: int, repeats: int, *,
                        timeout: float = 1200, **config) -> dict:
  """`bubble` with each stage in a process of its own pinned to a core of
  its own: pipeline_bubble.py under `jdist launch -n 2`; its process 0's
  result, with each process's cores. `config`: `bubble`'s keywords."""
  command = [sys.executable, "-m", "jdist.launch", "-n", "2",
             "--devices-per-process", "1", str(HERE / "pipeline_bubble.py"),
             "--microbatches", str(microbatches), "--repeats", str(repeats)]
  for key, value in config.items():
    command += [f"--{key.replace('_', '-')}", str(value)]
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JDIST_", "XLA_FLAGS"))}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(  # this checkout's jdist
      filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
  # On a timeout the launcher is killed, and its processes with it.
  done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True,
                        timeout=timeout)
  lines = [l for l in done.stdout.splitlines() if l.startswith("[0] {")]
  if done.returncode or not lines:
    raise RuntimeError(
        f"pipeline_bubble.py failed (code {done.returncode}):\n"
        + done.stdout[-3000:])
  return json.loads(lines[-1][len("[0] "):])


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
    res["bubble"].append(bubble_in_processes(microbatches, repeats,
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
  lines = ["## Pipeline parallelism (issue 37)", "",
           provenance.line(res["provenance"]), ""]
  lines += _bubble_lines(res)
  lines += [f"**Memory and speed**: {res['devices']} fake CPU devices in one "
            f"process ({res['device_kind']}).", ""]
  lines += _memory_lines(res)
  lines += _speed_lines(res)
  lines += ["", f"The whole script took {res['seconds']:.0f} s."]
  return lines


def _bubble_lines(res: dict) -> list:
  b = res["config"]["bubble"]
  nice = {r["niceness"] for r in res["bubble"]}
  cores = {"; ".join(f"process {i} on core{'s' * (len(c) > 1)} "
                     + ", ".join(map(str, c)) for i, c in enumerate(r["cores"]))
           for r in res["bubble"]}
  lines = [
      "**Bubble**, measured: stacked dense layers (width "
      f"{b['width']}, {b['rows']} rows per microbatch, {b['layers_per_stage']}"
      " layers per virtual stage) on 2 stages, each stage the one CPU device "
      "of a process of its own, pinned to a core of its own (`jdist launch "
      "-n 2 --devices-per-process 1 benchmarks/pipeline_bubble.py`; every "
      "thread of " + " | ".join(sorted(cores)) + "). "
      "Each layer records on the host when its stage starts and ends it, "
      "forward and backward (`jdist.examples.pipeline_timeline`). A stage's "
      "bubble is the time it waits before its first layer and after its "
      "last in each loop (forward, backward), over the loops' spans (first "
      "start to last end of any stage); the mean over the stages, the "
      f"median over {b['steps']} train steps"
      + (f" run at nice {nice.pop()}" if len(nice) == 1 and None not in nice
         else "") + ". All idle: 1 - busy / span.",
      "",
      "| schedule | M | V | formula (S-1)/(V*M+S-1) | bubble, measured | "
      "measured / formula | steps' range | gaps between iterations p | "
      "(S-1)/(V*M+S-1-p) | all idle | a layer's time alone / beside its "
      "peer |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in res["bubble"]:
    name = "GPipe" if r["repeats"] == 1 else "circular"
    n = r["iterations"]
    lines.append(
        f"| {name} | {r['microbatches']} | {r['repeats']} | "
        f"{r['formula']:.1%} | **{r['measured']:.1%}** | "
        f"{r['measured'] / r['formula']:.2f}x | "
        f"{min(r['steps']):.1%} to {max(r['steps']):.1%} | "
        f"{r['gaps']:.2f} | {(r['stages'] - 1) / (n - r['gaps']):.1%} | "
        f"{r['idle']:.1%} | {r['alone_over_together']:.2f}x |")
  lines += [
      "",
      "The formula counts the loop's V*M+S-1 iterations, each a stage's "
      "layers; the measured bubble is what the stages waited at the loops' "
      "ends, while their peer worked alone. On cores of their own a stage's "
      "layer takes about as long alone as beside its peer (last column), so "
      "the bubble measures what the schedule makes a stage wait: S-1 "
      "iterations, before its first layer and after its last. The "
      "loop also works between a stage's iterations (p, a share of an "
      "iteration: passing the activations to the other process with "
      "`ppermute`, choosing the inputs, keeping the activations for the "
      "backward pass, adding up the parameters' gradients, the callbacks; "
      "and a stage that finishes first waiting for its peer). The span "
      "runs from the first layer's start to the last one's end, so it holds "
      "one such gap less than the loop's iterations: the bubble measures "
      "(S-1)/(V*M+S-1-p), the further above the formula the shorter the "
      "loop. "
      "With both stages as devices of one process, a stage alone computes "
      "on both cores (XLA:CPU runs a device's work on the process's "
      "threads), and the bubble measured below the formula, by about the "
      "ratio of a layer's time alone to beside its peer. All idle adds the "
      "gaps between a stage's layers to its bubble.",
      "",
  ]
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
