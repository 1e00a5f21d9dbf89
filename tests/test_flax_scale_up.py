"""flax's "Scale up on multiple devices" guide (nnx), ported as its users
wrote it: a data x model mesh from `jax.make_mesh`, the model created under
`with jax.set_mesh(mesh):` (its variables sharded as they are made, through
`nnx.with_partitioning` and `sharding=` metadata), an activation constraint
naming both axes (`P('data', 'model')`), `nnx.vmap`-stacked layers run by
`jax.lax.scan`, and the guide's `jax.jit` train step.

`original` is the guide's program (SGD instead of Adam, smaller sizes,
generated data); `ported` changes only the strategy lines: the strategy on
the guide's mesh, `strategy.function` for `jax.jit`, the loss divided by the
global batch, the batches distributed. Thirty steps of it on a 2 x 2 mesh
(the guide's Auto axes, and `jax.make_mesh`'s default Explicit ones) equal
the guide's program on one device to 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jdist

DEPTH, LAYERS, STEPS, BATCH, LR = 16, 2, 30, 8, 0.05

# The guide as written uses two spellings flax 0.12 deprecates.
pytestmark = [
    pytest.mark.filterwarnings("ignore:'sharding' is deprecated"),
    pytest.mark.filterwarnings("ignore:The 'split' argument of 'fork'")]


# --- the guide's model, as written --------------------------------------------


class DotReluDot(nnx.Module):
  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(
        depth, depth,
        kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
        use_bias=False,  # or use `bias_init` to give it annotation too
        rngs=rngs)
    self.w2 = nnx.Param(
        init_fn(rngs.params(), (depth, depth)),  # RNG key and shape for W2
        sharding=("model", None),
    )

  def __call__(self, x: jax.Array):
    y = self.dot1(x)
    y = jax.nn.relu(y)
    y = jax.lax.with_sharding_constraint(y, P("data", "model"))
    z = jnp.dot(y, self.w2[...])
    return z


class MultiDotReluDot(nnx.Module):
  def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
    # Annotate the additional axis with sharding=None, meaning it will be
    # replicated across all devices.
    @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
    def create_sublayers(r):
      return DotReluDot(depth, r)
    self.layers = create_sublayers(rngs.fork(split=num_layers))

  def __call__(self, x):
    def scan_over_layers(x, layer):
      return layer(x), None
    x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
    return x


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(STEPS * BATCH, DEPTH)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(DEPTH, DEPTH)).astype(np.float32) / 4)
  return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def _mesh(devices, axis_types):
  # The guide's "auto-mode mesh": `jax.make_mesh` makes Explicit axes by
  # default on this JAX, on which the guide's own model does not run.
  return jax.make_mesh((2, 2), ("data", "model"), axis_types=axis_types,
                       devices=devices)


# --- the guide's program, and its port ----------------------------------------


def original(mesh, batches):
  @jax.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model: DotReluDot):
      y_pred = model(x)
      return jnp.mean((y_pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, loss

  with jax.set_mesh(mesh):
    model = MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    losses = []
    for x, y in batches:
      model, loss = train_step(model, optimizer, x, y)
      losses.append(float(loss))
  return model, losses


def ported(mesh, batches):
  strategy = jdist.ModelParallelStrategy(device_mesh=mesh)  # strategy line

  @strategy.function  # strategy line: was @jax.jit
  def train_step(model, optimizer, batch):
    x, y = batch  # strategy line: one distributed batch

    def loss_fn(model: DotReluDot):
      y_pred = model(x)
      return jdist.compute_average_loss(  # strategy line: the global mean
          jnp.mean((y_pred - y) ** 2, axis=-1))

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, loss

  with jax.set_mesh(mesh):
    model = MultiDotReluDot(DEPTH, LAYERS, rngs=nnx.Rngs(0))
    assert model.layers.dot1.kernel.sharding.spec == P(None, None, "model")
    optimizer = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
      model, loss = train_step(model, optimizer, batch)
      losses.append(float(strategy.reduce("sum", loss)))  # strategy line
  assert train_step.num_compilations <= 2  # Explicit-typed inputs: once more
  return model, losses


def test_the_guide_ported_on_2x2_equals_the_guide_on_one_device(devices):
  batches = _data()
  auto = (AxisType.Auto,) * 2
  one = jax.make_mesh((1, 1), ("data", "model"), axis_types=auto,
                      devices=devices[:1])
  expected, expected_losses = original(one, batches)
  want = jax.tree.leaves(nnx.state(expected, nnx.Param))
  for axis_types in (auto, (AxisType.Explicit,) * 2):
    model, losses = ported(_mesh(devices[:4], axis_types), batches)
    assert model.layers.dot1.kernel.sharding.spec == P(None, None, "model")
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(want, jax.tree.leaves(nnx.state(model, nnx.Param))):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  assert expected_losses[-1] < expected_losses[0]  # it learns
