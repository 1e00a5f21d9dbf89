"""jdist worker: ParameterServerStrategy, TensorFlow's tutorial loop.

`--replicas N` is the number of workers (one parameter server). Each worker
reads its own per-worker dataset (the cycled synthetic global batches), and
every timed step is `coordinator.schedule(step_fn, args=(iterator,))`;
`run(steps)` schedules the block and `join()`s. The step is the seed
classifier step (optax SGD, `compute_average_loss`), the one the synchronous
strategies run. `--backend ray` puts servers and workers in Ray actors on a
local Ray cluster. Run with XLA_FLAGS=--xla_force_host_platform_device_count=N
for the threads backend (peers.Worker does this).
"""

from __future__ import annotations

import argparse
import sys
import time

import common


class Trainer:

  def __init__(self, name: str, strategy, coordinator):
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jdist.examples.models import MLP
    from jdist.examples.steps import classifier_step

    spec = common.MODELS[name]
    self.model = MLP(hidden=16, classes=common.CLASSES)
    self.x, self.y = common.data(name)
    params = {k: {n: jnp.asarray(v) for n, v in layer.items()}
              for k, layer in common.init_params(name).items()}
    tx = optax.sgd(spec["lr"])
    model = self.model
    train_step = strategy.function(classifier_step(
        lambda p, x: model.apply({"params": p}, x), tx))
    state = strategy.replicate((params, tx.init(params)))
    x, y = self.x, self.y

    def dataset_fn():
      while True:
        for i in range(common.NUM_BATCHES):
          yield {"x": x[i], "y": y[i]}

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(iterator):
      _, loss = train_step(state, next(iterator))
      return strategy.reduce("sum", loss)

    self._np = np
    self.state, self.coordinator = state, coordinator
    self.step_fn, self.iterator = step_fn, iterator

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      self.coordinator.schedule(self.step_fn, args=(self.iterator,))
    self.coordinator.join()
    return time.perf_counter() - start

  def evaluate(self) -> float:
    params = self.state.read()[0]
    logits = self.model.apply({"params": params}, self.x[0])
    return common.cross_entropy(self._np.asarray(logits), self.y[0])


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--backend", default="threads")
  own, rest = parser.parse_known_args(argv)
  args = common.parse_args(rest)
  proto = common.Protocol()
  import jax

  import jdist
  if own.backend == "ray":
    import ray
    ray.init(num_cpus=args.replicas + 2, include_dashboard=False,
             log_to_driver=False)
  strategy = jdist.ParameterServerStrategy(
      jdist.cluster_resolver.LocalClusterResolver(args.replicas, 1),
      backend=own.backend)
  coordinator = jdist.ClusterCoordinator(strategy)
  trainers = {m: Trainer(m, strategy, coordinator) for m in args.models}
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  try:
    common.serve(trainers, proto=proto, info={
        "loss0": loss0, "version": f"jdist (jax {jax.__version__})",
        "path": f"coordinator.schedule(step_fn, per-worker iterator), "
                f"{own.backend} backend"})
  finally:
    coordinator.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])
