"""`make demo`: the seed tutorial's CNN on digits, MirroredStrategy vs one device.

Trains on every local device (4 fake CPU devices when there is no
accelerator), prints per-epoch loss and accuracy, then trains the same model on
one device and compares the two runs.

Run: python -m jdist.examples.demo [--epochs 5] [--devices 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _setup_devices(n: int) -> None:
  """Asks for n CPU devices; they are used only when there is no accelerator."""
  import jax
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass  # JAX already started (e.g. in a notebook): keep its devices


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--devices", type=int, default=4,
                      help="fake CPU devices when no accelerator is present")
  parser.add_argument("--batch-size", type=int, default=64)
  args = parser.parse_args(argv)
  _setup_devices(args.devices)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax.training import train_state

  import jdist
  from jdist.examples.data import batches, load_digits
  from jdist.examples.models import CNN

  x, y = load_digits(image=True)
  split = 1437  # scikit-learn's digits: 1,797 images; 80% for training
  x_train, y_train, x_test, y_test = x[:split], y[:split], x[split:], y[split:]

  class State(train_state.TrainState):
    batch_stats: dict
    key: jax.Array

  def train_step(state, batch):
    dropout_key = jax.random.fold_in(state.key, state.step)
    def loss_fn(params):
      logits, updates = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats}, batch["x"],
          train=True, mutable=["batch_stats"], rngs={"dropout": dropout_key})
      per_example = optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["y"])
      return jdist.compute_average_loss(per_example), (logits, updates)
    (loss, (logits, updates)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads,
                                  batch_stats=updates["batch_stats"])
    correct = jnp.argmax(logits, -1) == batch["y"]
    return state, {"loss": loss, "correct": correct}

  def eval_step(state, batch):
    logits = state.apply_fn({"params": state.params,
                             "batch_stats": state.batch_stats}, batch["x"])
    return jnp.argmax(logits, -1) == batch["y"]

  def train(strategy, label):
    model = CNN(batch_norm=True, bn_axis_name=strategy.axis_name,
                dropout_rate=0.3)
    variables = model.init(jax.random.key(0), x_train[:1])
    state = State.create(apply_fn=model.apply, params=variables["params"],
                         tx=optax.adam(1e-3),
                         batch_stats=variables["batch_stats"],
                         key=jax.random.key(1))
    state = strategy.replicate(state)
    step = strategy.function(train_step)
    evaluate = strategy.function(eval_step)
    print(f"\n{label}: {strategy.num_replicas_in_sync} replica(s) on "
          f"{', '.join(f'{d.platform}:{d.id}' for d in strategy.devices)}")
    history = []
    for epoch in range(args.epochs):
      start = time.perf_counter()
      data = batches(x_train, y_train, args.batch_size, shuffle_seed=epoch)
      loss_sum = correct = 0.0
      for batch in strategy.experimental_distribute_dataset(data):
        state, out = step(state, batch)
        n_valid = int(batch.num_valid)
        loss_sum += float(strategy.reduce("sum", out["loss"])) * n_valid
        correct += float(strategy.reduce("sum", out["correct"], axis=0))
      seconds = time.perf_counter() - start
      test = strategy.experimental_distribute_dataset(
          batches(x_test, y_test, args.batch_size))
      test_correct = sum(float(strategy.reduce("sum", evaluate(state, b),
                                               axis=0)) for b in test)
      row = {"loss": loss_sum / split, "accuracy": correct / split,
             "test_accuracy": test_correct / len(x_test), "seconds": seconds}
      history.append(row)
      print(f"  epoch {epoch + 1}/{args.epochs}  loss {row['loss']:.4f}  "
            f"accuracy {row['accuracy']:.4f}  test accuracy "
            f"{row['test_accuracy']:.4f}  ({seconds:.2f} s)")
    return history, jax.device_get(state.params)

  mirrored = jdist.MirroredStrategy()
  h_multi, p_multi = train(mirrored, "MirroredStrategy")
  h_one, p_one = train(jdist.OneDeviceStrategy(), "OneDeviceStrategy")

  print("\nSame training, same seed: per-epoch loss on "
        f"{mirrored.num_replicas_in_sync} replicas vs 1 device")
  print(f"  {'epoch':>5}  {'mirrored':>10}  {'one device':>10}  {'|diff|':>9}")
  for i, (a, b) in enumerate(zip(h_multi, h_one)):
    print(f"  {i + 1:>5}  {a['loss']:>10.6f}  {b['loss']:>10.6f}  "
          f"{abs(a['loss'] - b['loss']):>9.2e}")
  diff = max(float(np.max(np.abs(a - b))) for a, b in
             zip(jax.tree.leaves(p_multi), jax.tree.leaves(p_one)))
  t_multi = sum(h["seconds"] for h in h_multi[1:]) / max(1, args.epochs - 1)
  t_one = sum(h["seconds"] for h in h_one[1:]) / max(1, args.epochs - 1)
  print(f"  largest parameter difference after training: {diff:.2e}")
  print(f"  seconds per epoch after the first (compilation): mirrored "
        f"{t_multi:.2f}, one device {t_one:.2f}")
  if mirrored.devices[0].platform == "cpu":
    print("  (fake CPU devices share this machine's cores, so more replicas "
          "are not faster here; on GPUs or TPUs each replica has its own chip)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
