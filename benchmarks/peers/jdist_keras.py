"""jdist Trainer worker with a Keras model: `jdist.Trainer(keras_model).fit`.

The Keras worker's own model (keras_jax.py's `build`: the same layers and
the common initial weights), Keras's SGD and loss objects, trained by
`jdist.Trainer` on `MirroredStrategy`; each timed block is one `fit` epoch
over exactly the block's batches, as keras_jax.py and jdist_fit.py time
theirs. Needs keras in jdist's environment (`jdist[keras]`). Run with
XLA_FLAGS=--xla_force_host_platform_device_count=N (peers.py does this).
"""

from __future__ import annotations

import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"

import common  # noqa: E402
import keras_jax  # noqa: E402  (the Keras worker's model, built alike)


class Trainer:

  def __init__(self, name: str, strategy, steps_per_execution: int):
    import jax
    import keras

    import jdist

    spec = common.MODELS[name]
    self.spec, self._jax = spec, jax
    self.x, self.y = common.data(name)
    self.model = keras_jax.build(name)
    self.trainer = jdist.Trainer(
        self.model, optimizer=keras.optimizers.SGD(spec["lr"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy, steps_per_execution=steps_per_execution)
    self.position = 0

  def run(self, steps: int) -> float:
    idx = common.batch_indices(self.position, steps)
    self.position += steps
    xs = self.x[idx].reshape((-1,) + self.x.shape[2:])
    ys = self.y[idx].reshape(-1)
    start = time.perf_counter()
    self.trainer.fit(xs, ys, batch_size=self.spec["batch"], epochs=1,
                     shuffle=False, verbose=0)
    self._jax.block_until_ready(self.trainer.state)
    return time.perf_counter() - start

  def evaluate(self) -> float:
    import numpy as np
    logits = self.trainer.predict(self.x[0], batch_size=self.spec["batch"])
    return common.cross_entropy(np.asarray(logits), self.y[0])


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  spe = common.pop_option(argv, "--steps-per-execution", 1)
  args = common.parse_args(argv)
  proto = common.Protocol()
  import jax
  import keras

  import jdist
  devices = common.local_devices(args.replicas)
  strategy = jdist.MirroredStrategy(devices)
  trainers = {m: Trainer(m, strategy, spe) for m in args.models}
  for t in trainers.values():  # builds the state from the model's weights
    t.trainer.build(t.x[0])
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0,
      "version": f"jdist (keras {keras.__version__}, jax {jax.__version__})",
      "path": f"Trainer.fit of a Keras model (one epoch per block), "
              f"steps_per_execution={spe}"})


if __name__ == "__main__":
  main()
