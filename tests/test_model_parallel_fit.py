"""jdist.Trainer under ModelParallelStrategy: fit, evaluate, predict and
checkpoints equal one device, with the state born and kept in its layout."""

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import Interrupt

# float32 on both sides; the sums run in another order over split kernels.
_TOL = 1e-5


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  y = (x[:, :4].argmax(-1)).astype(np.int32)
  return x, y


def _trainer(strategy, optimizer=None, **options):
  return jdist.Trainer(
      MLP(hidden=16, classes=4),
      optimizer=optimizer or optax.sgd(0.1, momentum=0.9),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], strategy=strategy, **options)


def _tensor_parallel(mesh):
  # Keys name the parameters' own paths: the train state's
  # "params/Dense_0/kernel" and the momentum's copies match them by tail.
  layout_map = jdist.LayoutMap(mesh)
  layout_map["Dense_0/kernel"] = (None, "model")
  layout_map["Dense_0/bias"] = ("model",)
  layout_map["Dense_1/kernel"] = ("model", None)
  return layout_map


def _strategy(devices, case):
  if case == "one_device":
    return jdist.OneDeviceStrategy(devices[0])
  if case == "fsdp_4":
    mesh = jdist.DeviceMesh((1, 4), ("data", "fsdp"), devices[:4])
    return jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh),
                                       batch_dim_name="data", fsdp_axis="fsdp")
  shape = {"tensor_2x2": (2, 2), "tensor_1x4": (1, 4)}[case]
  mesh = jdist.DeviceMesh(shape, ("data", "model"), devices[:4])
  return jdist.ModelParallelStrategy(layout_map=_tensor_parallel(mesh),
                                     batch_dim_name="data")


def _fit(strategy, callbacks=(), **options):
  x, y = _data()
  trainer = _trainer(strategy, **options)
  history = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0,
                        validation_data=(x[:32], y[:32]), callbacks=callbacks)
  return trainer, {
      "history": history.history,
      "params": jax.tree.map(np.asarray, trainer.params),
      "evaluate": trainer.evaluate(x, y, batch_size=16, verbose=0),
      "predict": np.asarray(trainer.predict(x[:24], batch_size=8, verbose=0)),
  }


def _assert_equal(run, reference):
  for key, ref in reference["history"].items():
    np.testing.assert_allclose(run["history"][key], ref, atol=_TOL, err_msg=key)
  for key, ref in reference["evaluate"].items():
    np.testing.assert_allclose(run["evaluate"][key], ref, atol=_TOL,
                               err_msg=key)
  np.testing.assert_allclose(run["predict"], reference["predict"], atol=_TOL)
  _assert_same_params(run["params"], reference["params"])


def _assert_same_params(params, reference):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=_TOL,
                               err_msg=jax.tree_util.keystr(path))


def _shard_shape(x):
  return x.addressable_shards[0].data.shape


@pytest.fixture(scope="module")
def one_device_run(devices):
  return _fit(_strategy(devices, "one_device"))[1]


@pytest.fixture(scope="module")
def tensor_2x2_fit(devices, tmp_path_factory):
  directory = tmp_path_factory.mktemp("ckpt_2x2")
  trainer, run = _fit(_strategy(devices, "tensor_2x2"),
                      callbacks=[jdist.ModelCheckpoint(directory,
                                                       monitor="loss")])
  return trainer, run, directory


def test_fit_on_2x2_data_by_model_equals_one_device(tensor_2x2_fit,
                                                    one_device_run):
  trainer, run, _ = tensor_2x2_fit
  assert trainer.strategy.num_replicas_in_sync == 2
  _assert_equal(run, one_device_run)
  state = trainer.state
  # Trained state kept in its layout: the kernels and their momentum halved.
  params, trace = state.params, state.opt_state[0].trace
  assert params["Dense_0"]["kernel"].sharding.spec == jax.P(None, "model")
  assert _shard_shape(params["Dense_0"]["kernel"]) == (8, 8)
  assert _shard_shape(params["Dense_0"]["bias"]) == (8,)
  assert _shard_shape(params["Dense_1"]["kernel"]) == (8, 4)
  assert _shard_shape(trace["Dense_0"]["kernel"]) == (8, 8)
  assert _shard_shape(trace["Dense_1"]["kernel"]) == (8, 4)
  assert trainer.train_function.num_compilations == 1


def test_fit_on_4_fsdp_equals_one_device(devices, one_device_run):
  trainer, run = _fit(_strategy(devices, "fsdp_4"))
  assert trainer.strategy.num_replicas_in_sync == 1
  _assert_equal(run, one_device_run)
  params = trainer.state.params
  assert _shard_shape(params["Dense_0"]["kernel"]) == (8, 4)
  assert _shard_shape(params["Dense_0"]["bias"]) == (4,)
  assert _shard_shape(params["Dense_1"]["kernel"]) == (4, 4)
  trace = trainer.state.opt_state[0].trace
  assert _shard_shape(trace["Dense_1"]["kernel"]) == (4, 4)
  # A batch the 4 devices of the replica cannot share: refused before a step
  # runs, the error naming the option that pads it.
  x, y = _data()
  with pytest.raises(ValueError, match=r"global batch of 6 examples cannot "
                     r"split evenly over 4 parts \(1 replicas x 4 devices of "
                     r"'fsdp'\).* Or pass pad_to_replicas=True to jdist.Trainer"):
    trainer.fit(x, y, batch_size=6, epochs=1, verbose=0)
  assert trainer.state.step == 8  # 2 epochs of 4 steps, and none since


@pytest.mark.parametrize("options", [{"steps_per_execution": 2},
                                     {"gradient_accumulation_steps": 2}],
                         ids=["steps_per_execution", "accumulation"])
def test_fsdp_4_composes_with_grouped_steps_and_accumulation(
    devices, one_device_run, options):
  # A group of steps is (replicas, steps, b, ...): FSDP splits axis 2.
  _, run = _fit(_strategy(devices, "fsdp_4"), **options)
  # Grouped steps train as single ones; accumulation (Keras's meaning: two
  # batches per optimizer step) as one device accumulating alike.
  reference = (one_device_run if "steps_per_execution" in options else
               _fit(_strategy(devices, "one_device"), **options)[1])
  _assert_equal(run, reference)


def test_state_is_born_in_its_layout_and_adam_moments_follow_it(devices):
  # mu and nu are laid out as their parameter, with no key naming them.
  strategy = _strategy(devices, "tensor_2x2")
  trainer = _trainer(strategy, optimizer=optax.adam(1e-3))
  state = trainer.build(_data()[0])
  adam = state.opt_state[0]
  for tree in (state.params, adam.mu, adam.nu):
    kernel = tree["Dense_0"]["kernel"]
    assert kernel.sharding.spec == jax.P(None, "model")
    assert _shard_shape(kernel) == (8, 8)
    assert _shard_shape(tree["Dense_1"]["kernel"]) == (8, 4)
    assert tree["Dense_1"]["bias"].sharding.is_fully_replicated


@pytest.mark.parametrize("case", ["tensor_1x4", "one_device"])
def test_a_checkpoint_from_2x2_restores_onto_another_mesh(
    devices, tensor_2x2_fit, case):
  saved, _, directory = tensor_2x2_fit
  trainer = _trainer(_strategy(devices, case))
  trainer.build(_data()[0])
  assert trainer.load_checkpoint(directory) == saved.global_step
  _assert_same_params(trainer.params, saved.params)
  _assert_same_params(trainer.state.opt_state, saved.state.opt_state)
  if case == "tensor_1x4":
    kernel = trainer.state.params["Dense_0"]["kernel"]
    assert _shard_shape(kernel) == (8, 4)
    assert _shard_shape(trainer.state.opt_state[0].trace["Dense_0"]
                        ["kernel"]) == (8, 4)


def test_a_fit_interrupted_on_2x2_resumes_on_1x4_as_one_device_ran(
    devices, one_device_run, tmp_path):
  # BackupAndRestore: the 2x2 run dies at step 6 of 8; its backup (step 4)
  # restores into the 1x4 trainer's layout, which ends where one device did.
  x, y = _data()
  kwargs = dict(batch_size=16, epochs=2, verbose=0,
                validation_data=(x[:32], y[:32]))
  crashed = _trainer(_strategy(devices, "tensor_2x2"))
  with pytest.raises(KeyboardInterrupt):
    crashed.fit(x, y, callbacks=[Interrupt(6), jdist.BackupAndRestore(
        tmp_path, save_freq=2)], **kwargs)
  backup = jdist.BackupAndRestore(tmp_path, save_freq=2)
  resumed = _trainer(_strategy(devices, "tensor_1x4"))
  history = resumed.fit(x, y, callbacks=[backup], **kwargs)
  assert backup.restored_step == 4 and resumed.global_step == 8
  kernel = resumed.state.params["Dense_0"]["kernel"]
  assert _shard_shape(kernel) == (8, 4)
  _assert_same_params(resumed.params, one_device_run["params"])
  np.testing.assert_allclose(history.history["loss"][-1],
                             one_device_run["history"]["loss"][-1], atol=_TOL)


@pytest.fixture(scope="module")
def sharded_2x2_fit(devices, tmp_path_factory):
  """Trained on 2x2 with the optimizer state split over "data" as well."""
  directory = tmp_path_factory.mktemp("ckpt_2x2_sharded")
  x, y = _data()
  trainer = _trainer(_strategy(devices, "tensor_2x2"),
                     shard_optimizer_state=True)
  history = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
      jdist.ModelCheckpoint(directory, monitor="loss")])
  return trainer, history.history, directory


def test_fit_on_2x2_with_sharded_optimizer_state_equals_one_device(
    sharded_2x2_fit, one_device_run):
  trainer, history, _ = sharded_2x2_fit
  for key in ("loss", "accuracy"):
    np.testing.assert_allclose(history[key], one_device_run["history"][key],
                               atol=_TOL, err_msg=key)
  _assert_same_params(jax.tree.map(np.asarray, trainer.params),
                      one_device_run["params"])
  assert trainer.train_function.num_compilations == 1
  # The momentum: over "model" as its parameter, over "data" on top (its
  # first dimension both divide): a quarter of each kernel on a device.
  trace = trainer.state.opt_state.value[0].trace
  kernel_0, kernel_1 = trace["Dense_0"]["kernel"], trace["Dense_1"]["kernel"]
  assert kernel_0.sharding.spec == jax.P("data", "model")
  assert (kernel_0.shape, _shard_shape(kernel_0)) == ((8, 16), (4, 8))
  assert (kernel_1.shape, _shard_shape(kernel_1)) == ((16, 4), (4, 4))
  assert _shard_shape(trace["Dense_0"]["bias"]) == (4,)
  assert _shard_shape(trace["Dense_1"]["bias"]) == (2,)


@pytest.mark.parametrize("saved_sharded", [True, False],
                         ids=["sharded_into_mirrored", "mirrored_into_sharded"])
def test_sharded_and_mirrored_checkpoints_on_2x2_load_into_each_other(
    devices, sharded_2x2_fit, tensor_2x2_fit, saved_sharded):
  saved, _, directory = (sharded_2x2_fit if saved_sharded else
                         tensor_2x2_fit)
  loader = _trainer(_strategy(devices, "tensor_2x2"),
                    shard_optimizer_state=not saved_sharded)
  loader.build(_data()[0])
  assert loader.load_checkpoint(directory) == saved.global_step
  unwrap = lambda s: s.value if isinstance(s, jdist.Sharded) else s
  _assert_same_params(loader.params, saved.params)
  _assert_same_params(unwrap(loader.state.opt_state),
                      unwrap(saved.state.opt_state))
  assert isinstance(loader.state.opt_state, jdist.Sharded) == (
      not saved_sharded)
  kernel = unwrap(loader.state.opt_state)[0].trace["Dense_0"]["kernel"]
  assert _shard_shape(kernel) == ((8, 8) if saved_sharded else (4, 8))
