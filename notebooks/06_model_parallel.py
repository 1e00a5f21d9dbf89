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
# # 06 · Replicas that span devices: tensor parallelism and FSDP
#
# TensorFlow's tf.distribute promised that "a replica may span multiple worker
# devices". With `jdist.ModelParallelStrategy` it does: the mesh's batch axis
# splits the batch over replicas as `MirroredStrategy` does, the other axes split
# each replica's parameters by Keras 3's `LayoutMap` rules, and XLA partitions the
# step. On a small GPT (`jdist.examples.models`) this notebook measures
#
# 1. the parameter bytes each device holds: mirrored, tensor parallel 4, FSDP 4,
# 2. each layout's plan, before its first step: memory per device, FLOPs, collectives,
# 3. one device against a 2x2 mesh (data 2 x tensor 2): the same training,
# 4. a checkpoint written on the 2x2 mesh loaded onto a 1x4 one.
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
import tempfile
import numpy as np
import optax
import jdist
from jdist.examples.models import GPT, gpt_fsdp_strategy, gpt_layout_map
devices = jax.devices()[:4]
print(devices)

# %% [markdown]
# ## The model and its training step
#
# A GPT with token and position embeddings, one decoder block (causal multi-head
# attention, MLP, layer norms) and a language-model head; tiny, so that it runs in
# seconds. The step is an ordinary per-replica step: next-token cross entropy,
# `jdist.compute_average_loss`, SGD with momentum. Nothing in it knows about
# layouts.

# %%
model = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=4, num_layers=1, mlp_dim=64)
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

# A sequence the model can learn: each token is the previous one plus 3, mod 32.
starts = np.random.default_rng(0).integers(0, 32, size=(8, 1))
data = [((starts + np.arange(9) * 3) % 32).astype(np.int32)] * 5

# %% [markdown]
# ## 1. Bytes per device
#
# `gpt_layout_map(mesh)` is Megatron's split: attention's query, key and value
# kernels by heads and the MLP's first kernel by columns, attention's output and
# the MLP's second kernel by rows, the token embedding and the head over the
# vocabulary. FSDP needs no rules: `gpt_fsdp_strategy(mesh)` splits every
# parameter along its largest dimension the axis divides. `strategy.init` creates
# the parameters already split (compiled with output shardings): no device ever
# holds the whole model. The bytes are read from the arrays' shards on device 0.

# %%
def bytes_on_first_device(tree):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

mirrored = jdist.MirroredStrategy(devices)
tensor4 = jdist.ModelParallelStrategy(
    layout_map=gpt_layout_map(jdist.DeviceMesh((1, 4), ("data", "model"), devices)))
fsdp4 = gpt_fsdp_strategy(jdist.DeviceMesh((1, 4), ("data", "fsdp"), devices))
whole = bytes_on_first_device(mirrored.init(init_params))
print(f"{'mirrored':<20}{whole:>8} bytes  1.00x")
ratios, split = {}, {}
for name, strategy in [("tensor parallel 4", tensor4), ("FSDP 4", fsdp4)]:
    split[name] = strategy.init(init_params)
    ratios[name] = bytes_on_first_device(split[name]) / whole
    print(f"{name:<20}{bytes_on_first_device(split[name]):>8} bytes  {ratios[name]:.2f}x")
query = split["tensor parallel 4"]["block_0"]["attn"]["query"]["kernel"]
print("query kernel", query.shape, "-> on each device", query.addressable_shards[0].data.shape,
      "(one head of four)")
assert ratios["tensor parallel 4"] <= 0.30 and ratios["FSDP 4"] <= 0.30

# %% [markdown]
# ## 2. Each layout planned before its first step
#
# `jdist.plan` compiles the step ahead of time for a layout (nothing runs, and the
# state need not exist: `jax.eval_shape` gives its shapes) and reads from the compiled
# program, per device: the arguments' bytes by kind, the outputs, the temporaries and
# so the peak; the FLOPs of a step (XLA's count, and the model's own, which counts the
# causal attention's masked half out); the collectives' bytes by mesh axis; and notes
# on the layout (tiny shards, keys that match nothing). On CPU no peak FLOP/s is
# known, so MFU would be "n/a"; the plans print no memory limit for the same reason.

# %%
def plan_step(state, tokens):  # jdist.plan's form: step(state, batch) -> (state, outputs)
    params, opt_state, loss = train_step(*state, tokens)
    return (params, opt_state), loss

def new_state():
    params = init_params()
    return params, tx.init(params)

shapes = jax.eval_shape(new_state)
plans = {}
for name, strategy in [("mirrored", mirrored), ("tensor parallel 4", tensor4),
                       ("FSDP 4", fsdp4)]:
    plans[name] = jdist.plan(plan_step, shapes, data[0], strategy=strategy,
                             model_flops=model.train_flops(data[0][:, :-1]))
    print(f"--- {name}\n{plans[name]}\n")
assert plans["tensor parallel 4"].argument("parameters") < plans["mirrored"].argument("parameters")
assert plans["FSDP 4"].argument("optimizer state") < plans["mirrored"].argument("optimizer state")

# %% [markdown]
# A memory budget (or, on a GPU or TPU, the device's own limit) below a plan's peak makes
# `plan.check()` (and `Trainer.fit`, before its first step) raise `jdist.MemoryBudgetError`,
# naming the largest parts and a layout that fits: jdist compiled and planned the
# alternatives to find it.

# %%
budget = plans["mirrored"].peak_bytes - 1
try:
    jdist.plan(plan_step, shapes, data[0], strategy=mirrored, memory_budget=budget).check()
    raise AssertionError("the mirrored step fits a budget below its peak")
except jdist.MemoryBudgetError as e:
    print(e)

# %% [markdown]
# ## 3. One device against a 2x2 mesh
#
# Two replicas (the "data" axis), each spanning two devices (the "model" axis).
# The same five steps on one device and on the mesh: the losses and the trained
# parameters agree to float32 rounding (the split matmuls sum in another order).

# %%
def train(strategy):
    params = strategy.init(init_params)
    opt_state = strategy.init(tx.init, params)
    step = strategy.function(train_step)
    losses = []
    for tokens in strategy.experimental_distribute_dataset(data):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(strategy.reduce("sum", loss)))
    return params, opt_state, losses

mesh22 = jdist.DeviceMesh((2, 2), ("data", "model"), devices)
tensor22 = jdist.ModelParallelStrategy(layout_map=gpt_layout_map(mesh22), batch_dim_name="data")
one_params, _, one_losses = train(jdist.OneDeviceStrategy(devices[0]))
params22, opt_state22, losses22 = train(tensor22)
gap = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip(jax.tree.leaves(params22), jax.tree.leaves(one_params)))
print("losses, one device:", np.round(one_losses, 4))
print("losses, 2x2 mesh:  ", np.round(losses22, 4))
print(f"largest parameter difference: {gap:.1e}")
assert one_losses[-1] < one_losses[0]
np.testing.assert_allclose(losses22, one_losses, atol=1e-5)
assert gap < 1e-5

# %% [markdown]
# ## 4. A checkpoint moved to another mesh
#
# `jdist.CheckpointManager` saves the 2x2 state; a 1x4 tensor-parallel strategy
# restores it into its own layout (orbax reads each device's piece), described by
# a state that strategy initialised.

# %%
state22 = {"params": params22, "opt_state": opt_state22}
directory = tempfile.mkdtemp()
with jdist.CheckpointManager(directory, strategy=tensor22) as manager:
    manager.save(5, state22)
like = {"params": split["tensor parallel 4"]}
like["opt_state"] = tensor4.init(tx.init, like["params"])
with jdist.CheckpointManager(directory, strategy=tensor4) as manager:
    state14 = manager.restore(like)
mlp_in = state14["params"]["block_0"]["mlp_in"]["kernel"]
print("restored onto", tensor4.device_mesh, "- mlp_in kernel", mlp_in.shape,
      "-> on each device", mlp_in.addressable_shards[0].data.shape)
for a, b in zip(jax.tree.leaves(state14), jax.tree.leaves(state22)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
assert mlp_in.addressable_shards[0].data.shape == (16, 16)
