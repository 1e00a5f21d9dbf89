"""The elastic job's training, shared by elastic_job.py (under `jdist launch`)
and test_elastic.py (the uninterrupted run it must equal).

A small MLP regressed with SGD with momentum (optax) over a fixed global
batch of 16: 4 replicas take 4 rows each, 3 replicas take 6 with 2 rows
padded and masked (`InputOptions(pad_to_replicas=True)`). The batch of step
i depends on i only, so a run resumed at step k reads the data from step k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist

STEPS, SAVE_EVERY, BATCH = 60, 10, 16
OPTIMIZER = optax.sgd(0.05, momentum=0.9)


def batch(step: int) -> dict:
  rng = np.random.default_rng(step)
  x = rng.normal(size=(BATCH, 4)).astype(np.float32)
  y = np.tanh(x @ np.array([1.0, -2.0, 3.0, 0.5], np.float32))
  return {"x": x, "y": y}


def initial_state() -> dict:
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": 0.5 * jax.random.normal(k1, (4, 8)), "b1": jnp.zeros(8),
            "w2": 0.5 * jax.random.normal(k2, (8,)), "b2": jnp.zeros(())}
  return {"params": params, "opt": OPTIMIZER.init(params)}


def train_step(state: dict, b: dict):
  def loss(p):
    pred = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jdist.compute_average_loss((pred - b["y"]) ** 2)
  value, grads = jax.value_and_grad(loss)(state["params"])
  updates, opt = OPTIMIZER.update(grads, state["opt"])
  return {"params": optax.apply_updates(state["params"], updates),
          "opt": opt}, value


def batches(strategy, first: int):
  """The global batches of steps first..STEPS-1, distributed."""
  return strategy.experimental_distribute_dataset(
      [batch(i) for i in range(first, STEPS)],
      jdist.InputOptions(pad_to_replicas=True))


def host_params(state: dict) -> dict:
  """This process's copy of the (replicated) parameters, as numpy."""
  return {k: np.asarray(v.addressable_data(0))
          for k, v in state["params"].items()}


def uninterrupted(strategy) -> dict:
  """The parameters after STEPS steps without a fault, on `strategy`."""
  state = strategy.replicate(initial_state())
  step = strategy.function(train_step)
  for b in batches(strategy, 0):
    state, _ = step(state, b)
    jax.block_until_ready(state)  # CPU collectives: one step in flight
  return host_params(state)
