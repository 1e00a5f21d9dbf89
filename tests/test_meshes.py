"""JAX's own meshes and activation constraints: strategies built on a
`jax.sharding.Mesh` (Auto or Explicit axes), steps inside a user's
`with jax.set_mesh(mesh):`, models that constrain their activations
(`with_sharding_constraint`, flax's logical constraints) in a custom loop
and in fit, equal to one device; and the silent corners of
ModelParallelStrategy (replicate, nothing split, random draws alike on
every replica, an optimizer without state)."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jdist

_RULES = (("batch", "data"), ("hidden", "model"))


def _mesh22(devices, explicit=True):
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * 2
  return jax.make_mesh((2, 2), ("data", "model"), axis_types=types,
                       devices=devices[:4])


# --- strategies on JAX's meshes ----------------------------------------------


def test_every_strategy_is_built_on_a_jax_mesh_auto_or_explicit(devices):
  for explicit in (True, False):
    mesh = _mesh22(devices, explicit)
    strategy = jdist.ModelParallelStrategy(device_mesh=mesh)
    assert strategy.device_mesh == jdist.DeviceMesh(
        (2, 2), ("data", "model"), list(mesh.devices.flat))
    assert list(strategy.mesh.devices.flat) == list(mesh.devices.flat)
    layout_map = jdist.LayoutMap(mesh)
    layout_map["w"] = (None, "model")
    assert jdist.ModelParallelStrategy(layout_map=layout_map).device_mesh == \
        jdist.DeviceMesh.from_jax(mesh)
  line = jax.make_mesh((4,), ("data",), devices=devices[:4][::-1])
  for make in (jdist.MirroredStrategy, jdist.CentralStorageStrategy,
               jdist.MultiWorkerMirroredStrategy):
    strategy = make(mesh=line)
    assert strategy.axis_name == "data"
    assert strategy.devices == tuple(line.devices.flat)  # the mesh's order
  one = jax.make_mesh((1,), ("x",), devices=devices[2:3])
  assert jdist.OneDeviceStrategy(mesh=one).devices == (devices[2],)
  with pytest.raises(ValueError, match=r"one replica per device over one "
                     r"mesh axis.*\('data', 'model'\).*ModelParallelStrategy"):
    jdist.MirroredStrategy(mesh=_mesh22(devices))
  with pytest.raises(ValueError, match="axis_name='replica'.*'data'"):
    jdist.MirroredStrategy(mesh=line, axis_name="replica")
  with pytest.raises(ValueError, match="both devices and mesh"):
    jdist.MirroredStrategy(devices[:2], mesh=line)
  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    jdist.DeviceMesh.from_jax(line.abstract_mesh)


def _linear_step(w, batch):
  def loss_fn(w):
    return jdist.compute_average_loss((batch @ w) ** 2)
  loss, grad = jax.value_and_grad(loss_fn)(w)
  return w - 0.1 * grad, loss, batch @ w


def test_steps_run_inside_jax_set_mesh_of_their_mesh_and_refuse_another(
    devices):
  mesh = jax.make_mesh((2,), ("data",), devices=devices[:2])  # Explicit
  strategy = jdist.MirroredStrategy(mesh=mesh)
  step = strategy.function(_linear_step)
  data = [np.arange(12, dtype=np.float32).reshape(4, 3) / 10]

  def run():
    w = strategy.init(jnp.ones, 3)
    for batch in strategy.experimental_distribute_dataset(data):
      w, loss, outputs = step(w, batch)
    return (np.asarray(w), float(strategy.reduce("sum", loss)),
            np.asarray(strategy.gather(outputs)))

  outside = run()
  with jax.set_mesh(mesh):  # the strategy's own mesh: used
    inside = run()
  for a, b in zip(outside, inside):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  other = jax.make_mesh((2, 2), ("a", "b"), devices=devices[:4])
  for call in (run, lambda: strategy.init(jnp.ones, 3)):
    with jax.set_mesh(other), pytest.raises(
        jdist.StrategyMismatchError,
        match=r"Mesh\('data': 2, axis_types=\(Auto,\)\) on cpu:0, cpu:1, "
        r"but the mesh in context \(jax.set_mesh\) is Mesh\('a': 2, 'b': 2, "
        r"axis_types=\(Explicit, Explicit\)\)"):
      call()


# --- activation constraints ----------------------------------------------------


class Constrained(nn.Module):
  """An MLP that constrains its activations the three ways models do: a
  bare PartitionSpec naming the batch axis (flax's guide), a NamedSharding
  on the mesh, and flax's logical names."""

  mesh: Mesh

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16, kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), (None, "model")))(x))
    h = jax.lax.with_sharding_constraint(h, P("data", "model"))
    h = jax.lax.with_sharding_constraint(
        h, NamedSharding(self.mesh, P(None, "model")))
    h = nn.with_logical_constraint(h, ("batch", "hidden"))
    return nn.Dense(4, kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), ("model", None)))(h)


def _digits(n=64):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  return x, x[:, :4].argmax(-1).astype(np.int32)


def _constrained_loop(strategy, model, steps=3):
  params = strategy.init(model.init, jax.random.key(0), jnp.zeros((1, 8)))
  tx = optax.sgd(0.1)
  opt_state = strategy.init(tx.init, params)

  @strategy.function
  def step(params, opt_state, batch):
    x, y = batch
    def loss_fn(p):
      logits = model.apply(p, x)
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(logits, y))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  x, y = _digits()
  batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 16 * steps, 16)]
  for batch in strategy.experimental_distribute_dataset(batches):
    params, opt_state, loss = step(params, opt_state, batch)
  text = step.lower(params, opt_state, batch).as_text()
  return nn.meta.unbox(params), text


def test_activation_constraints_in_a_step_and_in_fit_equal_one_device(devices):
  mesh = _mesh22(devices)
  strategy = jdist.ModelParallelStrategy(device_mesh=mesh,
                                         logical_axis_rules=_RULES)
  model = Constrained(mesh)
  one = jdist.OneDeviceStrategy(devices[0])
  expected, _ = _constrained_loop(one, model)
  got, text = _constrained_loop(strategy, model)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Inside the step a replica's activations (8 rows) are held split over
  # "model": the constraints kept their within-replica axes.
  assert len(re.findall(r'<@mesh, \[\{\}, \{"model"\}\]> : tensor<8x16xf32>',
                        text)) >= 3
  # fit: init and its shape checks trace the model under the mesh.
  x, y = _digits()
  fits = []
  for s in (one, strategy):
    trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), strategy=s,
                            loss=jdist.losses.SparseCategoricalCrossentropy(
                                from_logits=True))
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    fits.append((history.history["loss"], nn.meta.unbox(trainer.params)))
  np.testing.assert_allclose(fits[0][0], fits[1][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fits[0][1]), jax.tree.leaves(fits[1][1])):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_constraint_on_another_mesh_or_axis_is_a_clear_error(devices):
  layout_map = jdist.LayoutMap(_mesh22(devices))
  layout_map["w"] = (None, "model")
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map)
  w = strategy.replicate({"w": jnp.ones((3, 4))})["w"]
  batch = next(iter(strategy.experimental_distribute_dataset(
      [np.ones((4, 3), np.float32)])))
  other = jax.make_mesh((4,), ("model",), devices=devices[:4])
  for constraint, match in (
      (NamedSharding(other, P(None, "model")),
       r"NamedSharding on Mesh\('model': 4.*strategy's mesh is "
       r"Mesh\('data': 2, 'model': 2"),
      (P(None, "tensor"), r"names the mesh axis 'tensor'.*\('data', 'model'\)")):
    step = strategy.function(lambda w, x, c=constraint: jdist.compute_average_loss(
        jnp.sum(jax.lax.with_sharding_constraint(x @ w, c), axis=-1)))
    with pytest.raises((jdist.StrategyMismatchError, ValueError), match=match):
      step(w, batch)


# --- an nnx model made under the user's jax.set_mesh, trained as it is --------


class Mlp(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.l0 = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(
        init, (None, "model")), rngs=rngs)
    self.l1 = nnx.Linear(16, 4, kernel_init=nnx.with_partitioning(
        init, ("model", None)), rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.l0(x))
    return self.l1(jax.lax.with_sharding_constraint(h, P("data", "model")))


def test_an_nnx_model_made_under_set_mesh_trains_in_fit_as_one_device(devices):
  x, y = _digits()
  loss = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)
  mesh = _mesh22(devices)  # jax.make_mesh's Explicit axes
  with jax.set_mesh(mesh):
    model = Mlp(nnx.Rngs(0))  # its variables sharded as they are made
    assert model.l0.kernel.sharding.spec == P(None, "model")
    trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), loss=loss,
                            strategy=jdist.ModelParallelStrategy(
                                device_mesh=mesh))
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert model.l0.kernel.sharding.spec == P(None, "model")  # trained in place
  with nnx.use_eager_sharding(False):
    reference = Mlp(nnx.Rngs(0))
  expected = jdist.Trainer(reference, optimizer=optax.sgd(0.1), loss=loss,
                           strategy=jdist.OneDeviceStrategy(devices[0])).fit(
                               x, y, batch_size=16, epochs=1, verbose=0)
  np.testing.assert_allclose(history.history["loss"],
                             expected.history["loss"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(nnx.state(reference, nnx.Param)),
                  jax.tree.leaves(nnx.state(model, nnx.Param))):
    np.testing.assert_allclose(a, b, atol=1e-6)
