"""The tiny GPT trained over a 2x2 data x model mesh, shared by
model_parallel_job.py (2 processes x 2 devices under `jdist launch`) and
test_model_parallel_processes.py (4 devices in one process, one device).

A custom loop: `strategy.init` creates the parameters and the momentum in
their layout, `strategy.function` runs the step, the global batches come from
`experimental_distribute_dataset`. SGD with momentum, so that a wrong
gradient scale shows.
"""

import jax
import numpy as np
import optax

import jdist
from jdist.examples.models import GPT, gpt_layout_map

MODEL = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=4,
            num_layers=1, mlp_dim=32)
OPTIMIZER = optax.sgd(0.1, momentum=0.9)
STEPS, BATCH = 3, 8


def init_params():
  return MODEL.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]


def train_step(params, opt_state, tokens):
  def loss_fn(p):
    logits = MODEL.apply({"params": p}, tokens[:, :-1])
    per_token = optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:])
    return jdist.compute_average_loss(per_token.mean(-1))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def batches():
  rng = np.random.default_rng(0)
  return [rng.integers(0, 32, size=(BATCH, 9)).astype(np.int32)
          for _ in range(STEPS)]


def strategy_2x2(devices=None):
  """Data 2 x model 2 with Megatron's layout (`devices` None: jdist's choice)."""
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices)
  return jdist.ModelParallelStrategy(layout_map=gpt_layout_map(mesh),
                                     batch_dim_name="data")


def train(strategy):
  """(params, opt_state, losses) after STEPS steps."""
  params = strategy.init(init_params)
  opt_state = strategy.init(OPTIMIZER.init, params)
  step = strategy.function(train_step)
  losses = []
  for tokens in strategy.experimental_distribute_dataset(batches()):
    params, opt_state, loss = step(params, opt_state, tokens)
    losses.append(float(strategy.reduce("sum", loss)))
  return params, opt_state, losses
