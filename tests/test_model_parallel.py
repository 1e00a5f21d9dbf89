"""Model parallelism: DeviceMesh, LayoutMap (Keras 3's names and meaning)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jdist


@pytest.fixture(scope="module")
def mesh22(devices):
  return jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])


def _mlp_params():
  return {"dense_0": {"kernel": jnp.zeros((3, 8)), "bias": jnp.zeros(8)},
          "dense_1": {"kernel": jnp.zeros((8, 2)), "bias": jnp.zeros(2)}}


# --- DeviceMesh --------------------------------------------------------------


def test_device_mesh_lays_devices_out_row_major(devices, mesh22):
  assert mesh22.shape == (2, 2) and mesh22.axis_names == ("data", "model")
  assert mesh22.devices[1, 0] == devices[2]
  assert mesh22.axis_size("model") == 2
  jm = mesh22.jax_mesh
  assert dict(jm.shape) == {"data": 2, "model": 2}


def test_device_mesh_defaults_to_every_device():
  mesh = jdist.DeviceMesh((len(jax.devices()),), ("data",))
  assert list(mesh.devices) == jax.devices()


def test_device_mesh_size_must_match_device_count(devices):
  with pytest.raises(ValueError, match=r"holds 6 devices but 4 were given"):
    jdist.DeviceMesh((2, 3), ("data", "model"), devices[:4])
  # Without devices: the run's, counted as processes x devices (a job
  # restarted on fewer processes has fewer), before anything runs.
  with pytest.raises(ValueError, match=(
      rf"holds 6 devices but this run has {len(devices)} \(1 process x "
      rf"{len(devices)} devices\).*restarted on fewer processes")):
    jdist.DeviceMesh((2, 3), ("data", "model"))


def test_device_mesh_needs_one_name_per_axis(devices):
  with pytest.raises(ValueError, match="one name per axis"):
    jdist.DeviceMesh((2, 2), ("data",), devices[:4])


def test_device_mesh_refuses_sizes_that_are_not_counts_and_repeated_devices(
    devices):
  # int() made (2, 2.5) a (2, 2) mesh; -1 reached numpy's reshape and a
  # repeated device XLA's "Device 0 not unique".
  for shape, size in [((2, 2.5), "2.5"), ((2, -2), "-2"), ((-2, -2), "-2"),
                      ((4, 0), "0"), ((True, 4), "True")]:
    with pytest.raises(ValueError, match=rf"DeviceMesh shape .*: axis "
                       rf"'[ab]' has size {size}, which is not a positive "
                       "integer"):
      jdist.DeviceMesh(shape, ("a", "b"), devices[:4])
  assert jdist.DeviceMesh((np.int64(2), 2), ("a", "b"), devices[:4]).shape == (
      2, 2)
  with pytest.raises(ValueError, match=r"DeviceMesh devices list .* twice "
                     r"\(at positions 0 and 3, flattened\)"):
    jdist.DeviceMesh((2, 2), ("a", "b"), devices[:3] + [devices[0]])


def test_a_layout_naming_an_axis_twice_is_refused_when_set(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  for layout in [("model", "model"), P(("data", "model"), None, "model")]:
    with pytest.raises(ValueError, match=r"LayoutMap\['dense_0/kernel'\] = "
                       r".* names mesh axis 'model' for dimensions 0 and \d of "
                       r"the parameters it matches, but an axis can split one "
                       r"dimension only"):
      layout_map["dense_0/kernel"] = layout
  assert len(layout_map) == 0


# --- LayoutMap ---------------------------------------------------------------
# --- LayoutMap ---------------------------------------------------------------


def test_keys_match_the_whole_path_and_unmatched_is_replicated(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["dense_.*/kernel"] = (None, "model")
  layout_map["dense_0/bias"] = ("model",)
  specs = layout_map.partition_specs(_mlp_params())
  assert specs["dense_0"]["kernel"] == P(None, "model")
  assert specs["dense_1"]["kernel"] == P(None, "model")
  assert specs["dense_0"]["bias"] == P("model")
  assert specs["dense_1"]["bias"] == P()
  # Matched whole, as Keras: a key without the prefix does not match.
  assert layout_map["model/dense_0/kernel"] is None


def test_shardings_place_each_leaf_on_its_axes(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map[".*kernel"] = (None, "model")
  params = _mlp_params()
  placed = jax.device_put(params, layout_map.shardings(params))
  kernel = placed["dense_0"]["kernel"]
  assert kernel.addressable_shards[0].data.shape == (3, 4)
  assert placed["dense_0"]["bias"].addressable_shards[0].data.shape == (8,)


def test_two_keys_matching_one_path_is_an_error_naming_both(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["dense_0/k.*"] = (None, "model")
  layout_map[".*kernel"] = ("model", None)
  with pytest.raises(ValueError, match=r"dense_0/kernel.*'dense_0/k\.\*', "
                     r"'\.\*kernel'"):
    layout_map.partition_specs(_mlp_params())


def test_an_exact_key_wins_over_regular_expressions_as_in_keras(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["dense_.*/kernel"] = (None, "model")
  layout_map[".*_0/kernel"] = ("model", None)
  layout_map["dense_0/kernel"] = (None, None)  # exact: wins over both
  assert layout_map["dense_0/kernel"] == P(None, None)
  specs = layout_map.partition_specs(_mlp_params())
  assert specs["dense_0"]["kernel"] == P(None, None)
  assert specs["dense_1"]["kernel"] == P(None, "model")
  # In a deeper tree (a train state, an optimizer's moments) too.
  assert layout_map.layout_of("params/dense_0/kernel") == P(None, None)
  del layout_map["dense_0/kernel"]
  with pytest.raises(ValueError, match=r"'dense_0/kernel' matches more than "
                     r"one LayoutMap key.*add the path itself as a key"):
    layout_map["dense_0/kernel"]


def test_layout_map_finds_what_keras_layout_map_finds(mesh22):
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  keys = {"dense/kernel": (None, "model"), "dense.*": ("model",),
          ".*conv.*/kernel": (None, None, None, "model"),
          "block/conv/kernel": ("model", None, None, None),
          "d2/output": ("data", None)}
  theirs = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
      (2, 2), ["data", "model"], keras.distribution.list_devices()[:4]))
  ours = jdist.LayoutMap(mesh22)
  for key, axes in keys.items():
    theirs[key], ours[key] = axes, axes
  for path in ("dense/kernel", "dense/bias", "dense_1", "block/conv/kernel",
               "conv_2/kernel", "dense_conv/kernel", "sequential/d2/output",
               "d2/output", "x"):
    try:
      want = theirs[path]
    except ValueError:
      with pytest.raises(ValueError, match="more than one LayoutMap key"):
        ours[path]  # noqa: B018
      continue
    got = ours[path]
    assert (None if want is None else P(*want.axes)) == got, path


def test_an_output_layout_key_is_not_taken_for_a_parameter_key(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["dense_0/output"] = ("data", "model")
  layout_map.partition_specs(_mlp_params())  # no "matches no parameter"
  assert layout_map.output_keys == ("dense_0/output",)
  assert layout_map.output_layout("model/dense_0") == P("data", "model")
  assert layout_map.output_layout("model/dense_1") is None


def test_indivisible_layout_names_path_dim_and_axis(devices):
  mesh = jdist.DeviceMesh((1, 4), ("data", "model"), devices[:4])
  layout_map = jdist.LayoutMap(mesh)
  layout_map[".*kernel"] = (None, "model")
  with pytest.raises(ValueError, match=r"'dense_1/kernel' of shape \(8, 2\): "
                     r"dimension 1 \(2\) cannot be split over mesh axis model "
                     r"of size 4"):
    layout_map.partition_specs(_mlp_params())


def test_layout_of_the_wrong_rank_is_an_error(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["dense_0/bias"] = (None, "model")
  with pytest.raises(ValueError, match=r"'dense_0/bias' of shape \(8,\).*2 "
                     "dimensions"):
    layout_map.partition_specs(_mlp_params())


def test_unknown_axis_name_is_an_error_at_assignment(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  with pytest.raises(ValueError, match=r"mesh axis 'tensor'.*\('data', "
                     r"'model'\)"):
    layout_map[".*kernel"] = (None, "tensor")
  assert len(layout_map) == 0


def test_a_key_that_matches_nothing_warns(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["d1/kernel"] = (None, "model")
  with pytest.warns(UserWarning, match="'d1/kernel' matches no parameter"):
    layout_map.partition_specs(_mlp_params())


def test_a_string_layout_is_refused(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  with pytest.raises(TypeError, match=r"\('model',\)"):
    layout_map[".*bias"] = "model"


def test_a_key_is_set_once(mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map[".*bias"] = ("model",)
  with pytest.raises(ValueError, match="already has the key"):
    layout_map[".*bias"] = (None,)
  del layout_map[".*bias"]
  layout_map[".*bias"] = (None,)
  assert list(layout_map) == [".*bias"]


# --- ModelParallelStrategy: one device against a mesh ------------------------

import optax  # noqa: E402

_TX = optax.sgd(0.1, momentum=0.9)


def _make_params(key=0):
  k0, k1, k2 = jax.random.split(jax.random.key(key), 3)
  return {"dense_0": {"kernel": jax.random.normal(k0, (3, 8)) * 0.5,
                      "bias": jax.random.normal(k2, (8,)) * 0.1},
          "dense_1": {"kernel": jax.random.normal(k1, (8, 4)) * 0.5,
                      "bias": jnp.zeros(4)}}


def _loss(p, x, y):
  h = jnp.tanh(x @ p["dense_0"]["kernel"] + p["dense_0"]["bias"])
  out = h @ p["dense_1"]["kernel"] + p["dense_1"]["bias"]
  return jdist.compute_average_loss(jnp.sum((out - y) ** 2, -1))


def _step(params, opt_state, batch):
  x, y = batch
  loss, grads = jax.value_and_grad(_loss)(params, x, y)
  updates, opt_state = _TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _batches(n=4, size=8):
  rng = np.random.default_rng(0)
  return [(rng.normal(size=(size, 3)).astype(np.float32),
           rng.normal(size=(size, 4)).astype(np.float32)) for _ in range(n)]


def _train(strategy, params, opt_state, outer_jit=False, batches=None,
           options=None):
  step = strategy.function(_step)
  step = jax.jit(step) if outer_jit else step
  losses = []
  for batch in strategy.experimental_distribute_dataset(
      _batches() if batches is None else batches, options):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(strategy.reduce("sum", loss)))
  return params, opt_state, losses


@pytest.fixture(scope="module")
def one_device_run(devices):
  strategy = jdist.OneDeviceStrategy(devices[0])
  params = strategy.replicate(_make_params())
  return _train(strategy, params, strategy.replicate(_TX.init(params)))


def _tensor_parallel(mesh):
  layout_map = jdist.LayoutMap(mesh)
  layout_map[".*dense_0/kernel"] = (None, "model")
  layout_map[".*dense_1/kernel"] = ("model", None)
  layout_map[".*dense_0/bias"] = ("model",)
  return layout_map


def _model_parallel_run(layout_map, batch_dim_name, outer_jit=False):
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map,
                                         batch_dim_name=batch_dim_name)
  params = strategy.init(_make_params)
  opt_state = strategy.init(_TX.init, params)
  return strategy, _train(strategy, params, opt_state, outer_jit)


def _assert_same(run, reference):
  (params, _, losses), (ref_params, _, ref_losses) = run, reference
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("outer_jit", [False, True])
def test_data_by_model_2x2_equals_one_device(mesh22, one_device_run,
                                             outer_jit):
  strategy, run = _model_parallel_run(_tensor_parallel(mesh22), "data",
                                      outer_jit)
  assert strategy.num_replicas_in_sync == 2
  _assert_same(run, one_device_run)
  params, opt_state, _ = run
  kernel = params["dense_0"]["kernel"]
  assert kernel.sharding.spec == P(None, "model")
  assert kernel.addressable_shards[0].data.shape == (3, 4)
  momentum = jax.tree.leaves(opt_state)[1]
  assert momentum.addressable_shards[0].data.shape == (3, 4)


def _empty_layout(mesh):
  return jdist.LayoutMap(mesh)


# (mesh shape, axis names, layout, fsdp axis, replicas, dense_0 kernel's and
# dense_1 kernel's shard shapes)
_MESHES = {
    "data_by_fsdp_2x2": ((2, 2), ("data", "fsdp"), _empty_layout, "fsdp", 2,
                         (3, 4), (4, 4)),
    # One replica over every device: a batch axis of size 1.
    "tensor_parallel_1x4": ((1, 4), ("data", "model"), _tensor_parallel, None,
                            1, (3, 2), (2, 4)),
    "fsdp_4": ((1, 4), ("data", "fsdp"), _empty_layout, "fsdp", 1, (3, 2),
               (2, 4)),
}


@pytest.mark.parametrize("case", sorted(_MESHES))
def test_mesh_equals_one_device_and_state_stays_split(devices, one_device_run,
                                                      case):
  shape, names, layout, fsdp, replicas, shard0, shard1 = _MESHES[case]
  mesh = jdist.DeviceMesh(shape, names, devices[:4])
  strategy = jdist.ModelParallelStrategy(layout_map=layout(mesh),
                                         batch_dim_name="data",
                                         fsdp_axis=fsdp)
  assert strategy.num_replicas_in_sync == replicas
  params = strategy.init(_make_params)
  opt_state = strategy.init(_TX.init, params)
  run = _train(strategy, params, opt_state)
  _assert_same(run, one_device_run)
  params, opt_state, _ = run
  assert params["dense_0"]["kernel"].addressable_shards[0].data.shape == shard0
  assert params["dense_1"]["kernel"].addressable_shards[0].data.shape == shard1
  trace = opt_state[0].trace
  assert trace["dense_1"]["kernel"].addressable_shards[0].data.shape == shard1


def test_fsdp_splits_each_replicas_batch(devices):
  mesh = jdist.DeviceMesh((2, 2), ("data", "fsdp"), devices[:4])
  strategy = jdist.ModelParallelStrategy(
      layout_map=jdist.LayoutMap(mesh), batch_dim_name="data",
      fsdp_axis="fsdp")
  batch = next(iter(strategy.experimental_distribute_dataset(_batches(1))))
  x = batch.values[0]
  assert x.sharding.spec == P("data", "fsdp")
  assert x.addressable_shards[0].data.shape == (1, 2, 3)


def test_pad_to_replicas_pads_each_replicas_batch_for_fsdp_too(devices):
  """Batches of 6 on 2 replicas x 2 FSDP devices: refused, the error naming
  the option; with `pad_to_replicas=True` padded to 8 (a multiple of the 4
  parts, 2 rows masked), and the training equals one device's on the 6."""
  batches = _batches(3, size=6)
  mesh = jdist.DeviceMesh((2, 2), ("data", "fsdp"), devices[:4])
  strategy = jdist.ModelParallelStrategy(
      layout_map=jdist.LayoutMap(mesh), fsdp_axis="fsdp")
  with pytest.raises(ValueError, match=r"global batch of 6 examples cannot "
                     r"split evenly over 4 parts \(2 replicas x 2 devices of "
                     r"'fsdp'\).* Or pass options=jdist.InputOptions\("
                     r"pad_to_replicas=True\)"):
    next(iter(strategy.experimental_distribute_dataset(batches)))
  params = strategy.init(_make_params)
  run = _train(strategy, params, strategy.init(_TX.init, params),
               batches=batches,
               options=jdist.InputOptions(pad_to_replicas=True))
  one = jdist.OneDeviceStrategy(devices[0])
  params = one.replicate(_make_params())
  _assert_same(run, _train(one, params, one.replicate(_TX.init(params)),
                           batches=batches))


def test_batch_that_the_replicas_cannot_split_is_an_error(mesh22):
  strategy = jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh22))
  with pytest.raises(ValueError, match=r"global batch of 7 examples cannot "
                     r"split evenly over 2 replicas"):
    list(strategy.experimental_distribute_dataset(_batches(2, size=7)))


def test_unknown_axis_names_are_errors(mesh22):
  with pytest.raises(ValueError, match=r"batch_dim_name names the mesh axis "
                     r"'batch'"):
    jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh22),
                                batch_dim_name="batch")
  with pytest.raises(ValueError, match=r"fsdp_axis names the mesh axis 'fsdp'"):
    jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh22),
                                fsdp_axis="fsdp")


def test_run_reduce_gather_and_local_results_see_one_value_per_replica(mesh22):
  strategy = jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh22))
  assert repr(strategy) == ("ModelParallelStrategy(DeviceMesh(data=2, "
                            "model=2), batch_dim_name='data')")
  data = np.arange(8.0, dtype=np.float32).reshape(8, 1)
  batch = next(iter(strategy.experimental_distribute_dataset([data])))
  out = strategy.run(lambda x: x * 2, args=(batch,))
  local = strategy.experimental_local_results(out)
  assert [np.asarray(v).ravel().tolist() for v in local] == [
      [0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0]]
  np.testing.assert_array_equal(np.asarray(strategy.gather(out, 0)), data * 2)
  np.testing.assert_array_equal(
      np.asarray(strategy.reduce("sum", out, axis=0)), [56.0])


# --- one compilation per step ------------------------------------------------

_LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@pytest.fixture
def count_lowerings():
  """How many programs jax lowers (a new one per jit cache miss) from here."""
  lowered = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == _LOWERING:
      lowered.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  yield lowered
  jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("case", ["kernels_only_2x2", "data_by_fsdp_2x2"])
def test_a_step_compiles_once_and_returns_state_in_its_layout(
    devices, count_lowerings, case):
  # A bias no rule names was returned split like its kernel, so the second
  # call (its argument in a new layout) compiled the step again.
  names = ("data", "fsdp") if "fsdp" in case else ("data", "model")
  mesh = jdist.DeviceMesh((2, 2), names, devices[:4])
  layout_map = jdist.LayoutMap(mesh)
  if "fsdp" not in case:
    layout_map[".*dense_0/kernel"] = (None, "model")
    layout_map[".*dense_1/kernel"] = ("model", None)
  strategy = jdist.ModelParallelStrategy(
      layout_map=layout_map, batch_dim_name="data",
      fsdp_axis="fsdp" if "fsdp" in case else None)
  params = strategy.init(_make_params)
  opt_state = strategy.init(_TX.init, params)
  batches = list(strategy.experimental_distribute_dataset(_batches(3)))
  step = strategy.function(_step)
  before = len(count_lowerings)
  for batch in batches:
    new_params, opt_state, _ = step(params, opt_state, batch)
    for old, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
      assert new.sharding.is_equivalent_to(old.sharding, old.ndim), (
          old.sharding.spec, new.sharding.spec)
    params = new_params
  assert step.num_compilations == 1
  assert len(count_lowerings) - before == 1


def test_one_replica_over_every_device_still_refuses_a_double_reduction(
    devices):
  # Its step is mapped without varying types (jax 0.10.2 cannot compile the
  # gradient otherwise); the typed probe still runs the guards.
  mesh = jdist.DeviceMesh((1, 4), ("data", "model"), devices[:4])
  strategy = jdist.ModelParallelStrategy(layout_map=_tensor_parallel(mesh))
  params = strategy.init(_make_params)

  @strategy.function
  def step(params, batch):
    x, _ = batch
    grads = jax.grad(lambda p: jdist.compute_average_loss(
        jnp.sum(x @ p["dense_0"]["kernel"], -1)))(params)
    return jdist.get_replica_context().all_reduce("sum", grads)

  batch = next(iter(strategy.experimental_distribute_dataset(_batches(1))))
  with pytest.raises(jdist.DoubleReductionError, match="already the same"):
    step(params, batch)


# --- ShardedOptimizer: ZeRO over the replica axis, layouts within ------------


def _adam_train(strategy, tx, params, opt_state, *, own_grads):
  """A user's custom loop with a sharded (or plain) adam."""
  grad = tx.value_and_grad if own_grads else jax.value_and_grad

  @strategy.function
  def step(params, opt_state, batch):
    x, y = batch
    loss, grads = grad(lambda p: _loss(p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for batch in strategy.experimental_distribute_dataset(_batches()):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(strategy.reduce("sum", loss)))
  return (params, opt_state, losses), step


@pytest.fixture(scope="module")
def one_device_adam_run(devices):
  strategy = jdist.OneDeviceStrategy(devices[0])
  tx = optax.adam(0.05)
  params = strategy.replicate(_make_params())
  return _adam_train(strategy, tx, params, strategy.replicate(tx.init(params)),
                     own_grads=False)[0]


def _shard(x):
  return x.addressable_shards[0].data.shape


@pytest.mark.parametrize("own_grads", [False, True], ids=["zero1", "zero2"])
def test_sharded_adam_on_2x2_equals_one_device_a_quarter_per_device(
    mesh22, one_device_adam_run, own_grads):
  strategy = jdist.ModelParallelStrategy(layout_map=_tensor_parallel(mesh22),
                                         batch_dim_name="data")
  tx = jdist.ShardedOptimizer(optax.adam(0.05), strategy)
  params = strategy.init(_make_params)
  opt_state = tx.init(params)
  run, step = _adam_train(strategy, tx, params, opt_state,
                          own_grads=own_grads)
  _assert_same(run, one_device_adam_run)
  # Adam's update hides a gradient of the wrong scale (it divides by the
  # gradient's own size): its moments do not.
  for a, b in zip(jax.tree.leaves(run[1].value),
                  jax.tree.leaves(one_device_adam_run[1]), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-9)
  params, opt_state, _ = run
  assert isinstance(opt_state, jdist.Sharded) and step.num_compilations == 1
  adam = opt_state.value[0]
  for moment in (adam.mu, adam.nu):
    # Split over "data" on top of the parameter's "model" layout: a quarter
    # of each leaf both divide; the bias no rule lays out, a half.
    kernel_0, kernel_1 = moment["dense_0"]["kernel"], moment["dense_1"]["kernel"]
    assert kernel_0.sharding.spec == P(None, ("data", "model"))
    assert (kernel_0.shape, _shard(kernel_0)) == ((3, 8), (3, 2))
    assert kernel_1.sharding.spec == P(("data", "model"))
    assert (kernel_1.shape, _shard(kernel_1)) == ((8, 4), (2, 4))
    assert _shard(moment["dense_0"]["bias"]) == (2,)
    assert _shard(moment["dense_1"]["bias"]) == (2,)
  # The parameters stay in their own layout.
  assert params["dense_0"]["kernel"].sharding.spec == P(None, "model")


def _indivisible_params():
  return {"w": jnp.zeros((3, 2)), "v": jnp.zeros((4, 4))}


def test_sharded_state_that_cannot_split_keeps_its_layout_or_is_refused(
    mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["w"] = (None, "model")  # 3 rows; 2 columns over 2 devices
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map)
  params = strategy.init(_indivisible_params)
  state = jdist.ShardedOptimizer(optax.sgd(0.1, momentum=0.9),
                                 strategy).init(params)
  trace = state.value[0].trace
  assert trace["w"].sharding.spec == P(None, "model")  # as its parameter
  assert _shard(trace["w"]) == (3, 1) and _shard(trace["v"]) == (2, 4)
  strict = jdist.ShardedOptimizer(optax.adam(1e-3), strategy,
                                  mirror_indivisible=False)
  with pytest.raises(jdist.ShardingError, match=(
      r"These parameters cannot be split over 2 replicas: \['w'\] \(3, 2\), "
      r"and ShardedOptimizer\(mirror_indivisible=False\) refuses.*an axis its "
      r"layout splits over k devices of a replica must hold 2 x k")):
    strict.init(params)


def test_sharded_state_of_a_parameter_laid_out_over_the_replicas_is_refused(
    mesh22):
  layout_map = jdist.LayoutMap(mesh22)
  layout_map["v"] = ("data", None)
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map,
                                         batch_dim_name="data")
  params = strategy.init(_indivisible_params)
  with pytest.raises(jdist.ShardingError, match=(
      r"Parameter \['v'\] is laid out as \('data', None\), over the replica "
      r"axis 'data'")):
    jdist.ShardedOptimizer(optax.adam(1e-3), strategy).init(params)


@pytest.mark.parametrize("case", ["data_by_fsdp_2x2", "tensor_parallel_1x4"])
def test_sharded_adam_composes_with_fsdp_and_one_replica(
    devices, one_device_adam_run, case):
  # One replica over every device used to reduce its ZeRO-2 gradients over
  # one replica, which XLA refuses in its untyped map.
  shape, names, layout, fsdp, replicas, _, shard1 = _MESHES[case]
  mesh = jdist.DeviceMesh(shape, names, devices[:4])
  strategy = jdist.ModelParallelStrategy(layout_map=layout(mesh),
                                         batch_dim_name="data", fsdp_axis=fsdp)
  tx = jdist.ShardedOptimizer(optax.adam(0.05), strategy)
  params = strategy.init(_make_params)
  run, _ = _adam_train(strategy, tx, params, tx.init(params), own_grads=True)
  _assert_same(run, one_device_adam_run)
  mu = run[1].value[0].mu["dense_1"]["kernel"]  # (8, 4)
  # Over the replicas on top of the layout: 2 x 2 devices; or the layout's.
  assert _shard(mu) == ((2, 4) if replicas == 2 else shard1)
