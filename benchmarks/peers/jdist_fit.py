"""jdist Trainer worker: `jdist.Trainer(...).fit`, as the Keras worker runs fit.

The seed model (flax linen, the common initial weights), optax SGD and
`SparseCategoricalCrossentropy(from_logits=True)`, on `MirroredStrategy`.
Each timed block is one `fit` epoch over exactly the block's batches (numpy
arrays, shuffle off), as in keras_jax.py; `--steps-per-execution K` is the
Trainer's `steps_per_execution`. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=N (peers.py does this).
"""

from __future__ import annotations

import sys
import time

import common


class Trainer:

  def __init__(self, name: str, strategy, steps_per_execution: int):
    import jax.numpy as jnp
    import jax
    import optax

    import jdist
    from jdist.examples.models import CNN, MLP

    spec = common.MODELS[name]
    self.spec, self._jax = spec, jax
    model = MLP(hidden=16, classes=common.CLASSES) if name == "mlp" else CNN()
    self.model = model
    self.x, self.y = common.data(name)
    params = jax.tree.map(jnp.asarray, common.init_params(name))
    self.trainer = jdist.Trainer(
        model, optimizer=optax.sgd(spec["lr"]),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        params={"params": params}, strategy=strategy,
        steps_per_execution=steps_per_execution)
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
    logits = self.model.apply(self.trainer.export(), self.x[0])
    return common.cross_entropy(np.asarray(logits), self.y[0])


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  spe = common.pop_option(argv, "--steps-per-execution", 1)
  args = common.parse_args(argv)
  proto = common.Protocol()
  import jax

  import jdist
  devices = common.local_devices(args.replicas)
  strategy = jdist.MirroredStrategy(devices)
  trainers = {m: Trainer(m, strategy, spe) for m in args.models}
  for t in trainers.values():  # builds the state from the given params
    t.trainer.build(t.x[0])
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"jdist (jax {jax.__version__})",
      "path": f"Trainer.fit (one epoch per block), steps_per_execution={spe}"})


if __name__ == "__main__":
  main()
