"""JAX's own meshes and activation constraints: strategies built on a
`jax.sharding.Mesh` (Auto or Explicit axes), steps inside a user's
`with jax.set_mesh(mesh):`, models that constrain their activations
(`with_sharding_constraint`, flax's logical constraints) in a custom loop
and in fit, equal to one device; and the silent corners of
ModelParallelStrategy (replicate, nothing split, random draws alike on
every replica, an optimizer without state)."""

import re
import warnings

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
import jdist.testing
from conftest import lowered_programs
from jdist.examples.models import MLP

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
    devices, tmp_path):
  mesh = jax.make_mesh((2,), ("data",), devices=devices[:2])  # Explicit
  data = [np.arange(12, dtype=np.float32).reshape(4, 3) / 10]
  for make in (jdist.MirroredStrategy, jdist.CentralStorageStrategy):
    strategy = make(mesh=mesh)
    step = strategy.function(_linear_step)

    def run(strategy=strategy, step=step):
      w = strategy.init(jnp.ones, 3)
      for batch in strategy.experimental_distribute_dataset(data):
        w, loss, outputs = step(w, batch)
      return (np.asarray(w), float(strategy.reduce("sum", loss)),
              np.asarray(strategy.gather(outputs))), w

    outside, _ = run()
    with jax.set_mesh(mesh):  # the strategy's own mesh: used
      inside, w = run()
      manager = jdist.CheckpointManager(tmp_path / make.__name__)
      manager.save(1, {"w": w})
      restored = manager.restore({"w": w})
    for a, b in zip(outside, inside):
      np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_array_equal(restored["w"], outside[0])
  other = jax.make_mesh((2, 2), ("a", "b"), devices=devices[:4])
  for call in (run, lambda: strategy.init(jnp.ones, 3)):
    with jax.set_mesh(other), pytest.raises(
        jdist.StrategyMismatchError,
        match=r"Mesh\('data': 2, axis_types=\(Auto,\)\) on cpu:0, cpu:1, "
        r"but the mesh in context \(jax.set_mesh\) is Mesh\('a': 2, 'b': 2, "
        r"axis_types=\(Explicit, Explicit\)\)"):
      call()


def test_init_compiles_one_program_equal_to_the_eager_run(devices):
  strategy = jdist.MirroredStrategy(devices[:2])
  model = MLP(hidden=11, classes=3)  # shapes no other test uses
  key, x = jax.random.key(1), np.ones((1, 6), np.float32)
  with lowered_programs() as lowered:
    params = strategy.init(model.init, key, x)
  assert lowered == ["jit(init)"]  # eagerly, one per flax operation
  eager = model.init(key, x)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(eager), strict=True):
    assert a.sharding.is_fully_replicated and len(a.sharding.device_set) == 2
    np.testing.assert_array_equal(a, b)
  # Functions a trace cannot run give what they give eagerly: one that reads
  # an array's value, an nnx model drawing from Rngs made outside.
  assert list(strategy.init(lambda v: v * 2 if float(v.sum()) else v,
                            jnp.ones(2))) == [2.0, 2.0]
  rngs = nnx.Rngs(0)
  layer = strategy.init(lambda: nnx.Linear(6, 2, rngs=rngs))
  np.testing.assert_array_equal(layer.kernel[...], nnx.Linear(
      6, 2, rngs=nnx.Rngs(0)).kernel[...])
  assert int(rngs.default.count[...]) == 2  # the kernel's draw and the bias's


# --- activation constraints --------------------------------------------------


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
  expected, _ = _constrained_loop(jdist.OneDeviceStrategy(devices[0]), model)
  got, text = _constrained_loop(strategy, model)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Inside the step a replica's activations (8 rows) are held split over
  # "model": the constraints kept their within-replica axes.
  assert len(re.findall(r'<@mesh, \[\{\}, \{"model"\}\]> : tensor<8x16xf32>',
                        text)) >= 3
  # fit (the same three batches): init and its shape checks trace the model
  # under the mesh.
  x, y = _digits(48)
  trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), strategy=strategy,
                          params=strategy.init(model.init, jax.random.key(0),
                                               jnp.zeros((1, 8))),
                          loss=jdist.losses.SparseCategoricalCrossentropy(
                              from_logits=True))
  trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  for a, b in zip(jax.tree.leaves(expected),
                  jax.tree.leaves(nn.meta.unbox(trainer.params))):
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
      (P(None, "tensor"),
       r"names the mesh axis 'tensor'.*\('data', 'model'\)")):
    step = strategy.function(
        lambda w, x, c=constraint: jdist.compute_average_loss(jnp.sum(
            jax.lax.with_sharding_constraint(x @ w, c), axis=-1)))
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
    h = nn.with_logical_constraint(h, ("batch", "hidden"))  # nnx uses linen's
    return self.l1(jax.lax.with_sharding_constraint(h, P("data", "model")))


def test_an_nnx_model_made_under_set_mesh_trains_in_fit_as_one_device(
    devices, tmp_path):
  x, y = _digits()
  loss = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)
  mesh = _mesh22(devices)  # jax.make_mesh's Explicit axes
  with jax.set_mesh(mesh):
    model = Mlp(nnx.Rngs(0))  # its variables sharded as they are made
    assert model.l0.kernel.sharding.spec == P(None, "model")
    trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), loss=loss,
                            strategy=jdist.ModelParallelStrategy(
                                device_mesh=mesh, logical_axis_rules=_RULES))
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0,
                          callbacks=[jdist.ModelCheckpoint(tmp_path / "ckpt")])
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


# --- LayoutMap output-layout keys on flax layers ------------------------------


class TwoLayers(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="d2")(jax.nn.relu(nn.Dense(8, name="d1")(x)))


class TwoLayersNnx(nnx.Module):
  def __init__(self, rngs):
    self.d1 = nnx.Linear(3, 8, rngs=rngs)
    self.d2 = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.d2(jax.nn.relu(self.d1(x)))


def test_output_layout_keys_constrain_flax_layers_outputs_in_a_step(devices):
  """`layout_map["d1/output"]` (Keras's key for the output of the layer d1)
  constrains that layer's output, per replica, for linen and nnx; a key
  that names no layer the step ran warns, naming the layers."""
  batch = np.ones((8, 3), np.float32)
  split = r'<@mesh, \[\{\}, \{"model"\}\]> : tensor<4x8xf32>'
  for keys, found in (({"d1/output": ("data", "model")}, True),
                      ({"d3/output": ("data", None)}, False)):
    layout_map = jdist.LayoutMap(_mesh22(devices))
    layout_map[".*kernel"] = (None, "model")
    for key, axes in keys.items():
      layout_map[key] = axes
    strategy = jdist.ModelParallelStrategy(layout_map=layout_map)
    x = next(iter(strategy.experimental_distribute_dataset([batch])))
    linen = strategy.init(TwoLayers().init, jax.random.key(0), batch[:1])
    with nnx.use_eager_sharding(False):
      module = strategy.replicate(TwoLayersNnx(nnx.Rngs(0)))
    with warnings.catch_warnings(record=True) as warned:
      warnings.simplefilter("always")
      texts = [strategy.function(lambda s, x, apply=apply: (
          jdist.compute_average_loss(jnp.sum(apply(s, x) ** 2, axis=-1)))
      ).lower(state, x).as_text() for apply, state in (
          (TwoLayers().apply, linen), (lambda m, x: m(x), module))]
    assert [bool(re.search(split, text)) for text in texts] == [found] * 2
    messages = [str(w.message) for w in warned]
    if found:
      assert not messages
    else:  # once per strategy, naming the layers the step ran
      assert len(messages) == 1 and re.search(
          r"'d3/output' is an output-layout key.*no layer the step ran; the "
          r"layers are 'd1', 'd2'", messages[0])
    assert type(module.d1) is nnx.Linear  # its class restored after


# --- ModelParallelStrategy's silent corners ----------------------------------


def test_replicate_lays_state_out_and_checks_it_as_init_does(devices):
  layout_map = jdist.LayoutMap(_mesh22(devices))
  layout_map["w"] = (None, "model")
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map)
  placed = strategy.replicate({"w": np.ones((3, 4), np.float32),
                               "b": np.zeros(4, np.float32)})
  assert placed["w"].sharding.spec == P(None, "model")
  assert placed["b"].sharding.is_fully_replicated
  bad = r"'w' of shape \(3, 3\): dimension 1 \(3\) cannot be split over mesh " \
        r"axis model of size 2"
  for place in (strategy.replicate, lambda t: strategy.init(lambda: t)):
    with pytest.raises(ValueError, match=bad):
      place({"w": np.ones((3, 3), np.float32)})
  # An optimizer without state: nothing to lay out, nothing to warn of.
  strategy.init(optax.sgd(0.1).init, placed)


def test_a_run_that_splits_nothing_warns_once_with_its_largest_arrays(devices):
  """Unboxed parameters given to `Trainer(params=)` under a strategy with
  nothing to lay them out: every device would hold them whole, silently."""
  strategy = jdist.ModelParallelStrategy(device_mesh=_mesh22(devices))
  trainer = jdist.Trainer(lambda p, x: x @ p["w"] + p["b"], optimizer=optax.sgd(
      0.1), loss="mse", params={"w": np.zeros((64, 4), np.float32),
                                "b": np.zeros(4, np.float32)},
                          strategy=strategy)
  with pytest.warns(UserWarning, match=r"splits no array of this state over "
                    r"its mesh: every device holds all \d+ bytes of it, the "
                    r"largest params/w \(1024 bytes\), params/b \(16 bytes\)"
                    ) as warned:
    trainer.build(np.zeros((2, 64), np.float32))
  assert len(warned) == 1
  strategy.init(lambda: {"v": np.zeros((8, 8), np.float32)})  # said once


class Dropped(nn.Module):
  @nn.compact
  def __call__(self, x, key):
    return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x), rng=key)


def test_flax_dropout_on_replicas_warns_in_assert_equivalent(devices):
  """flax's Dropout draws one mask per replica: its run on 2 replicas
  differs from one device, and jdist says so once, naming jdist.dropout.
  (`jdist.dropout` draws by example: the suite's steps that use it on
  several replicas, in test_fit and test_api, would fail on a warning.)"""
  x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
  model = Dropped()
  params = model.init(jax.random.key(0), x[:1], jax.random.key(1))

  def step(state, batch):
    params, n = state
    key = jax.random.fold_in(jax.random.key(1), n)
    loss, grads = jax.value_and_grad(lambda p: jdist.compute_average_loss(
        jnp.sum(model.apply(p, batch, key) ** 2, axis=-1)))(params)
    return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads),
            n + 1), loss

  with pytest.warns(UserWarning, match=r"same on every replica.*"
                    r"jdist\.dropout") as warned, pytest.raises(
                        AssertionError, match="does not reproduce"):
    jdist.testing.assert_equivalent(step, (params, jnp.int32(0)),
                                    [x[:8], x[8:]], 2)
  assert len(warned) == 1
