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
# # 04 · Many hosts
#
# The same training on several processes: `jdist launch` starts 2 local processes
# (2 fake CPU devices each) from a cell, they train as one 4-replica
# `MultiWorkerMirroredStrategy`, and the result is compared with 4 devices in this
# notebook. Then a failure on purpose (what a mismatch looks like instead of a
# hang), and the recipes for TF_CONFIG, SLURM, Kubernetes and a TPU pod.

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
import json, os, pathlib, tempfile, textwrap
import numpy as np
import jdist
print(jax.devices())
workdir = pathlib.Path(tempfile.mkdtemp(prefix="jdist-04-"))

# %% [markdown]
# ## 1. A training script for many processes
#
# The training lives in a small module, `digits_training.py`, used both by the
# launched script and, in part 3, by this notebook. The only multi-host line is
# the strategy: `MultiWorkerMirroredStrategy()` joins the run (from the variables
# `jdist launch` sets, or `TF_CONFIG`, or SLURM...). Every process iterates the
# same global batches; each keeps its own replicas' rows. `strategy.reduce`
# gives every process the same value.

# %%
(workdir / "digits_training.py").write_text(textwrap.dedent('''
    import jax, optax
    import jdist
    from jdist.examples.data import load_digits, batches
    from jdist.examples.models import MLP
    from jdist.examples.steps import classifier_step  # the seed tutorial's step

    def train(strategy, learning_rate=1e-2):
        """20 steps of the seed MLP on digits; returns the losses and Dense_0's kernel."""
        x, y = load_digits(image=False)
        data = batches(x[:1280], y[:1280], 64)
        model, tx = MLP(), optax.adam(learning_rate)
        params = model.init(jax.random.key(0), x[:1])["params"]
        step = strategy.function(classifier_step(
            lambda p, x: model.apply({"params": p}, x), tx))

        state = strategy.replicate((params, tx.init(params)))
        losses = []
        for batch in strategy.experimental_distribute_dataset(data):
            state, loss = step(state, batch)
            losses.append(float(strategy.reduce("sum", loss)))
        kernel = state[0]["Dense_0"]["kernel"]
        return losses, kernel.addressable_data(0)
'''))

script = workdir / "train.py"
script.write_text(textwrap.dedent('''
    import json, sys
    import jdist
    strategy = jdist.MultiWorkerMirroredStrategy()     # first: joins the run
    import jax, numpy as np
    from digits_training import train

    losses, kernel = train(strategy)
    me = jax.process_index()
    print(f"process {me} of {jax.process_count()}: {strategy.num_replicas_in_sync} "
          f"replicas, {len(jax.local_devices())} local; final loss {losses[-1]:.6f}")
    if me == 0:
        np.save(sys.argv[1], np.asarray(kernel))
        json.dump(losses, open(sys.argv[1] + ".json", "w"))
'''))
print(script.read_text())

# %% [markdown]
# ## 2. Launch it on 2 processes × 2 devices
#
# `jdist launch` (also `python -m jdist.launch`) picks a free port, sets each
# process's variables, streams their output with a rank prefix, and stops the
# others if one fails.

# %%
def launch(*args, timeout=300):
    env = dict(os.environ)  # XLA's flags pass on, but the launcher sets each one's devices
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "jdist.launch", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    out = [l for l in (proc.stdout + proc.stderr).splitlines() if "Gloo" not in l]
    return proc.returncode, "\n".join(out)

code, output = launch("-n", 2, "--devices-per-process", 2, script, workdir / "kernel.npy")
print("exit code", code)
print(output)

# %% [markdown]
# ## 3. The same as 4 devices in one process
#
# The same `train` on a `MirroredStrategy` over this notebook's 4 devices gives the
# same losses and parameters as the 2×2 run.

# %%
sys.path.insert(0, str(workdir))
from digits_training import train

strategy = jdist.MirroredStrategy()
local_losses, local_kernel = train(strategy)
multi_losses = json.load(open(workdir / "kernel.npy.json"))
multi_kernel = np.load(workdir / "kernel.npy")
print(f"{strategy.num_replicas_in_sync} local devices vs 2 processes x 2 devices:")
print("  largest loss difference:  ", max(abs(a - b) for a, b in zip(local_losses, multi_losses)))
print("  largest weight difference:", float(np.max(np.abs(np.asarray(local_kernel) - multi_kernel))))
np.testing.assert_allclose(local_losses, multi_losses, rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(np.asarray(local_kernel), multi_kernel, rtol=1e-4, atol=1e-6)

import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(local_losses, "-", linewidth=3, label="4 devices, 1 process")
ax.plot(multi_losses, "--", linewidth=2, label="2 processes x 2 devices")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(); ax.set_title("One run, two layouts")
plt.show()

# %% [markdown]
# ## 4. A failure, on purpose
#
# Multi-process programs that go wrong usually hang: one process waits in a
# collective for a peer that will never come. Here process 1 trains with another
# learning rate, so the two processes compiled different programs. jdist compares
# a fingerprint of every step's program across processes before the first
# collective, and every process stops with an error that says what differs.

# %%
bad = workdir / "mismatch.py"
bad.write_text(script.read_text().replace(
    "train(strategy)", "train(strategy, 1e-2 if jax.process_index() == 0 else 1e-3)"))
code, output = launch("-n", 2, "--devices-per-process", 2, bad, workdir / "bad.npy")
print("exit code", code)
print("\n".join(l for l in output.splitlines() if "ProgramMismatchError" in l or "launch" in l)[:1500])

# %% [markdown]
# ## 5. Recipes: where the cluster comes from
#
# `MultiWorkerMirroredStrategy()` and `jdist.initialize()` find the cluster in this
# order: an explicit `cluster_resolver=`, jdist's own variables (`jdist launch`),
# TensorFlow's `TF_CONFIG`, then JAX's detection of SLURM, Open MPI, Kubernetes and
# Cloud TPU. The resolvers can be asked what they would do without joining anything.
#
# **TF_CONFIG** — a TensorFlow job's environment works unchanged: chief and workers
# become processes 0..N-1 and the first task's address hosts the coordinator.

# %%
tf_config = {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
             "task": {"type": "worker", "index": 1}}
print(jdist.cluster_resolver.TFConfigClusterResolver(tf_config).resolve())

# %% [markdown]
# **SLURM** — JAX reads the job's variables; start one task per process, e.g.
# `srun --nodes=2 --ntasks-per-node=4 --gpus-per-task=1 python train.py`. Here is
# what the third task of such a job would resolve to:

# %%
slurm = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "2", "SLURM_STEP_NODELIST": "gpu-node[07-08]"}
saved = {k: os.environ.get(k) for k in slurm}
os.environ.update(slurm)
try:
    print(jdist.cluster_resolver.JaxClusterResolver("slurm").resolve())
finally:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

# %% [markdown]
# **Kubernetes** — an indexed Job with a headless Service sets jdist's variables
# (`JDIST_COORDINATOR_ADDRESS=train-0.train:1234`, `JDIST_NUM_PROCESSES`, and
# `JDIST_PROCESS_ID` from the job-completion index); the full manifest is in the
# docs/many_hosts.md.
#
# **A TPU pod slice** — use `jdist.TPUStrategy()` (the same engine on TPU cores)
# and run the same script on every host:
#
# ```sh
# gcloud compute tpus tpu-vm ssh my-pod --zone=us-central2-b --worker=all \
#     --command="python train.py"
# ```
#
# On a Colab TPU runtime (one host), `jdist.TPUStrategy()` uses its 8 cores
# directly; where there is no TPU it says so:

# %%
try:
    tpu = jdist.TPUStrategy()
    print(tpu, tpu.num_replicas_in_sync, "replicas")
except jdist.ClusterError as e:  # no TPU here
    print(type(e).__name__ + ":", str(e)[:300])
