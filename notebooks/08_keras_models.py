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
# # 08 · Your Keras model, unchanged
#
# A Keras 3 model on the JAX backend trains in jdist as it is. This notebook
# brings one (a Sequential classifier with Dropout, Keras's Adam, loss and
# metric) and
#
# 1. trains it with `jdist.Trainer` on every device and on one: the same weights,
#    Dropout included,
# 2. runs TensorFlow's literal program, Keras's own `fit` under a jdist strategy's
#    scope, on the strategy's devices,
# 3. saves the trained Keras model and loads it back, as Keras does.
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
os.environ["KERAS_BACKEND"] = "jax"  # before keras is first imported (Colab ships Keras 3)
import keras
import numpy as np
import jdist
from jdist.examples.data import load_digits
devices = jax.devices()[:4]
x, y = load_digits(image=False)
# 256 test examples: Keras's own evaluate under DataParallel needs every batch,
# the last one too, to split evenly over the devices (jdist.Trainer pads it).
x_train, y_train, x_test, y_test = x[:1536], y[:1536], x[1536:1792], y[1536:1792]
print(devices, keras.__version__, keras.backend.backend())

# %% [markdown]
# ## The model, as a Keras user writes it

# %%
def make_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.3, seed=1),
        keras.layers.Dense(10),
    ])

initial = make_model().get_weights()  # both runs start from these

# %% [markdown]
# ## 1. `jdist.Trainer`, on every device and on one
#
# The Keras model goes in as it is, with Keras's optimizer, loss and metric. Its
# variables become pytrees keyed by their Keras paths; Keras's Adam runs through
# its `stateless_apply`; each replica draws its rows of the batch's Dropout mask.
# Two runs, 4 devices and 1, end with the same weights (to float32 rounding), and
# `fit` leaves them in the Keras model.

# %%
def train(strategy):
    model = make_model()
    model.set_weights(initial)
    trainer = jdist.Trainer(
        model, optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], strategy=strategy)
    history = trainer.fit(x_train, y_train, batch_size=128, epochs=3, shuffle=False,
                          verbose=0)
    return model, trainer, history.history

model4, trainer4, history4 = train(jdist.MirroredStrategy(devices))
model1, _, history1 = train(jdist.OneDeviceStrategy(devices[0]))
gap = max(float(np.max(np.abs(a - b))) for a, b in zip(model4.get_weights(),
                                                       model1.get_weights()))
print("accuracy per epoch, 4 devices:", np.round(history4["accuracy"], 4))
print("accuracy per epoch, 1 device: ", np.round(history1["accuracy"], 4))
print(f"largest weight difference: {gap:.1e}")
print("params:", jax.tree.map(lambda a: a.shape, trainer4.params))
assert gap < 1e-4
print("test accuracy:", round(trainer4.evaluate(x_test, y_test)["accuracy"], 4))

# %% [markdown]
# ## 2. Keras's own `fit` under a strategy's scope
#
# TensorFlow's program, unchanged but for the strategy line: the model is made and
# compiled in the scope, `fit` is called after it. The scope set Keras's
# distribution (`DataParallel` over the strategy's devices), and the model keeps it.

# %%
strategy = jdist.MirroredStrategy(devices)
with strategy.scope():
    model = make_model()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x_train, y_train, batch_size=128, epochs=3, shuffle=False, verbose=0)
print(keras.distribution.distribution())
print("kernel on", sorted(d.id for d in model.layers[0].kernel.value.sharding.device_set))
print("test accuracy:", round(model.evaluate(x_test, y_test, verbose=0)[1], 4))
keras.distribution.set_distribution(None)  # back to no distribution

# %% [markdown]
# ## 3. Save the model jdist trained, load it back
#
# The Trainer wrote its trained values into the Keras model, so Keras's own saving
# and loading work as usual.

# %%
path = os.path.join(tempfile.mkdtemp(), "digits.keras")
model4.save(path)
reloaded = keras.models.load_model(path)
same = np.allclose(reloaded.predict(x_test, verbose=0), trainer4.predict(x_test), atol=1e-5)
print("reloaded model predicts as the trainer:", same)
assert same
