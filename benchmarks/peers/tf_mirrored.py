"""TensorFlow worker: `tf.distribute.MirroredStrategy` over N logical CPU devices.

The custom loop of TensorFlow's "Custom training with tf.distribute.Strategy"
tutorial: Keras layers and SGD created under `strategy.scope()`, a
`tf.function` step that calls `strategy.run` (loss scaled by the global batch
with `tf.nn.compute_average_loss`, gradients summed by `apply_gradients`), one
Python call per step, batches from `strategy.experimental_distribute_dataset`
over a `tf.data` pipeline of the cycled synthetic global batches.
"""

from __future__ import annotations

import os
import time

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import common  # noqa: E402


class Trainer:

  def __init__(self, name: str, strategy):
    import keras
    import tensorflow as tf
    from keras_jax import build  # the same Keras model, here on TensorFlow

    spec = common.MODELS[name]
    self.x, self.y = common.data(name)
    batch = spec["batch"]
    with strategy.scope():
      model = build(name)
      optimizer = keras.optimizers.SGD(spec["lr"])
      optimizer.build(model.trainable_variables)
    self.model = model

    def step_fn(x, y):
      with tf.GradientTape() as tape:
        logits = model(x, training=True)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    @tf.function
    def train_step(dist_batch):
      per_replica = strategy.run(step_fn, args=dist_batch)
      return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    flat_x = self.x.reshape((-1,) + self.x.shape[2:])
    dataset = (tf.data.Dataset.from_tensor_slices((flat_x, self.y.reshape(-1)))
               .batch(batch).repeat().prefetch(tf.data.AUTOTUNE))
    self.batches = iter(strategy.experimental_distribute_dataset(dataset))
    self.train_step = train_step

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    loss = None
    for _ in range(steps):
      loss = self.train_step(next(self.batches))
    loss.numpy()  # wait for the last step
    [v.numpy() for v in self.model.trainable_variables[-1:]]
    return time.perf_counter() - start

  def evaluate(self) -> float:
    logits = self.model(self.x[0], training=False)
    return common.cross_entropy(logits.numpy(), self.y[0])


def main(argv=None):
  args = common.parse_args(argv)
  proto = common.Protocol()
  import tensorflow as tf
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
  devices = [d.name for d in tf.config.list_logical_devices("CPU")][:args.replicas]
  strategy = tf.distribute.MirroredStrategy(devices)
  trainers = {m: Trainer(m, strategy) for m in args.models}
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"tensorflow {tf.__version__}",
      "path": "custom loop: tf.function(strategy.run) per step, distributed tf.data",
      "cross_device_ops": type(strategy.extended._cross_device_ops).__name__})


if __name__ == "__main__":
  main()
