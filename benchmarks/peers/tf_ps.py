"""TensorFlow worker: `tf.distribute.ParameterServerStrategy`, in-process cluster.

TensorFlow's "Parameter server training with ParameterServerStrategy"
tutorial: `--replicas N` workers and one parameter server started as
`tf.distribute.Server`s in this process (gRPC on 127.0.0.1), variables
created under `strategy.scope()`, a `ClusterCoordinator`, a per-worker
`tf.data` dataset of the cycled synthetic global batches, and a
`tf.function` step that calls `strategy.run` and is scheduled once per
step; `run(steps)` schedules the block and `join()`s. The model is the seed
MLP as plain variables with SGD (`assign_sub`), so that nothing but the
strategy differs from jdist's worker.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import common  # noqa: E402


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def in_process_cluster(tf, num_workers: int, num_ps: int):
  """The tutorial's `create_in_process_cluster`."""
  spec = tf.train.ClusterSpec({
      "worker": [f"localhost:{_port()}" for _ in range(num_workers)],
      "ps": [f"localhost:{_port()}" for _ in range(num_ps)]})
  config = tf.compat.v1.ConfigProto()
  if multiprocessing.cpu_count() < num_workers + 1:
    config.inter_op_parallelism_threads = num_workers + 1
  for i in range(num_workers):
    tf.distribute.Server(spec, job_name="worker", task_index=i, config=config,
                         protocol="grpc")
  for i in range(num_ps):
    tf.distribute.Server(spec, job_name="ps", task_index=i, protocol="grpc")
  return tf.distribute.cluster_resolver.SimpleClusterResolver(
      spec, rpc_layer="grpc")


class Trainer:

  def __init__(self, name: str, strategy, coordinator, tf):
    spec = common.MODELS[name]
    self.x, self.y = common.data(name)
    init = common.init_params(name)
    batch, lr = spec["batch"], spec["lr"]
    with strategy.scope():
      self.vars = [tf.Variable(init[layer][p]) for layer in ("Dense_0", "Dense_1")
                   for p in ("kernel", "bias")]
    k0, b0, k1, b1 = self.vars
    variables = self.vars
    self._tf = tf

    def dataset_fn():
      flat_x = self.x.reshape((-1,) + self.x.shape[2:])
      return (tf.data.Dataset.from_tensor_slices((flat_x, self.y.reshape(-1)))
              .batch(batch).repeat().prefetch(tf.data.AUTOTUNE))

    @tf.function
    def step_fn(iterator):
      def replica_fn(x, y):
        with tf.GradientTape() as tape:
          logits = tf.nn.relu(x @ k0 + b0) @ k1 + b1
          per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
          loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        for v, g in zip(variables, tape.gradient(loss, variables)):
          v.assign_sub(lr * g)
        return loss
      x, y = next(iterator)
      return strategy.reduce(tf.distribute.ReduceOp.SUM,
                             strategy.run(replica_fn, args=(x, y)), axis=None)

    self.coordinator = coordinator
    self.step_fn = step_fn
    self.iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      self.coordinator.schedule(self.step_fn, args=(self.iterator,))
    self.coordinator.join()
    return time.perf_counter() - start

  def evaluate(self) -> float:
    import numpy as np
    k0, b0, k1, b1 = (v.numpy() for v in self.vars)
    logits = np.maximum(self.x[0] @ k0 + b0, 0) @ k1 + b1
    return common.cross_entropy(logits, self.y[0])


def main(argv=None):
  args = common.parse_args(argv)
  proto = common.Protocol()
  import tensorflow as tf
  strategy = tf.distribute.ParameterServerStrategy(
      in_process_cluster(tf, args.replicas, 1))
  coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
  trainers = {m: Trainer(m, strategy, coordinator, tf) for m in args.models}
  loss0 = {m: t.evaluate() for m, t in trainers.items()}
  common.warm_all(trainers, args.warmup)
  common.serve(trainers, proto=proto, info={
      "loss0": loss0, "version": f"tensorflow {tf.__version__}",
      "path": "coordinator.schedule(tf.function step, per-worker tf.data), "
              "in-process tf.distribute.Servers"})


if __name__ == "__main__":
  main()
