"""ModelParallelStrategy laid out by flax's own partition metadata (no
LayoutMap): linen nn.with_partitioning, nn.with_logical_partitioning with
rules, nnx out_sharding; in a custom loop and in fit, on a 2x2 data x model
mesh and with FSDP, equal to one device; clear errors before the first step."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jdist

_TX = optax.sgd(0.1, momentum=0.9)
_INIT = nn.initializers.lecun_normal()
_BIAS = nn.initializers.normal(0.1)  # not zeros: a wrong layout would show
_RULES = (("embed", None), ("mlp", "model"))


class PartitionedMLP(nn.Module):
  """8 -> 16 -> 4, Megatron's split over mesh axis `axis`."""
  axis: str = "model"

  @nn.compact
  def __call__(self, x):
    a = self.axis
    x = nn.Dense(16, kernel_init=nn.with_partitioning(_INIT, (None, a)),
                 bias_init=nn.with_partitioning(_BIAS, (a,)))(x)
    x = nn.Dense(4, kernel_init=nn.with_partitioning(_INIT, (a, None)),
                 bias_init=_BIAS)(nn.relu(x))
    return x


class LogicalMLP(nn.Module):
  """The same split by logical names: "embed" (8, 4) and "mlp" (16)."""
  features: int = 16

  @nn.compact
  def __call__(self, x):
    logical = nn.with_logical_partitioning
    x = nn.Dense(self.features, kernel_init=logical(_INIT, ("embed", "mlp")),
                 bias_init=logical(_BIAS, ("mlp",)))(x)
    return nn.Dense(4, kernel_init=logical(_INIT, ("mlp", "embed")),
                    bias_init=_BIAS)(nn.relu(x))


class NnxMLP(nnx.Module):
  def __init__(self, axis="model", *, rngs):
    shard = nnx.with_partitioning
    self.l0 = nnx.Linear(8, 16, kernel_init=shard(_INIT, (None, axis)),
                         bias_init=shard(_BIAS, (axis,)), rngs=rngs)
    self.l1 = nnx.Linear(16, 4, kernel_init=shard(_INIT, (axis, None)),
                         bias_init=_BIAS, rngs=rngs)

  def __call__(self, x):
    return self.l1(jax.nn.relu(self.l0(x)))


def _data(n=48):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  return x, x[:, :4].argmax(-1).astype(np.int32)


def _strategy(devices, case, **kwargs):
  if case == "one_device":
    return jdist.OneDeviceStrategy(devices[0])
  if case == "mirrored":
    return jdist.MirroredStrategy(devices[:2])
  names = ("data", "fsdp") if case == "fsdp" else ("data", "model")
  mesh = jdist.DeviceMesh((2, 2), names, devices[:4])
  if case == "fsdp":
    kwargs.setdefault("fsdp_axis", "fsdp")
  return jdist.ModelParallelStrategy(device_mesh=mesh, **kwargs)


# The three models, each built for a case: (linen module or nnx factory,
# strategy keyword arguments). Under FSDP the metadata names "fsdp".
def _model(kind, case):
  axis = "fsdp" if case == "fsdp" else "model"
  if kind == "partitioned":
    return PartitionedMLP(axis), {}
  if kind == "logical":
    return LogicalMLP(), {"logical_axis_rules": (("embed", None),
                                                 ("mlp", axis))}
  return (lambda: NnxMLP(axis, rngs=nnx.Rngs(0))), {}


def _shard_shape(x):
  return x.addressable_shards[0].data.shape


# --- custom loop: strategy.function, SGD with momentum -----------------------


def _loss(logits, y):
  return jdist.compute_average_loss(
      optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _linen_params(strategy, module, boxed):
  x0 = jnp.zeros((1, 8))
  if boxed:
    return strategy.init(module.init, jax.random.key(0), x0)["params"]
  # One device: the boxes opened (a step on another mesh cannot apply
  # linen's constraints, which name the model's mesh axes).
  return strategy.replicate(
      nn.meta.unbox(module.init(jax.random.key(0), x0))["params"])


def _custom_loop(strategy, kind, model, boxed=True):
  """Three steps; (params as numpy, losses, params as trained)."""
  if kind == "nnx":
    if boxed:
      graphdef, params = nnx.split(strategy.init(model))
    else:
      with nnx.use_eager_sharding(False):  # one device: no "model" axis
        graphdef, params = nnx.split(model())
      params = strategy.replicate(params)

    def apply(p, x):
      return nnx.merge(graphdef, p)(x)
  else:
    params = _linen_params(strategy, model, boxed)

    def apply(p, x):
      return model.apply({"params": p}, x)
  opt_state = strategy.init(_TX.init, params)

  @strategy.function
  def step(params, opt_state, batch):
    x, y = batch
    loss, grads = jax.value_and_grad(lambda p: _loss(apply(p, x), y))(params)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  x, y = _data()
  batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 48, 16)]
  losses = []
  for batch in strategy.experimental_distribute_dataset(batches):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(strategy.reduce("sum", loss)))
  assert step.num_compilations == 1
  return params, opt_state, losses


def _values(tree):
  return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _assert_close(a, b):
  for x, y in zip(_values(a), _values(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def one_device_loops(devices):
  strategy = _strategy(devices, "one_device")
  return {kind: _custom_loop(strategy, kind, _model(kind, "one_device")[0],
                             boxed=False)
          for kind in ("partitioned", "logical", "nnx")}


def _kernels(params, kind):
  """(first kernel, first bias, second kernel, second bias) arrays."""
  if kind == "nnx":
    return (params["l0"]["kernel"][...], params["l0"]["bias"][...],
            params["l1"]["kernel"][...], params["l1"]["bias"][...])
  leaves = lambda d: (d["kernel"], d["bias"])
  unbox = lambda x: x.value if isinstance(x, nn.Partitioned) else x
  return tuple(unbox(v) for v in leaves(params["Dense_0"]) +
               leaves(params["Dense_1"]))


def _assert_split(params, case, kind):
  k0, b0, k1, b1 = _kernels(params, kind)
  axis = "fsdp" if case == "fsdp" else "model"
  assert k0.sharding.spec == P(None, axis)
  assert _shard_shape(k0) == (8, 8) and _shard_shape(b0) == (8,)
  assert _shard_shape(k1) == (8, 4)
  # Only FSDP splits the bias that the metadata leaves whole.
  assert _shard_shape(b1) == ((2,) if case == "fsdp" else (4,))


@pytest.mark.parametrize("case", ["data_by_model", "fsdp"])
@pytest.mark.parametrize("kind", ["partitioned", "logical", "nnx"])
def test_custom_loop_equals_one_device_and_stays_split(
    devices, one_device_loops, kind, case):
  model, kwargs = _model(kind, case)
  strategy = _strategy(devices, case, **kwargs)
  assert strategy.num_replicas_in_sync == 2
  params, opt_state, losses = _custom_loop(strategy, kind, model)
  ref_params, _, ref_losses = one_device_loops[kind]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  _assert_close(params, ref_params)
  _assert_split(params, case, kind)
  # The momentum is boxed as its parameter, so it is split alike.
  _assert_split(opt_state[0].trace, case, kind)


# --- fit ---------------------------------------------------------------------


def _fit(strategy, model):
  x, y = _data()
  trainer = jdist.Trainer(
      model, optimizer=_TX, strategy=strategy,
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True))
  history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
  return trainer, history.history["loss"]


def _fit_model(kind, case, strategy):
  model, _ = _model(kind, case)
  if kind != "nnx":
    return model
  if isinstance(strategy, jdist.ModelParallelStrategy):
    return strategy.init(model)
  with nnx.use_eager_sharding(False):  # no "model" axis to shard on
    return model()


@pytest.fixture(scope="module")
def one_device_fits(devices):
  strategy = _strategy(devices, "one_device")
  out = {}
  for kind in ("partitioned", "logical", "nnx"):
    trainer, losses = _fit(strategy, _fit_model(kind, "one_device", strategy))
    out[kind] = (_values(trainer.state.params), losses)
  return out


@pytest.mark.parametrize("case", ["data_by_model", "fsdp"])
@pytest.mark.parametrize("kind", ["partitioned", "logical", "nnx"])
def test_fit_equals_one_device_and_state_stays_split(
    devices, one_device_fits, kind, case):
  _, kwargs = _model(kind, case)
  strategy = _strategy(devices, case, **kwargs)
  trainer, losses = _fit(strategy, _fit_model(kind, case, strategy))
  ref_params, ref_losses = one_device_fits[kind]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for a, b in zip(_values(trainer.state.params), ref_params, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  _assert_split(trainer.state.params, case, kind)
  _assert_split(trainer.state.opt_state[0].trace, case, kind)
  assert trainer.train_function.num_compilations == 1


def test_fit_with_partitioned_model_runs_on_mirrored(devices, one_device_fits):
  # linen's boxes name a "model" axis that MirroredStrategy's mesh has not:
  # the trainer opens them without linen's sharding constraint.
  trainer, losses = _fit(_strategy(devices, "mirrored"), PartitionedMLP())
  ref_params, ref_losses = one_device_fits["partitioned"]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  for a, b in zip(_values(trainer.state.params), ref_params, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  kernel = trainer.state.params["Dense_0"]["kernel"]
  assert isinstance(kernel, nn.Partitioned)  # the boxes are kept
  assert kernel.value.sharding.is_fully_replicated


class CountingMLP(nn.Module):
  """PartitionedMLP that counts its training calls in a boxed collection."""

  @nn.compact
  def __call__(self, x, train: bool = False):
    count = self.variable("stats", "count",
                          nn.with_partitioning(jnp.zeros, (None,)), (1,))
    if train:
      count.value = count.value + 1
    return PartitionedMLP()(x)


def test_fit_keeps_a_boxed_collection_boxed(devices):
  trainer, _ = _fit(_strategy(devices, "mirrored"), CountingMLP())
  count = trainer.state.model_state["stats"]["count"]
  assert isinstance(count, nn.Partitioned)
  assert count.value.tolist() == [3.0]  # 48 examples, batches of 16
  assert trainer.train_function.num_compilations == 1


# --- a LayoutMap too ---------------------------------------------------------


def test_a_layout_map_key_wins_over_metadata_for_what_it_matches(devices):
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])
  layout_map = jdist.LayoutMap(mesh)
  layout_map["Dense_0/kernel"] = ("model", None)  # metadata: (None, "model")
  strategy = jdist.ModelParallelStrategy(layout_map=layout_map)
  params = strategy.init(PartitionedMLP().init, jax.random.key(0),
                         jnp.zeros((1, 8)))["params"]
  assert params["Dense_0"]["kernel"].value.sharding.spec == P("model", None)
  # What the key does not match keeps its metadata's layout.
  assert params["Dense_1"]["kernel"].value.sharding.spec == P("model", None)
  assert params["Dense_0"]["bias"].value.sharding.spec == P("model")


def test_the_mesh_is_needed_and_must_be_one(devices):
  with pytest.raises(ValueError, match=r"needs a mesh: device_mesh="):
    jdist.ModelParallelStrategy()
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])
  other = jdist.DeviceMesh((1, 4), ("data", "model"), devices[:4])
  with pytest.raises(ValueError, match=r"not the layout map's mesh"):
    jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh),
                                device_mesh=other)


# --- bad metadata: clear errors before the first step ------------------------


def _init_linen(strategy, module):
  return strategy.init(module.init, jax.random.key(0), jnp.zeros((1, 8)))


def test_an_axis_the_mesh_has_not_is_an_error(devices):
  strategy = _strategy(devices, "data_by_model")
  with pytest.raises(ValueError, match=r"'params/Dense_0/bias' of shape "
                     r"\(16,\) is partitioned by its flax metadata "
                     r"\(nn.with_partitioning\) as \('tensor',\), but "
                     r"'tensor' is not an axis of the mesh "
                     r"\('data', 'model'\)"):
    _init_linen(strategy, PartitionedMLP("tensor"))
  with pytest.raises(ValueError, match=r"'l0/bias' of shape \(16,\) is "
                     r"partitioned by its nnx out_sharding \('tensor',\), "
                     r"but 'tensor' is neither an axis of the mesh"):
    strategy.init(lambda: NnxMLP("tensor", rngs=nnx.Rngs(0)))


def test_fit_refuses_bad_metadata_before_the_first_step(devices):
  x, y = _data()
  trainer = jdist.Trainer(PartitionedMLP("tensor"), optimizer=_TX, loss="mse",
                          strategy=_strategy(devices, "data_by_model"))
  with pytest.raises(ValueError, match=r"'tensor' is not an axis of the mesh"):
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
  assert trainer.state is None


def test_a_logical_name_without_a_rule_is_replicated_with_a_warning(devices):
  # As flax's nn.logical_to_mesh_axes: no rule, no split; jdist says so.
  strategy = _strategy(devices, "data_by_model",
                       logical_axis_rules=(("embed", None),))
  with pytest.warns(UserWarning) as record:
    params = _init_linen(strategy, LogicalMLP())["params"]
  unruled = [str(r.message) for r in record
             if "No logical axis rule" in str(r.message)]
  assert len(unruled) == 1  # one warning for the tree, not one per array
  assert re.search(r"No logical axis rule maps 'mlp' \('params/Dense_0/bias', "
                   r"'params/Dense_0/kernel', 'params/Dense_1/kernel'\).*"
                   r"replicated, as flax does.*\('mlp', 'model'\)", unruled[0])
  # Nothing is split at all: that is said too, once.
  assert sum("splits no array" in str(r.message) for r in record) == 1
  assert params["Dense_0"]["kernel"].value.sharding.is_fully_replicated


def test_rules_from_flax_context_and_a_rule_to_a_missing_axis(devices):
  with nn.logical_axis_rules(_RULES):  # read when the strategy is made
    strategy = _strategy(devices, "data_by_model")
  params = _init_linen(strategy, LogicalMLP())["params"]
  assert params["Dense_0"]["kernel"].value.sharding.spec == P(None, "model")
  strategy = _strategy(devices, "data_by_model",
                       logical_axis_rules=(("mlp", "tensor"),))
  with pytest.raises(ValueError, match=r"the logical axis rule \('mlp', "
                     r"'tensor'\) maps 'mlp' to 'tensor', which is not an axis "
                     r"of the mesh"):
    _init_linen(strategy, LogicalMLP())


class NnxLogical(nnx.Module):
  def __init__(self, *, rngs):
    self.l0 = nnx.Linear(8, 16, rngs=rngs, kernel_init=nnx.with_partitioning(
        _INIT, ("embed", "mlp")))


def test_nnx_logical_names_are_mapped_by_the_rules(devices):
  # As nnx.get_partition_spec: a name a rule maps is replaced; the model is
  # built inside init, where flax's eager sharding sees the same rules.
  strategy = _strategy(devices, "data_by_model", logical_axis_rules=_RULES)
  model = strategy.init(lambda: NnxLogical(rngs=nnx.Rngs(0)))
  kernel = model.l0.kernel[...]
  assert kernel.sharding.spec == P(None, "model")
  assert _shard_shape(kernel) == (8, 8)


def test_an_axis_named_for_two_dimensions_names_the_parameter(devices):
  # JAX's DuplicateSpecError names neither the parameter nor the metadata.
  strategy = _strategy(devices, "data_by_model")
  dense = nn.Dense(8, kernel_init=nn.with_partitioning(_INIT, ("model",
                                                               "model")))
  with pytest.raises(ValueError, match=r"'params/kernel' of shape \(8, 8\): "
                     r"its layout \('model', 'model'\) names mesh axis "
                     r"'model' for dimensions 0 and 1, but an axis can split "
                     r"one dimension only.*in its flax metadata "
                     r"\(nn.with_partitioning\)"):
    _init_linen(strategy, dense)


def test_an_indivisible_dimension_names_path_shape_axis_and_size(devices):
  strategy = _strategy(devices, "data_by_model", logical_axis_rules=_RULES)
  with pytest.raises(ValueError, match=r"'params/Dense_0/bias' of shape "
                     r"\(5,\): dimension 0 \(5\) cannot be split over mesh "
                     r"axis model of size 2.*flax metadata"):
    _init_linen(strategy, LogicalMLP(features=5))
