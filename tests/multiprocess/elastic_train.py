"""The elastic job's training, shared by elastic_job.py (under `jdist launch`)
and test_elastic.py (the uninterrupted run it must equal).

A small MLP regressed with SGD with momentum (optax) over a fixed global
batch of 16: 4 replicas take 4 rows each, 3 replicas take 6 with 2 rows
padded and masked (`pad_to_replicas=True`). Two ways: a custom loop, whose
batch of step i depends on i only (a run resumed at step k reads the data
from step k), and `jdist.Trainer.fit` over FIT_EPOCHS shuffled epochs of the
same examples (`BackupAndRestore` restores its data position).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist

STEPS, SAVE_EVERY, BATCH = 60, 10, 16
FIT_EPOCHS = 2  # of STEPS // FIT_EPOCHS batches each
OPTIMIZER = optax.sgd(0.05, momentum=0.9)


def batch(step: int) -> dict:
  rng = np.random.default_rng(step)
  x = rng.normal(size=(BATCH, 4)).astype(np.float32)
  y = np.tanh(x @ np.array([1.0, -2.0, 3.0, 0.5], np.float32))
  return {"x": x, "y": y}


@jax.jit  # one compiled program, not one per operation (a restart's time)
def initial_state() -> dict:
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": 0.5 * jax.random.normal(k1, (4, 8)), "b1": jnp.zeros(8),
            "w2": 0.5 * jax.random.normal(k2, (8,)), "b2": jnp.zeros(())}
  return {"params": params, "opt": OPTIMIZER.init(params)}


def predict(p: dict, x):
  return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def squared_error(y_true, y_pred):
  return (y_pred - y_true) ** 2


def train_step(state: dict, b: dict):
  def loss(p):
    return jdist.compute_average_loss(squared_error(b["y"], predict(p, b["x"])))
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


def fit_data() -> tuple:
  """The examples fit trains on: those of the loop's STEPS // FIT_EPOCHS
  first batches."""
  parts = [batch(i) for i in range(STEPS // FIT_EPOCHS)]
  return (np.concatenate([p["x"] for p in parts]),
          np.concatenate([p["y"] for p in parts]))


def trainer(strategy) -> jdist.Trainer:
  return jdist.Trainer(predict, optimizer=OPTIMIZER, loss=squared_error,
                       params=initial_state()["params"], strategy=strategy,
                       pad_to_replicas=True)


def fit(strategy, callbacks=()) -> dict:
  """The parameters after `Trainer.fit` (FIT_EPOCHS epochs), on `strategy`."""
  t = trainer(strategy)
  t.fit(*fit_data(), batch_size=BATCH, epochs=FIT_EPOCHS, verbose=0,
        callbacks=list(callbacks))
  return {k: np.asarray(v.addressable_data(0)) for k, v in t.state.params.items()}
