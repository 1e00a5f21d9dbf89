"""Keras 3 worker: JAX backend, `keras.distribution.DataParallel`, `model.fit`.

`model.fit` on numpy arrays is Keras's fast path (one jitted step per batch,
state kept on device for the whole epoch and synchronised at its end);
`train_on_batch` returns the loss as a Python float, so it waits for every
step (select it with --path train_on_batch to compare). Each timed block is one
`fit` epoch over exactly the block's batches (shuffle off), so every framework
sees the same batches in the same order. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"

import common  # noqa: E402


def build(name: str):
  import keras
  from keras import layers
  spec = common.MODELS[name]
  if name == "mlp":
    model = keras.Sequential([
        keras.Input(spec["shape"]),
        layers.Dense(16, activation="relu"),
        layers.Dense(common.CLASSES)])
  else:
    model = keras.Sequential([
        keras.Input(spec["shape"]),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.Flatten(),  # row-major over (H, W, C), as flax's reshape
        layers.Dense(64, activation="relu"),
        layers.Dense(common.CLASSES)])
  params = common.init_params(name)
  weighted = [l for l in model.layers if l.weights]
  for layer, key in zip(weighted, sorted(params, key=_order)):
    layer.set_weights([params[key]["kernel"], params[key]["bias"]])
  return model


def _order(key: str):
  kind, i = key.split("_")
  return (kind != "Conv", int(i))


class Trainer:

  def __init__(self, name: str, path: str, steps_per_execution: int):
    import keras
    spec = common.MODELS[name]
    self.spec, self.path = spec, path
    self.x, self.y = common.data(name)
    self.model = build(name)
    self.model.compile(
        optimizer=keras.optimizers.SGD(spec["lr"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution)
    self.position = 0

  def run(self, steps: int) -> float:
    import jax
    idx = common.batch_indices(self.position, steps)
    self.position += steps
    if self.path == "fit":
      xs = self.x[idx].reshape((-1,) + self.x.shape[2:])
      ys = self.y[idx].reshape(-1)
      start = time.perf_counter()
      self.model.fit(xs, ys, batch_size=self.spec["batch"], epochs=1,
                     shuffle=False, verbose=0)
    else:
      start = time.perf_counter()
      for i in idx:
        self.model.train_on_batch(self.x[i], self.y[i])
    jax.block_until_ready([v.value for v in self.model.trainable_variables])
    return time.perf_counter() - start

  def evaluate(self) -> float:
    import numpy as np
    logits = self.model(self.x[0], training=False)
    return common.cross_entropy(np.asarray(logits), self.y[0])


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  path = common.pop_option(argv, "--path", "fit")
  spe = common.pop_option(argv, "--steps-per-execution", 1)
  args = common.parse_args(argv)
  proto = common.Protocol()
  import jax
  import keras
  devices = common.local_devices(args.replicas)
  keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
  trainers = {m: Trainer(m, path, spe) for m in args.models}
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  how = "model.fit (one epoch per block)" if path == "fit" else "train_on_batch"
  if spe > 1:
    how += f", steps_per_execution={spe}"
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"keras {keras.__version__} (jax {jax.__version__})",
      "path": how})


if __name__ == "__main__":
  main()
