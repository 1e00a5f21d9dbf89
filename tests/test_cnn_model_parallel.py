"""The seed CNN under tensor parallelism and FSDP, in `Trainer.fit`: every
mesh trains as one device does (the GPT's custom loop is
test_gpt_model_parallel.py)."""

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import CNN

# float32 on both sides: the split convolutions and matmuls sum in another
# order than one device does, and 10 steps of momentum carry it (the largest
# difference seen: 2.6e-5 on a kernel entry of 0.026, on 1x4; a wrong
# gradient scale moves the weights by 1e-2).
_TOL = 1e-4


def _layout_map(mesh):
  """Megatron's pattern on the CNN: each convolution's output channels over
  "model", the first dense layer's input rows (the flattened channels) over
  "model", the last dense layer whole."""
  layout = jdist.LayoutMap(mesh)
  layout["Conv_.*/kernel"] = (None, None, None, "model")
  layout["Conv_.*/bias"] = ("model",)
  layout["Dense_0/kernel"] = ("model", None)
  return layout


def _strategy(devices, case):
  shape = (2, 2) if case.endswith("2x2") else (1, 4)
  if "fsdp" in case:
    mesh = jdist.DeviceMesh(shape, ("data", "fsdp"), devices[:4])
    return jdist.ModelParallelStrategy(device_mesh=mesh, fsdp_axis="fsdp",
                                       batch_dim_name="data")
  mesh = jdist.DeviceMesh(shape, ("data", "model"), devices[:4])
  return jdist.ModelParallelStrategy(layout_map=_layout_map(mesh),
                                     batch_dim_name="data")


def _fit(strategy, digits):
  x, y = digits
  with strategy.scope():
    trainer = jdist.Trainer(
        CNN(), optimizer=optax.sgd(0.05, momentum=0.9),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], seed=0)
  # 4 batches of 64 and a last one of 36 (padded and masked on every mesh).
  history = trainer.fit(x[:292], y[:292], batch_size=64, epochs=2,
                        shuffle=True, verbose=0)
  return trainer, history.history


@pytest.fixture(scope="module")
def one_device_fit(devices, digits):
  return _fit(jdist.OneDeviceStrategy(devices[0]), digits)


@pytest.mark.parametrize("case", ["tensor_1x4", "data_by_tensor_2x2",
                                  "fsdp_4", "data_by_fsdp_2x2"])
def test_cnn_fits_as_one_device(devices, digits, one_device_fit, case):
  trainer, history = _fit(_strategy(devices, case), digits)
  ref, ref_history = one_device_fit
  np.testing.assert_allclose(history["loss"], ref_history["loss"], atol=_TOL)
  assert history["accuracy"] == ref_history["accuracy"]
  assert history["loss"][-1] < history["loss"][0]
  got = jax.tree_util.tree_flatten_with_path(trainer.params)[0]
  for (path, a), b in zip(got, jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=_TOL,
                               err_msg=jax.tree_util.keystr(path))
  # Held split: the second convolution's kernel over 4 or 2 devices.
  kernel = trainer.params["Conv_1"]["kernel"]
  split = 4 if case in ("tensor_1x4", "fsdp_4") else 2
  assert kernel.addressable_shards[0].data.size == kernel.size // split
