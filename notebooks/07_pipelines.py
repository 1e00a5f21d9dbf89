# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07 · Pipelines: layers split into stages
#
# `jdist.ModelParallelStrategy(pipeline_axis="stage")` gives each device of a
# mesh axis a slice of a model's stacked layers; `jdist.pipeline` runs them as
# stages, microbatch after microbatch, as one SPMD program (GPipe, or circular with
# several virtual stages per device). This notebook
#
# 1. trains a small GPT with stacked blocks on a (1 data, 2 stage, 2 model) mesh and
#    on one device: the same training,
# 2. draws the schedule as it ran: each stage's busy time, recorded by the layers
#    themselves, for GPipe and for a circular schedule, with the bubble measured
#    against the formula (S - 1) / (V * M + S - 1),
# 3. compares the compiled step's memory with and without `pipeline_remat`.
#
# Runs as-is on a laptop (4 fake CPU devices), on a GPU box, and on a Colab TPU.

# %%
# Setup: the same cell works on a laptop, in CI and on Colab (TPU runtime if present).
# Without jdist (a fresh Colab runtime) it installs the wheel you uploaded next to the
# notebook (`make dist` builds dist/jdist-*.whl), or the source that JDIST_SOURCE names
# (docs/tutorials.md, "On Colab").
import glob, importlib, importlib.util, os, subprocess, sys
if importlib.util.find_spec("jdist") is None:
    wheels = sorted(glob.glob("jdist-*.whl") + glob.glob("/content/jdist-*.whl"))
    source = os.path.abspath(wheels[-1]) if wheels else os.environ.get("JDIST_SOURCE")
    if not source:
        raise RuntimeError("Install jdist first: upload dist/jdist-*.whl (make dist) next to "
                           "this notebook, or set JDIST_SOURCE (docs/tutorials.md, 'On Colab').")
    spec = source + "[examples]" if source.endswith(".whl") else f"jdist[examples] @ {source}"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", spec], check=True)
    importlib.invalidate_caches()
import jax
try:
    jax.config.update("jax_num_cpu_devices", 4)  # only used when there is no accelerator
except RuntimeError:
    pass  # JAX already started: keep its devices
import numpy as np
import optax
import jax.numpy as jnp
import jdist
from jdist.examples.models import GPT, gpt_layout_map
from jdist.examples.pipeline_timeline import Timeline, timed
devices = jax.devices()[:4]
print(devices)

# %% tags=["parameters"]
TIMED_STEPS = 3   # train steps timed per schedule (the median's is drawn)
WIDTH = 512       # the timed layers: width x width matrices ...
ROWS = 128        # ... on microbatches of this many rows

# %% [markdown]
# ## 1. A GPT whose blocks are stages
#
# `GPT(stacked=True)` keeps its blocks' parameters as one stacked tree (`blocks/...`,
# leading dimension the block) and runs them with `jdist.pipeline`;
# `gpt_layout_map(mesh, stage_axis="stage")` splits that leading dimension over the
# "stage" axis, and the heads and MLP over "model" (Megatron's split). The step is
# the ordinary one-device step. On one device the same call runs the blocks one after
# another.

# %%
model = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=2, num_layers=4, mlp_dim=32,
            stacked=True)
tx = optax.sgd(0.1, momentum=0.9)

def init_params():
    return model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]

def train_step(params, opt_state, tokens):
    def loss_fn(p):
        logits = model.apply({"params": p}, tokens[:, :-1])
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return jdist.compute_average_loss(per_token.mean(-1))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

starts = np.random.default_rng(0).integers(0, 32, size=(8, 1))
data = [((starts + np.arange(9) * 3) % 32).astype(np.int32)] * 5

def train(strategy):
    params = strategy.init(init_params)
    opt_state = strategy.init(tx.init, params)
    step = strategy.function(train_step)
    losses = []
    for tokens in strategy.experimental_distribute_dataset(data):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(strategy.reduce("sum", loss)))
    return params, losses

mesh = jdist.DeviceMesh((1, 2, 2), ("data", "stage", "model"), devices)
pipelined = jdist.ModelParallelStrategy(
    layout_map=gpt_layout_map(mesh, stage_axis="stage"), pipeline_axis="stage",
    num_microbatches=4)
print(pipelined.pipeline)
one_params, one_losses = train(jdist.OneDeviceStrategy(devices[0]))
params, losses = train(pipelined)
gap = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params)))
print("losses, one device:", [round(l, 4) for l in one_losses])
print("losses, pipelined: ", [round(l, 4) for l in losses])
print(f"largest parameter difference: {gap:.1e}")
query = params["blocks"]["attn"]["query"]["kernel"]
print("stacked query kernels", query.shape, "-> on each device",
      query.addressable_shards[0].data.shape, "(2 of 4 blocks, 1 of 2 heads)")
assert gap < 1e-5 and losses[-1] < losses[0]

# %% [markdown]
# ## 2. The schedule, as it ran
#
# To see the schedule, the layers tell the time: `timed(layer_fn, timeline)` wraps a
# layer so that every stage calls back to Python as it starts and ends it, forward
# and backward (`jdist.examples.pipeline_timeline`). Two stages on two devices, dense
# layers big enough that the callbacks' cost is small beside them, one train step
# (forward and backward) per draw. Each bar is one stage running one microbatch
# through its layers; the bubble is the time a stage waits at the loops' ends.

# %%
def timed_run(microbatches, repeats, layers_per_stage=2):
    stages = 2
    two = jdist.DeviceMesh((1, stages), ("data", "stage"), devices[:stages])
    layout_map = jdist.LayoutMap(two)
    layout_map["w"] = ("stage", None, None)
    strategy = jdist.ModelParallelStrategy(
        layout_map=layout_map, pipeline_axis="stage",
        num_microbatches=microbatches, num_repeats=repeats)
    timeline = Timeline()
    layer = timed(lambda w, h: jnp.tanh(h @ w), timeline)

    def step(p, x):
        def loss_fn(p):
            y = jdist.pipeline(layer, p["w"], x)
            return jdist.compute_average_loss(jnp.mean(y ** 2, -1))
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return jax.tree.map(lambda a, g: a - 1e-3 * g, p, grads), loss

    layers = stages * repeats * layers_per_stage
    p = strategy.init(lambda: {"w": jax.random.normal(
        jax.random.key(0), (layers, WIDTH, WIDTH)) / np.sqrt(WIDTH)})
    x = jax.random.normal(jax.random.key(1), (ROWS * microbatches, WIDTH))
    run = strategy.function(step)
    p, _ = jax.block_until_ready(run(p, x))  # compiles
    runs = []
    for _ in range(TIMED_STEPS):
        timeline.clear()
        p, _ = jax.block_until_ready(run(p, x))
        runs.append((np.mean(list(timeline.bubble_fraction().values())),
                     timeline.intervals()))
    runs.sort(key=lambda r: r[0])
    bubble, intervals = runs[len(runs) // 2]
    return strategy.pipeline, bubble, intervals, layers_per_stage

gpipe = timed_run(microbatches=4, repeats=1)
circular = timed_run(microbatches=4, repeats=2)
for name, (schedule, bubble, _, _) in [("GPipe", gpipe), ("circular", circular)]:
    print(f"{name:<9} S={schedule.num_stages} M={schedule.num_microbatches} "
          f"V={schedule.num_repeats}: bubble measured {bubble:.1%}, "
          f"formula {schedule.bubble_fraction:.1%}")

# %%
import matplotlib.pyplot as plt

def draw(ax, run, title):
    schedule, bubble, intervals, per_unit = run
    t0 = min(i.start for rows in intervals.values() for i in rows)
    colors = plt.cm.tab10.colors
    for stage, rows in intervals.items():
        for phase in ("forward", "backward"):
            mine = [i for i in rows if i.phase == phase]
            # A unit is one microbatch through the stage's layers: per_unit intervals.
            for k in range(0, len(mine), per_unit):
                unit = mine[k:k + per_unit]
                start, end = (unit[0].start - t0) * 1e3, (unit[-1].end - t0) * 1e3
                order = k // per_unit
                if phase == "backward":  # the backward loop runs the units in reverse
                    order = schedule.num_repeats * schedule.num_microbatches - 1 - order
                microbatch = order % schedule.num_microbatches
                ax.broken_barh([(start, end - start)], (stage - 0.4, 0.8),
                               facecolors=colors[microbatch % 10],
                               hatch="//" if phase == "backward" else None,
                               edgecolor="black", linewidth=0.3)
                ax.text((start + end) / 2, stage, str(microbatch), ha="center",
                        va="center", fontsize=7)
    ax.set_yticks(range(schedule.num_stages),
                  [f"stage {s}" for s in range(schedule.num_stages)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first layer (forward plain, backward hatched)")
    ax.set_title(f"{title}: M={schedule.num_microbatches}, V={schedule.num_repeats}; "
                 f"bubble {bubble:.0%} measured, {schedule.bubble_fraction:.0%} by formula")

fig, axes = plt.subplots(2, 1, figsize=(11, 4.5))
draw(axes[0], gpipe, "GPipe")
draw(axes[1], circular, "Circular")
plt.tight_layout(); plt.show()

# %% [markdown]
# Each stage waits for the first microbatch to reach it and, at the end, for the
# last to leave the stages after it: S - 1 units of work each, forward and backward.
# With V virtual stages per stage (circular), a unit is 1/V of the stage's layers,
# so the same S - 1 units weigh V times less: the bubble falls from
# (S - 1) / (M + S - 1) to (S - 1) / (V * M + S - 1). On CPU the measured bubble
# here sits below the formula: the two stages are fake devices of one process, and
# XLA:CPU runs a device's work on all the process's threads, so a stage that runs
# alone (in the bubble of its peer) takes its peer's cores too and finishes its
# layers sooner than beside it. `benchmarks/pipelines.py` measures the same way with
# each stage in a process of its own, pinned to a core of its own (as each stage has
# a chip of its own on GPUs and TPUs), on more schedules.

# %% [markdown]
# ## 3. Memory: what the backward pass keeps
#
# GPipe keeps every layer's activations of every microbatch until the backward pass.
# `pipeline_remat=True` keeps only each iteration's input and recomputes the stage's
# layers on the way back. The compiled step's memory analysis, per device, for the
# GPT on the mesh above:

# %%
for remat in (False, True):
    strategy = jdist.ModelParallelStrategy(
        layout_map=gpt_layout_map(mesh, stage_axis="stage"), pipeline_axis="stage",
        num_microbatches=4, pipeline_remat=remat)
    p = strategy.init(init_params)
    o = strategy.init(tx.init, p)
    tokens = next(iter(strategy.experimental_distribute_dataset(data[:1])))
    memory = strategy.function(train_step).lower(p, o, tokens).compile().memory_analysis()
    print(f"pipeline_remat={remat!s:<5}: temporaries {memory.temp_size_in_bytes:>8,} bytes, "
          f"arguments {memory.argument_size_in_bytes:,} bytes")
