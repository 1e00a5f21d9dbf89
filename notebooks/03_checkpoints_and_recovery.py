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
# # 03 · Checkpoints and recovery
#
# Training that survives: `ModelCheckpoint` keeps the best model, `BackupAndRestore`
# lets an interrupted `fit` resume exactly where it stopped (same final parameters
# as a run that was never interrupted), and a checkpoint saved on 4 devices is
# restored onto 1 device to evaluate it. Checkpoints are orbax-checkpoint
# directories: parameters, optimizer state, step, random stream and data position.

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
import os, pathlib, tempfile
import numpy as np
import optax
import jdist
from jdist.examples.data import load_digits
from jdist.examples.models import CNN
print(jax.devices())

workdir = pathlib.Path(tempfile.mkdtemp(prefix="jdist-03-"))
x, y = load_digits(image=True)
x_train, y_train, x_test, y_test = x[:1437], y[:1437], x[1437:], y[1437:]
strategy = jdist.MirroredStrategy()

def new_trainer(strat):
    with strat.scope():
        return jdist.Trainer(CNN(dropout_rate=0.2), optimizer=optax.adam(1e-3),
                             loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
                             metrics=["accuracy"], seed=0)

# %% tags=["parameters"]
EPOCHS = 4     # each fit's epochs (23 steps each)
CRASH_AT = 57  # the step at which section 2's first run crashes (in epoch 3)

# %% [markdown]
# ## 1. `ModelCheckpoint`: keep the best epoch
#
# Saved at the end of an epoch only when validation accuracy improved. Every
# process takes part in a save; only the chief writes shared files.

# %%
best_dir = workdir / "best"
trainer = new_trainer(strategy)
history = trainer.fit(x_train, y_train, batch_size=64, epochs=EPOCHS,
                      validation_data=(x_test, y_test), verbose=0,
                      callbacks=[jdist.ModelCheckpoint(best_dir, monitor="val_accuracy",
                                                       save_best_only=True, verbose=1)])
print("val_accuracy per epoch:", np.round(history.history["val_accuracy"], 4))
print("checkpoints on disk:", sorted(p.name for p in best_dir.iterdir()))

# %% [markdown]
# ## 2. An interrupted `fit` that resumes
#
# First, the reference: `EPOCHS` (4) epochs without interruption. Then the same
# training with `BackupAndRestore` (a backup every 10 steps), killed by a
# simulated crash at step `CRASH_AT` (57, in the middle of epoch 3). A **new** trainer (as after a restart) with the same
# backup directory picks up from the last backup: the step, the optimizer state,
# the random stream and the position in the shuffled data all come back.

# %%
reference = new_trainer(strategy)
ref_history = reference.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0)

class Crash(jdist.Callback):
    """Stands in for a machine failure at a given step."""
    def __init__(self, at_step):
        super().__init__()
        self.at_step = at_step
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_step == self.at_step:
            raise RuntimeError(f"simulated crash at step {self.at_step}")

backup_dir = workdir / "backup"
first = new_trainer(strategy)
try:
    first.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0,
              callbacks=[jdist.BackupAndRestore(backup_dir, save_freq=10), Crash(at_step=CRASH_AT)])
except RuntimeError as e:
    print("first run stopped:", e, "| backups:", sorted(p.name for p in backup_dir.iterdir()))
else:
    raise AssertionError("the simulated crash should have stopped the first run")

resumed = new_trainer(strategy)
restore = jdist.BackupAndRestore(backup_dir, save_freq=10)
res_history = resumed.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0,
                          callbacks=[restore])
print("resumed from step", restore.restored_step, "and finished at step", resumed.global_step)

same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(reference.params)),
                                                jax.tree.leaves(jax.device_get(resumed.params))))
print("final parameters identical to the uninterrupted run:", same)
print("loss per epoch, uninterrupted:", np.round(ref_history.history["loss"], 6))
print("loss per epoch, resumed:      ", np.round(res_history.history["loss"], 6))
assert same, "resume was not exact"
assert restore.restored_step == CRASH_AT // 10 * 10 and resumed.global_step == reference.global_step
np.testing.assert_allclose(res_history.history["loss"], ref_history.history["loss"], rtol=1e-6)

# %%
import matplotlib.pyplot as plt
steps_per_epoch = int(np.ceil(len(x_train) / 64))
fig, ax = plt.subplots(figsize=(6, 3.5))
epochs = np.arange(1, EPOCHS + 1)
ax.plot(epochs, ref_history.history["loss"], "o-", label="uninterrupted", linewidth=2)
ax.plot(epochs, res_history.history["loss"], "x--", label="crashed and resumed", markersize=10)
ax.axvline(CRASH_AT / steps_per_epoch + 1, color="red", alpha=0.4, label=f"crash (step {CRASH_AT})")
ax.set_xlabel("epoch"); ax.set_ylabel("training loss"); ax.legend()
ax.set_title("BackupAndRestore: the resumed run is the same run")
plt.show()

# %% [markdown]
# ## 3. Restore a 4-device checkpoint onto 1 device
#
# The best checkpoint from part 1 was written by 4 replicas. A trainer on one
# device builds its state from a sample batch and loads it: orbax reshards each
# array onto the new devices. Evaluation gives the same numbers as on 4 devices
# (`evaluate` is exact on the short last batch, so device count cannot change it).

# %%
one = jdist.OneDeviceStrategy()
on_one = new_trainer(one)
on_one.build(x_test[:1])
step = on_one.load_checkpoint(best_dir)
print(f"loaded step {step} onto {one.num_replicas_in_sync} device")
print("evaluated on 1 device: ", on_one.evaluate(x_test, y_test, batch_size=64))

on_four = new_trainer(strategy)
on_four.build(x_test[:1])
on_four.load_checkpoint(best_dir)
print("evaluated on 4 devices:", on_four.evaluate(x_test, y_test, batch_size=64))
predictions = on_one.predict(x_test, batch_size=64)
print("predictions:", predictions.shape, "accuracy from predict:",
      float(np.mean(np.argmax(predictions, -1) == y_test)))
