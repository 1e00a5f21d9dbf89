"""jdist worker: MirroredStrategy, a custom loop under `strategy.function`.

The step is the per-replica function of benchmarks/overhead.py's `with_jdist`
(loss scaled by the global batch with `compute_average_loss`, optax SGD);
batches come from `experimental_distribute_dataset` over the cycled synthetic
global batches, as a user's loop would get them. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=N (peers.py does this).

With --steps-per-execution K, the loop runs `jdist.multi_step(step)` over
`DistributedDataset.group(K)`: K steps per dispatch, each block's batches
stacked K at a time (the block's last group may be shorter).
"""

from __future__ import annotations

import itertools
import sys
import time

import common


class Trainer:

  def __init__(self, name: str, strategy, steps_per_execution: int = 1):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jdist.examples.models import CNN, MLP
    from jdist.examples.steps import classifier_step

    spec = common.MODELS[name]
    self.model = MLP(hidden=16, classes=common.CLASSES) if name == "mlp" else CNN()
    self.x, self.y = common.data(name)
    params = jax.tree.map(jnp.asarray, common.init_params(name))
    ref = self.model.init(jax.random.key(0), self.x[0, :1])["params"]
    same = jax.tree.map(lambda a, b: a.shape == b.shape, ref, params)
    assert all(jax.tree.leaves(same)), "common.init_params does not fit the seed model"
    tx = optax.sgd(spec["lr"])
    model = self.model

    step = strategy.function(classifier_step(
        lambda p, x: model.apply({"params": p}, x), tx))

    self._jax, self._np = jax, np
    self.step = step
    self.state = strategy.replicate((params, tx.init(params)))
    batches = [{"x": self.x[i], "y": self.y[i]} for i in range(common.NUM_BATCHES)]
    self.batches = iter(strategy.experimental_distribute_dataset(
        itertools.cycle(batches)))
    self.k = steps_per_execution
    if self.k > 1:
      import jdist
      self.multi = jdist.multi_step(step)
      self.strategy, self.host_batches = strategy, batches
      self.position = 0

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    state = self.state
    if self.k > 1:
      block = [self.host_batches[i]
               for i in common.batch_indices(self.position, steps)]
      self.position += steps
      for group in self.strategy.experimental_distribute_dataset(block).group(
          self.k):
        state, _ = self.multi(state, group)
    else:
      for _ in range(steps):
        state, _ = self.step(state, next(self.batches))
    self._jax.block_until_ready(state)
    self.state = state
    return time.perf_counter() - start

  def evaluate(self) -> float:
    logits = self.model.apply({"params": self.state[0]}, self.x[0])
    return common.cross_entropy(self._np.asarray(logits), self.y[0])


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
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"jdist (jax {jax.__version__})",
      "path": "custom loop: strategy.function + experimental_distribute_dataset"
              + (f", multi_step over groups of {spe}" if spe > 1 else "")})


if __name__ == "__main__":
  main()
