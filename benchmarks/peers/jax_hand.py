"""Reference worker: the same step hand-written in JAX, without jdist.

What a JAX expert writes: `jax.jit(jax.shard_map(...))` over a one-axis mesh,
mirrored parameters, the loss scaled by the global batch (autodiff sums the
gradients), optax SGD, and each host batch placed with one `jax.device_put`
to `NamedSharding(mesh, P("r"))`. On a CPU mesh of several devices it waits
for step k-1 after dispatching step k, as jdist does.
The gap between this row and jdist's is jdist's own cost.
"""

from __future__ import annotations

import time

import common


class Trainer:

  def __init__(self, name: str, devices):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    from jdist.examples.models import CNN, MLP

    spec = common.MODELS[name]
    model = MLP(hidden=16, classes=common.CLASSES) if name == "mlp" else CNN()
    self.model, self._jax, self._np = model, jax, np
    self.x, self.y = common.data(name)
    batch = spec["batch"]
    tx = optax.sgd(spec["lr"])
    mesh = Mesh(np.array(devices), ("r",), axis_types=(AxisType.Auto,))

    def body(params, opt, x, y):
      def loss_fn(p):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum() / batch
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt = tx.update(grads, opt)
      return optax.apply_updates(params, updates), opt, loss[None]

    self.step = jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P("r"), P("r")),
        out_specs=(P(), P(), P("r"))))
    rep = NamedSharding(mesh, P())
    self.shard = NamedSharding(mesh, P("r"))
    params = jax.tree.map(jnp.asarray, common.init_params(name))
    self.params = jax.device_put(params, rep)
    self.opt = jax.device_put(tx.init(params), rep)
    self.throttle = devices[0].platform == "cpu" and len(devices) > 1
    self.position = 0

  def run(self, steps: int) -> float:
    jax = self._jax
    start = time.perf_counter()
    params, opt, prev = self.params, self.opt, None
    for i in common.batch_indices(self.position, steps):
      x, y = jax.device_put((self.x[i], self.y[i]), self.shard)
      params, opt, loss = self.step(params, opt, x, y)
      if self.throttle:
        if prev is not None:
          prev.block_until_ready()
        prev = loss
    jax.block_until_ready(params)
    self.params, self.opt = params, opt
    self.position += steps
    return time.perf_counter() - start

  def evaluate(self) -> float:
    logits = self.model.apply({"params": self.params}, self.x[0])
    return common.cross_entropy(self._np.asarray(logits), self.y[0])


def main(argv=None):
  args = common.parse_args(argv)
  proto = common.Protocol()
  import jax
  devices = common.local_devices(args.replicas)
  trainers = {m: Trainer(m, devices) for m in args.models}
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"jax {jax.__version__}",
      "path": "jit(shard_map) + device_put per batch"})


if __name__ == "__main__":
  main()
