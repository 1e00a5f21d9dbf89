# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · A custom training loop, in depth
#
# What happens inside a jdist step: the replica context and its collectives,
# why the loss is divided by the **global** batch, what `compute_average_loss`
# does with a short last batch, metrics kept per replica with `SyncOnRead`,
# checking your own step against one device with `assert_equivalent`, the
# double-reduction error, triggered on purpose, and three ways to need less memory
# per device, with the bytes measured: optimizer state split over the replicas,
# gradient accumulation and mixed precision.
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
import jax.numpy as jnp
import numpy as np
import optax
import jdist
import jdist.testing
print(jax.devices())

# %% [markdown]
# ## 1. The replica context
#
# `strategy.run(fn, args)` runs `fn` once per replica. Inside, `jdist.get_replica_context()`
# says which replica this is and offers collectives over all of them. Values that are
# the same on every replica come back as one mirrored array; values that differ come
# back as `jdist.PerReplica`, one entry per replica.

# %%
strategy = jdist.MirroredStrategy()
n = strategy.num_replicas_in_sync

def show_context(x):
    ctx = jdist.get_replica_context()
    rid = ctx.replica_id_in_sync_group
    mine = x * (rid + 1)                      # differs per replica
    return {
        "replica_id": rid,
        "mine": mine,
        "sum": ctx.all_reduce(jdist.ReduceOp.SUM, mine),
        "max": ctx.all_reduce("max", mine),
        "gathered": ctx.all_gather(mine[None], axis=0),
        # merge_call: one function sees every replica's value at once
        "merged": ctx.merge_call(lambda s, v: s.reduce("mean", v), args=(mine,)),
    }

out = strategy.run(show_context, args=(jnp.float32(10.0),))
for name, value in out.items():
    kind = "PerReplica" if isinstance(value, jdist.PerReplica) else "mirrored"
    shown = [float(v) for v in strategy.experimental_local_results(value)] \
        if kind == "PerReplica" else np.asarray(value)
    print(f"{name:>10} ({kind}): {shown}")

# %% [markdown]
# ## 2. Why the loss is divided by the global batch
#
# Under `shard_map`, the gradient with respect to mirrored parameters is **already
# summed over replicas** by autodiff (the transpose of broadcasting the parameters
# to every replica is a sum), just as `apply_gradients` sums in tf.distribute.
# So each replica's loss must be its share of the global mean:
# `sum(per_example_loss) / global_batch`. Taking the local mean instead makes the
# gradient `num_replicas` times too large. jdist finds that mistake in the step's
# program when it compiles it and raises `jdist.LossScalingError`; to show the wrong
# gradient anyway, this cell builds the step with `check_loss_scaling=False`.

# %%
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 5)).astype(np.float32)
y = x @ np.arange(1, 6, dtype=np.float32)
w = jnp.zeros(5)

def per_example(w, batch):
    return (batch["x"] @ w - batch["y"]) ** 2

one_device = jax.grad(lambda w: per_example(w, {"x": x, "y": y}).mean())(w)
batch = next(iter(strategy.experimental_distribute_dataset([{"x": x, "y": y}])))

def grads(w, batch):
    right = jax.grad(lambda w: jdist.compute_average_loss(per_example(w, batch)))(w)
    wrong = jax.grad(lambda w: per_example(w, batch).mean())(w)   # local mean
    return right, wrong

unchecked = strategy.function(grads, check_loss_scaling=False)
right, wrong = unchecked(strategy.replicate(w), batch)
print("one device            ", np.round(one_device, 3))
print("compute_average_loss  ", np.round(right, 3))
print(f"local mean (x{n} too big)", np.round(wrong, 3))
print("ratio wrong/right:", float(wrong[0] / right[0]))
np.testing.assert_allclose(right, one_device, rtol=1e-5)    # exact against one device
np.testing.assert_allclose(wrong, n * right, rtol=1e-5)     # N times too big
try:
    strategy.run(grads, args=(strategy.replicate(w), batch))
except jdist.LossScalingError as e:
    print("\njdist.LossScalingError:", str(e)[:160], "...")
else:
    raise AssertionError("jdist should have refused the local mean")

# %% [markdown]
# ## 3. A short last batch
#
# 100 examples in global batches of 64 leave a last batch of 36. jdist pads it to 64
# (so the step does not recompile) and marks the padding in a mask; `compute_average_loss`
# divides by the 36 valid examples, so the epoch mean is exact.

# %%
x100 = rng.standard_normal((100, 5)).astype(np.float32)
y100 = x100 @ np.arange(1, 6, dtype=np.float32)
data = [{"x": x100[:64], "y": y100[:64]}, {"x": x100[64:], "y": y100[64:]}]

@strategy.function
def loss_step(w, batch):
    return jdist.compute_average_loss(per_example(w, batch))

w1 = strategy.replicate(jnp.ones(5))
total = 0.0
for b in strategy.experimental_distribute_dataset(data):
    valid = int(b.num_valid)
    print(f"batch: {valid} valid of {b.mask.size}; mask per replica:",
          np.asarray(b.mask).sum(axis=1))
    total += float(strategy.reduce("sum", loss_step(w1, b))) * valid
exact = float(per_example(jnp.ones(5), {"x": x100, "y": y100}).mean())
print(f"epoch mean {total / 100:.6f}  exact mean {exact:.6f}  compilations: {loss_step.num_compilations}")

# %% [markdown]
# ## 4. Metrics kept per replica: `SyncOnRead`
#
# A metric accumulator updated inside the step from each replica's own examples
# differs between replicas. Wrap it in `jdist.SyncOnRead`: each replica keeps its
# own copy, and reading it outside the step aggregates (SUM here).

# %%
def count_step(totals, batch):
    valid = jdist.get_replica_context().example_mask
    close = (jnp.abs(batch["x"] @ jnp.arange(1.0, 6.0) - batch["y"]) < 1e-3) & valid
    return totals.assign({"close": totals.value["close"] + jnp.sum(close),
                          "seen": totals.value["seen"] + jnp.sum(valid)})

totals = strategy.replicate(jdist.SyncOnRead({"close": jnp.int32(0), "seen": jnp.int32(0)}, "sum"))
for b in strategy.experimental_distribute_dataset(data):
    totals = strategy.run(count_step, args=(totals, b))
print("per replica 'seen':", np.asarray(totals.value["seen"]))
print("read:", {k: int(v) for k, v in totals.read().items()})

# %% [markdown]
# `jdist.metrics` does this for you with Keras' names: a metric is a value that goes
# into the step and comes back updated (`m = m.update(...)`, the padding rows left
# out), and `m.result()` outside adds up every replica.

# %%
close = jdist.metrics.MeanMetricWrapper(
    lambda y, pred: jnp.abs(pred - y) < 1e-3, name="close")
step = strategy.function(lambda m, b: m.update(b["y"], b["x"] @ jnp.arange(1.0, 6.0)))
for b in strategy.experimental_distribute_dataset(data):
    close = step(close, b)
print("fraction close:", float(close.result()), "over", int(close.sums()["count"]), "examples")

# %% [markdown]
# ## 5. Check your own step against one device
#
# `jdist.testing.assert_equivalent(step_fn, state, batches, num_replicas=N)` trains
# with your step on one device and on N and fails with a readable diff when they
# disagree. Here it passes for the right step. The local-mean mistake does not even
# get that far: compiling it raises `jdist.LossScalingError` (a mistake the
# compile-time check cannot see, such as a weighted local mean, gets the diff, with a
# line naming loss scaling when the runs differ by the number of replicas).

# %%
tx = optax.sgd(0.3)

def make_step(scale_right):
    def train_step(state, batch):
        w, opt = state
        loss = jdist.compute_average_loss(per_example(w, batch))  # what we report
        if scale_right:
            g = jax.grad(lambda w: jdist.compute_average_loss(per_example(w, batch)))(w)
        else:
            g = jax.grad(lambda w: per_example(w, batch).mean())(w)  # the mistake
        upd, opt = tx.update(g, opt)
        return (optax.apply_updates(w, upd), opt), loss
    return train_step

batches = [{"x": x100[i:i + 20], "y": y100[i:i + 20]} for i in range(0, 100, 20)]
state = (jnp.zeros(5), tx.init(jnp.zeros(5)))
result = jdist.testing.assert_equivalent(make_step(True), state, batches, num_replicas=n)
print("equivalent; final w:", np.round(result.state[0], 4))
try:
    jdist.testing.assert_equivalent(make_step(False), state, batches, num_replicas=n)
except jdist.LossScalingError as e:
    print("jdist.LossScalingError:", str(e)[:160], "...")
else:
    raise AssertionError("assert_equivalent should have caught the local mean")

# %% [markdown]
# ## 6. The double-reduction trap, on purpose
#
# Code ported from a hand-written `pmap` loop often all-reduces gradients. Under
# jdist they are already summed, so a SUM all-reduce would multiply them by N.
# jdist refuses, and says why.

# %%
def ported_step(w, batch):
    g = jax.grad(lambda w: jdist.compute_average_loss(per_example(w, batch)))(w)
    return jdist.all_reduce("sum", g)      # the mistake

try:
    strategy.run(ported_step, args=(strategy.replicate(w), batch))
except jdist.DoubleReductionError as e:
    print("DoubleReductionError:", e)
else:
    raise AssertionError("jdist should have refused the second all-reduce")

# %% [markdown]
# ## 7. One picture: the same training on 1 and on N devices
#
# Loss per step of the right step on one device and on all devices (the curves
# coincide), and of the local-mean step: its gradients are N times too large, a
# learning rate N times too high in disguise, and at this learning rate it diverges.

# %%
import matplotlib
import matplotlib.pyplot as plt

def losses(step_fn, strat):
    f = strat.function(step_fn, check_loss_scaling=False)  # the mistake, on purpose
    s = strat.replicate(state)
    out = []
    for _ in range(4):
        for b in strat.experimental_distribute_dataset(batches):
            s, loss = f(s, b)
            out.append(float(strat.reduce("sum", loss)))
    return out

one = jdist.OneDeviceStrategy()
curves = {"1 device": losses(make_step(True), one),
          f"{n} devices": losses(make_step(True), strategy),
          f"{n} devices, local mean": losses(make_step(False), strategy)}
fig, ax = plt.subplots(figsize=(6, 3.5))
for (label, values), style in zip(curves.items(), ["-", "--", ":"]):
    ax.plot(values, style, label=label, linewidth=2)
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend()
ax.set_title("compute_average_loss makes N devices follow 1 device")
plt.show()
print("max |1 device - N devices| loss:",
      max(abs(a - b) for a, b in zip(curves["1 device"], curves[f"{n} devices"])))

# %% [markdown]
# ## 8. Less memory per device: optimizer state split over the replicas (ZeRO)
#
# Mirrored training keeps a whole copy of the optimizer state on every device: adam's
# two moments are twice the parameters, on each. `jdist.ShardedOptimizer` wraps the
# optax optimizer so that each replica keeps one block of every state leaf: its update
# takes the gradients' block, updates it, and all-gathers the update, so the parameters
# stay mirrored and take the same steps. Its `value_and_grad` returns each replica's
# own gradients, which `update` then reduce-scatters (ZeRO-2) instead of the all-reduce.
# The state's bytes on one device are read from the arrays' shards; on 4 devices the
# sharded state is about a quarter of the mirrored one (benchmarks/RESULTS.md: 0.25x
# for an MLP 64-512-512-10, parameters after 20 steps within 1e-7 of mirrored).

# %%
from flax import linen as nn

class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(10)(x)

def max_abs_difference(a, b):
    """The largest |a - b| over two trees' leaves, computed on the host (each jnp
    operation on arrays spread over the devices would compile a program of its own)."""
    a, b = jax.device_get((a, b))
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

def bytes_on(device, tree):
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
               for s in leaf.addressable_shards if s.device == device)

rng = np.random.default_rng(0)
wide_batches = [{"x": rng.standard_normal((32 * n, 64)).astype(np.float32),
                 "y": rng.integers(0, 10, 32 * n).astype(np.int32)} for _ in range(10)]
wide = Wide()
wide_params = strategy.replicate(wide.init(jax.random.key(0), wide_batches[0]["x"][:1])["params"])

def train_wide(tx, grad):
    @strategy.function
    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = wide.apply({"params": p}, batch["x"])
            return jdist.compute_average_loss(
                optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))
        loss, grads = grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    params, opt_state = wide_params, tx.init(wide_params)
    state_bytes = bytes_on(strategy.devices[0], opt_state)
    for batch in strategy.experimental_distribute_dataset(wide_batches):
        params, opt_state = step(params, opt_state, batch)
    return params, state_bytes

mirrored_params, mirrored_bytes = train_wide(optax.adam(1e-3), jax.value_and_grad)
sharded_tx = jdist.ShardedOptimizer(optax.adam(1e-3), strategy)
sharded_params, sharded_bytes = train_wide(sharded_tx, sharded_tx.value_and_grad)
print("split axis of each parameter:", sharded_tx.layout(wide_params))
print(f"adam state on one device: mirrored {mirrored_bytes:,} bytes, "
      f"sharded {sharded_bytes:,} bytes ({sharded_bytes / mirrored_bytes:.2f}x on {n} devices)")
print("max |mirrored - sharded| parameter after 10 steps:",
      max_abs_difference(mirrored_params, sharded_params))

# %% [markdown]
# With `jdist.Trainer` it is one argument: `Trainer(..., shard_optimizer_state=True)`.
# Checkpoints of the sharded state restore onto any number of devices (the leaves keep
# their shapes; orbax reads each device's block). An optimizer that is not elementwise
# (`clip_by_global_norm`, adafactor, lamb) is refused by `init` with a
# `jdist.ShardingError`: each replica sees only its block of each parameter.

# %% [markdown]
# ## 9. Less memory for activations: accumulation and mixed precision
#
# Two more ways to fit a bigger batch or model on the same devices, both measured here
# from the compiled step's own memory analysis (`step.lower(...).compile()`):
#
# - `jdist.accumulate_gradients(loss_fn, params, batch, num_micro_batches=K)` runs each
#   replica's batch as K micro-batches in one compiled step: only one micro-batch's
#   activations are alive at a time, the gradients are all-reduced once, and the result
#   equals the whole batch's (`Trainer(..., micro_batches=K)` in `fit`).
# - A mixed `jdist.DTypePolicy` runs the model in bfloat16 on float32 master weights:
#   the activations the backward pass keeps take half the bytes
#   (`Trainer(..., dtype_policy="mixed_bfloat16")` in `fit`). XLA's CPU backend still
#   computes the matrix products in float32, so on CPU the compiled temporaries fall
#   less than on a TPU, where benchmarks/RESULTS.md measures 0.45x of float32 (TPU v5e,
#   compiled ahead of time without one).

# %%
from jdist.examples.models import CNN

cnn = CNN()
images = {"x": rng.standard_normal((256 * n, 8, 8, 1)).astype(np.float32),
          "y": rng.integers(0, 10, 256 * n).astype(np.int32)}
(placed,) = strategy.experimental_distribute_dataset([images])
cnn_params = strategy.replicate(cnn.init(jax.random.key(0), images["x"][:1])["params"])

def compiled_step(policy_name, k):
    policy = jdist.DTypePolicy(policy_name)
    def loss_fn(p, b):
        logits = cnn.apply({"params": policy.cast_to_compute(p)}, policy.cast_to_compute(b["x"]))
        return jdist.compute_average_loss(optax.softmax_cross_entropy_with_integer_labels(
            policy.cast_to_variable(logits), b["y"]))
    @strategy.function
    def step(params, batch):
        loss, grads = jdist.accumulate_gradients(loss_fn, params, batch, num_micro_batches=k)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    return step

def residual_bytes(policy_name, batch):
    """What the forward pass keeps for the backward pass, on one replica."""
    policy = jdist.DTypePolicy(policy_name)
    def loss(p):
        logits = cnn.apply({"params": policy.cast_to_compute(p)}, policy.cast_to_compute(batch["x"]))
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
            policy.cast_to_variable(logits), batch["y"]))
    backward = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], jax.device_get(cnn_params))
    return sum(r.size * r.dtype.itemsize for r in jax.tree.leaves(backward))

one_replica = {"x": images["x"][:256], "y": images["y"][:256]}
temps, steps = {}, {}
for policy_name, k in [("float32", 1), ("float32", 4), ("mixed_bfloat16", 1)]:
    step = steps[policy_name, k] = compiled_step(policy_name, k)
    temps[policy_name, k] = step.lower(cnn_params, placed).compile().memory_analysis().temp_size_in_bytes
    print(f"{policy_name:15} K={k}: compiled temporaries {temps[policy_name, k] / 2**20:5.1f} MB per device "
          f"({temps[policy_name, k] / temps['float32', 1]:.2f}x)")
for policy_name in ("float32", "mixed_bfloat16"):
    kept = residual_bytes(policy_name, one_replica)
    print(f"{policy_name:15}: activations kept for the backward pass {kept / 2**20:.1f} MB "
          f"({kept / residual_bytes('float32', one_replica):.2f}x)")

# Same training: K=4 equals one step on the whole batch (the steps compiled above run).
(k1, loss1), (k4, loss4) = [steps["float32", k](cnn_params, placed) for k in (1, 4)]
print("max |K=1 - K=4| parameter after one step:",
      max_abs_difference(k1, k4))
