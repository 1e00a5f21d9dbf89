"""A small MLP trained over a 2x2 data x model mesh, shared by
model_parallel_job.py (2 processes x 2 devices under `jdist launch`) and
test_model_parallel_processes.py (4 devices in one process, one device).

Megatron's split of an MLP: the first layer by columns (its kernel and bias
over "model"), the second by rows. A custom loop: `strategy.init` creates
the parameters and the momentum in their layout, `strategy.function` runs
the step, the global batches come from `experimental_distribute_dataset`.
SGD with momentum, so that a wrong gradient scale shows.

The pipeline case: four stacked tanh layers and a head, the layers run by
`jdist.pipeline` as 2 stages (GPipe, 2 microbatches) over a "stage" axis
that crosses the processes, 2 replicas inside each.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from jdist.examples.models import MLP

MODEL = MLP(hidden=16, classes=4)
OPTIMIZER = optax.sgd(0.1, momentum=0.9)
STEPS, BATCH, FEATURES = 4, 8, 8


def init_params():
  return MODEL.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))[
      "params"]


def train_step(params, opt_state, batch):
  def loss_fn(p):
    logits = MODEL.apply({"params": p}, batch["x"])
    return jdist.compute_average_loss(
        optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def batches():
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(BATCH, FEATURES)).astype(np.float32),
           "y": rng.integers(0, 4, size=BATCH).astype(np.int32)}
          for _ in range(STEPS)]


def strategy_2x2(devices=None):
  """Data 2 x model 2 (`devices` None: the layout jdist chooses)."""
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices)
  layout_map = jdist.LayoutMap(mesh)
  layout_map["Dense_0/kernel"] = (None, "model")
  layout_map["Dense_0/bias"] = ("model",)
  layout_map["Dense_1/kernel"] = ("model", None)
  return jdist.ModelParallelStrategy(layout_map=layout_map,
                                     batch_dim_name="data")


def init_pipeline_params():
  rng = np.random.default_rng(1)
  normal = lambda *shape: (rng.normal(size=shape) * 0.4).astype(np.float32)
  return {"layers": {"kernel": normal(4, FEATURES, FEATURES),
                     "bias": normal(4, FEATURES)},
          "head": normal(FEATURES, 4)}


def _layer(w, h):
  return jnp.tanh(h @ w["kernel"] + w["bias"])


def pipeline_step(params, opt_state, batch):
  def loss_fn(p):
    logits = jdist.pipeline(_layer, p["layers"], batch["x"]) @ p["head"]
    return jdist.compute_average_loss(
        optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def strategy_pipeline(devices=None):
  """Stage 2 x data 2 (`devices` None: the stage axis, first, crosses the
  processes, so only activations pass between them)."""
  mesh = jdist.DeviceMesh((2, 2), ("stage", "data"), devices)
  layout_map = jdist.LayoutMap(mesh)
  layout_map["layers/kernel"] = ("stage", None, None)
  layout_map["layers/bias"] = ("stage", None)
  return jdist.ModelParallelStrategy(
      layout_map=layout_map, batch_dim_name="data", pipeline_axis="stage",
      num_microbatches=2)


def train(strategy, pipeline=False):
  """(params, opt_state, losses) after STEPS steps (of the pipelined model
  with `pipeline`)."""
  params = strategy.init(init_pipeline_params if pipeline else init_params)
  opt_state = strategy.init(OPTIMIZER.init, params)
  step = strategy.function(pipeline_step if pipeline else train_step)
  losses = []
  for batch in strategy.experimental_distribute_dataset(batches()):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(strategy.reduce("sum", loss)))
  return params, opt_state, losses
