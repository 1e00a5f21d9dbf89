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
# # 05 · Parameter servers: asynchronous training
#
# `jdist.ParameterServerStrategy` and `jdist.ClusterCoordinator`, with TensorFlow's
# contract: variables live on parameter servers, workers run steps on their own
# batches and send their updates without waiting for each other, and a coordinator
# schedules the steps, survives lost workers and reports lost servers.
#
# On a laptop the cluster runs in this process (workers are threads on the 4 fake CPU
# devices); the last section runs the same code on Ray actors, the recipe for real
# machines. Also here: `CentralStorageStrategy`, synchronous training with the
# variables held once.

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
import time
import numpy as np
import optax
import jdist
from jdist.examples.data import load_digits
from jdist.examples.models import MLP
from jdist.examples.steps import classifier_step

x, y = load_digits(image=False)
(x_train, y_train), (x_test, y_test) = (x[:1400], y[:1400]), (x[1400:], y[1400:])
model = MLP(hidden=32)
apply_fn = lambda params, x: model.apply({"params": params}, x)
accuracy = lambda params: float(np.mean(np.argmax(apply_fn(params, x_test), -1) == y_test))
print(jax.devices())

# %% tags=["parameters"]
STEPS = 400  # the steps scheduled in sections 2 and 3

# %% [markdown]
# ## 1. A cluster in this process
#
# `LocalClusterResolver(num_workers, num_ps)` plays TensorFlow's in-process cluster;
# with a real job, `TFConfigClusterResolver()` reads `TF_CONFIG` with `chief`, `worker`
# and `ps` tasks. A partitioner splits large variables over the servers (TensorFlow's
# div partitioning along the first axis); here the first kernel (64 x 32 float32,
# 8 KiB) is cut into two pieces of at least 4 KiB.

# %%
strategy = jdist.ParameterServerStrategy(
    jdist.cluster_resolver.LocalClusterResolver(num_workers=4, num_ps=2),
    variable_partitioner=jdist.MinSizePartitioner(min_shard_bytes=4 << 10, max_shards=2))
coordinator = jdist.ClusterCoordinator(strategy)

tx = optax.sgd(0.1)
params = model.init(jax.random.key(0), x_train[:1])["params"]
state = strategy.replicate((params, tx.init(params)))   # onto the servers
print(state)
print("where the first kernel lives (server, rows):",
      state.placement()[0]["Dense_0"]["kernel"])

# %% [markdown]
# ## 2. TensorFlow's tutorial loop
#
# The step is the one written for the synchronous strategies, `step(state, batch) ->
# (state, loss)`. Each worker builds its own dataset (`dataset_fn` gets a
# `jdist.InputContext` saying which worker it is); `schedule` returns a
# `RemoteValue` at once; `join()` waits for everything scheduled.

# %%
train_step = strategy.function(classifier_step(apply_fn, tx))

def dataset_fn(ctx):
    rng = np.random.default_rng(ctx.input_pipeline_id)
    mine = np.arange(ctx.input_pipeline_id, len(x_train), ctx.num_input_pipelines)
    while True:                                   # repeat forever; schedule N steps
        i = rng.choice(mine, 32, replace=False)
        yield x_train[i], y_train[i]              # (features, labels), as tf.data's

per_worker_iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

def step_fn(iterator):                            # runs on a worker
    batch_data, labels = next(iterator)           # the tutorial's unpacking
    _, loss = train_step(state, {"x": batch_data, "y": labels})
    return strategy.reduce("sum", loss)

start = time.perf_counter()
losses = [coordinator.schedule(step_fn, args=(per_worker_iterator,)) for _ in range(STEPS)]
print(f"scheduled {STEPS} steps in {time.perf_counter() - start:.3f} s; done yet? {coordinator.done()}")
coordinator.join()
print(f"all done after {time.perf_counter() - start:.2f} s")
curve = coordinator.fetch(losses)
print(f"loss: first 20 steps {np.mean(curve[:20]):.3f}, last 20 {np.mean(curve[-20:]):.3f}")
print(f"updates applied per server: {state.version()}")
print(f"test accuracy: {accuracy(coordinator.fetch(state)[0]):.3f}")
assert set(state.version().values()) == {STEPS} and np.mean(curve[-20:]) < np.mean(curve[:20]) / 2

# %% [markdown]
# ## 3. How asynchronous is it?
#
# A worker reads the variables, runs the step, and sends each server the **change**
# (new value minus what it read), which the server adds to whatever it holds by then.
# For SGD that is TensorFlow's asynchronous SGD; integer counters count every step;
# booleans and PRNG keys take the last value written.
#
# Staleness is bounded: a server refuses a change computed from variables it has
# updated more than `max_staleness` times since (default: twice the number of
# workers); the worker then reads again and recomputes the step on the same batch.
# With `max_staleness=0` every update is applied to exactly the values it was computed
# from: training is sequential, the same as one device trained on the same batches in
# the order the servers applied them (an order that depends on timing with several
# workers).
#
# Does asynchrony cost accuracy? Compare with synchronous training that sees the same
# number of examples.

# %%
rng = np.random.default_rng(0)
batches = [{"x": x_train[i], "y": y_train[i]}
           for i in (rng.choice(1400, 32, replace=False) for _ in range(STEPS))]

def train(strategy):
    step = strategy.function(classifier_step(apply_fn, tx))
    state = strategy.replicate((params, tx.init(params)))
    for batch in strategy.experimental_distribute_dataset(batches):
        state, _ = step(state, batch)        # under parameter servers: scheduled
    return state.read()[0] if isinstance(state, jdist.ServerVariables) else state[0]

results = {"synchronous, one device": accuracy(train(jdist.OneDeviceStrategy()))}
for workers in (2, 4):
    ps = jdist.ParameterServerStrategy(jdist.cluster_resolver.LocalClusterResolver(workers, 1))
    results[f"asynchronous, {workers} workers"] = accuracy(train(ps))
    ps.coordinator.shutdown()
for name, acc in results.items():
    print(f"{name:>26}: test accuracy {acc:.3f} after {len(batches)} steps of 32")

# %% [markdown]
# ## 4. A worker fails
#
# Every scheduled function runs at least once. When a worker fails, the coordinator
# puts its function back in the queue for the others, restarts the worker, and the
# worker builds its per-worker dataset again. In this process a worker "fails" by
# raising `jdist.WorkerFailedError`; under Ray it is its process dying (section 6).

# %%
calls = iter(range(10**6))
def flaky_step_fn(iterator):
    batch_data, labels = next(iterator)
    if next(calls) in (50, 120):
        raise jdist.WorkerFailedError("preempted")    # this worker is lost mid-step
    _, loss = train_step(state, {"x": batch_data, "y": labels})
    return strategy.reduce("sum", loss)

before = state.version()
results = [coordinator.schedule(flaky_step_fn, args=(per_worker_iterator,)) for _ in range(200)]
coordinator.join()
print(f"{len(results)} scheduled, {sum(r.done() for r in results)} finished, "
      f"{state.version()[0] - before[0]} updates applied on server 0")
print(f"test accuracy: {accuracy(state.read()[0]):.3f}")
assert all(r.done() for r in results) and state.version()[0] - before[0] == 200

# %% [markdown]
# A scheduled function's own error is different: it reaches `join()` (with its
# traceback), and the functions still queued are cancelled.

# %%
def broken(iterator):
    raise ValueError("a bug in the step")

coordinator.schedule(broken, args=(per_worker_iterator,))
try:
    coordinator.join()
except ValueError as e:
    print("join() raised:", e)
    assert "a bug in the step" in str(e)
else:
    raise AssertionError("join() should have raised the step's error")

# %% [markdown]
# ## 5. Keras-style: `fit` under parameter servers
#
# `jdist.Trainer` works the same as under the synchronous strategies: each batch's step
# is scheduled on a worker, the loss and metrics are summed on the servers, and the
# validation data is evaluated on the workers at the end of every epoch. With an
# endless iterator, pass `steps_per_epoch`.

# %%
with strategy.scope():
    trainer = jdist.Trainer(MLP(hidden=32), optimizer=optax.adam(3e-3),
                            loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                            metrics=["accuracy"])
history = trainer.fit(x_train, y_train, batch_size=32, epochs=3,
                      validation_data=(x_test, y_test), verbose=2)
evaluation = trainer.evaluate(x_test, y_test)
print(evaluation)
assert evaluation["accuracy"] > 0.5   # chance is 0.1; three epochs of asynchronous updates reach 0.77-0.85
coordinator.shutdown()   # stops the workers and servers; nothing is left running

# %% [markdown]
# ## 6. The same program on Ray
#
# Across machines, the workers and parameter servers are Ray actors: `pip install
# "jdist[ray]"`, start Ray on every machine (`ray start --head` on one, `ray start
# --address=HEAD:6379` on the others), and run the program once, as the chief, with
# `backend="ray"`. The cluster's size comes from `TF_CONFIG` (chief, worker and ps
# tasks) or a `LocalClusterResolver`; Ray places the actors, restarts a worker whose
# process dies, and a dead server raises `jdist.ParameterServerError` from `join()`.
#
# Here a local Ray cluster stands in for the machines; a worker's process is killed
# with SIGKILL in the middle of training.

# %%
import signal, threading
try:
    import ray
except ImportError:
    ray = None
    print('Ray is not installed: pip install "jdist[ray]" (or "<the wheel>[ray]"), then rerun')

if ray is not None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray_strategy = jdist.ParameterServerStrategy(
        jdist.cluster_resolver.LocalClusterResolver(num_workers=2, num_ps=1), backend="ray")
    ray_coordinator = jdist.ClusterCoordinator(ray_strategy)
    ray_step = ray_strategy.function(classifier_step(apply_fn, tx))
    ray_state = ray_strategy.replicate((params, tx.init(params)))
    ray_iterator = iter(ray_coordinator.create_per_worker_dataset(dataset_fn))

    def ray_step_fn(iterator):
        batch_data, labels = next(iterator)
        _, loss = ray_step(ray_state, {"x": batch_data, "y": labels})
        return ray_strategy.reduce("sum", loss), os.getpid()   # runs in a worker's process

    warm = ray_coordinator.fetch([ray_coordinator.schedule(ray_step_fn, args=(ray_iterator,))
                                  for _ in range(40)])
    victim = warm[-1][1]
    results = [ray_coordinator.schedule(ray_step_fn, args=(ray_iterator,)) for _ in range(300)]
    threading.Timer(0.3, os.kill, (victim, signal.SIGKILL)).start()
    ray_coordinator.join()
    pids = {pid for _, pid in ray_coordinator.fetch(results)}
    print(f"killed worker process {victim}; steps ran in processes {sorted(pids)}; "
          f"{ray_state.version()[0]} updates applied for {40 + 300} scheduled")
    print(f"test accuracy: {accuracy(ray_state.read()[0]):.3f}")
    assert 40 + 300 <= ray_state.version()[0] <= 40 + 300 + 1  # none lost; at least once, as tf.distribute: the killed worker's step may reach the servers, lose its result and run again
    ray_coordinator.shutdown()
    ray.shutdown()

# %% [markdown]
# ## 7. CentralStorageStrategy: synchronous, variables held once
#
# TensorFlow's `CentralStorageStrategy` keeps one copy of the variables (on the CPU,
# or on the only GPU) and mirrors the computation over the local devices. Results are
# those of one device; between steps the state takes one copy's memory instead of one
# per replica.

# %%
def held_bytes(tree):
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards)

for strategy in (jdist.MirroredStrategy(), jdist.CentralStorageStrategy()):
    step = strategy.function(classifier_step(apply_fn, tx))
    state = strategy.replicate((params, tx.init(params)))
    for batch in strategy.experimental_distribute_dataset(batches[:50]):
        state, _ = step(state, batch)
    print(f"{type(strategy).__name__:>22}: {strategy.num_replicas_in_sync} replicas, "
          f"state held in {held_bytes(state):,} bytes, test accuracy {accuracy(state[0]):.3f}")
