"""jdist's tools on replicas that span devices: `assert_equivalent` proves a
ModelParallelStrategy step against one device (and catches one that is
wrong), `diagnose` splits the collectives by mesh axis, and mixed precision
trains in `fit` as on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.models import MLP

HIDDEN, CLASSES, BATCH = 16, 4, 16


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  y = x[:, :CLASSES].argmax(-1).astype(np.int32)
  return x, y


def _strategy(devices, case):
  if case == "fsdp_4":
    mesh = jdist.DeviceMesh((1, 4), ("data", "fsdp"), devices[:4])
    return jdist.ModelParallelStrategy(layout_map=jdist.LayoutMap(mesh),
                                       batch_dim_name="data", fsdp_axis="fsdp")
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])
  layout_map = jdist.LayoutMap(mesh)
  layout_map["Dense_0/kernel"] = (None, "model")  # column-split
  layout_map["Dense_0/bias"] = ("model",)
  layout_map["Dense_1/kernel"] = ("model", None)  # row-split: a sum over model
  return jdist.ModelParallelStrategy(layout_map=layout_map,
                                     batch_dim_name="data")


def _step(averaged=True, weighted_by_replica=False):
  """A classifier's train step; `averaged=False` is the classic bug (a mean
  over the replica's own examples, so N replicas sum N means);
  `weighted_by_replica` a bug no check sees before running (each replica
  weighs its loss by its id plus one)."""
  model, tx = MLP(hidden=HIDDEN, classes=CLASSES), optax.sgd(0.1, momentum=0.9)

  def step(state, batch):
    params, opt_state = state

    def loss_fn(p):
      logits = model.apply({"params": p}, batch["x"])
      losses = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                               batch["y"])
      if weighted_by_replica:
        replica = jdist.get_replica_context().replica_id_in_sync_group
        losses = losses * (1 + replica)
      return (jdist.compute_average_loss(losses) if averaged
              else jnp.mean(losses))
    loss, grads = jax.value_and_grad(loss_fn)(params)  # summed over replicas
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  x, _ = _data()
  params = model.init(jax.random.key(0), x[:1])["params"]
  return step, (params, tx.init(params))


def _batches():
  x, y = _data()
  return [{"x": x[i:i + BATCH], "y": y[i:i + BATCH]}
          for i in range(0, len(x), BATCH)]


def test_assert_equivalent_proves_a_model_parallel_step(devices):
  step, state = _step()
  trajectory = jdist.testing.assert_equivalent(
      step, state, _batches(), strategy=_strategy(devices, "tensor_2x2"),
      rtol=1e-5, atol=1e-6)
  assert len(trajectory.outputs) == 4


def test_assert_equivalent_catches_a_step_wrong_on_the_mesh(devices):
  step, state = _step(weighted_by_replica=True)
  with pytest.raises(AssertionError):
    jdist.testing.assert_equivalent(step, state, _batches(),
                                    strategy=_strategy(devices, "tensor_2x2"),
                                    rtol=1e-5, atol=1e-6)


def test_a_loss_averaged_per_replica_is_refused_under_model_parallel(devices):
  step, state = _step(averaged=False)
  with pytest.raises(jdist.LossScalingError, match="summed over the 2 replicas"):
    jdist.testing.assert_equivalent(step, state, _batches(),
                                    strategy=_strategy(devices, "tensor_2x2"))


def test_diagnose_splits_the_collectives_by_mesh_axis(devices):
  step, state = _step()
  d = jdist.diagnose(step, state, _batches(),
                     strategy=_strategy(devices, "tensor_2x2"), steps=2)
  by_axes = {axes: (count, size) for axes, count, size in
             d.multi.collectives_by_axes}
  assert set(by_axes) == {"data", "model"}, by_axes
  # Over the replicas: every gradient, each device its own shard of it.
  shard_bytes = sum(
      np.prod(p.shape) * 4 // (2 if name in ("Dense_0/kernel", "Dense_0/bias",
                                             "Dense_1/kernel") else 1)
      for name, p in (("/".join(k.key for k in path), p) for path, p in
                      jax.tree_util.tree_flatten_with_path(state[0])[0]))
  assert by_axes["data"][1] == shard_bytes
  # Over the model axis: the row-split layer's partial logits, summed.
  assert by_axes["model"][1] == (BATCH // 2) * CLASSES * 4
  assert d.multi.collective_bytes == shard_bytes + (BATCH // 2) * CLASSES * 4
  assert d.multi.num_devices == 4 and d.multi.num_replicas == 2
  text = str(d)
  assert "4 dev/2 rep" in text and "Bottleneck on 4 devices" in text
  assert "  over data" in text and "  over model" in text


def test_diagnose_runs_fsdp_with_one_replica_over_four_devices(devices):
  step, state = _step()
  d = jdist.diagnose(step, state, _batches(),
                     strategy=_strategy(devices, "fsdp_4"), steps=2)
  assert d.multi.num_replicas == 1 and d.multi.num_devices == 4
  assert [axes for axes, _, _ in d.multi.collectives_by_axes] == ["fsdp"]
  assert d.multi.collective_bytes > 0 and d.multi.collectives >= 0


def _fit(strategy, policy):
  x, y = _data()
  trainer = jdist.Trainer(
      MLP(hidden=HIDDEN, classes=CLASSES),
      optimizer=optax.sgd(0.1, momentum=0.9),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], strategy=strategy, dtype_policy=policy)
  history = trainer.fit(x, y, batch_size=BATCH, epochs=2, verbose=0).history
  return trainer, history


def test_mixed_precision_fit_on_2x2_trains_as_one_device(devices):
  policy = "mixed_float16"  # (bfloat16 alike; float16 also scales the loss)
  reference, ref_history = _fit(jdist.OneDeviceStrategy(devices[0]), policy)
  trainer, history = _fit(_strategy(devices, "tensor_2x2"), policy)
  tol = 2e-3  # half-precision matmuls over split kernels sum in another order
  np.testing.assert_allclose(history["loss"], ref_history["loss"], atol=tol)
  for a, b in zip(jax.tree.leaves(trainer.params),
                  jax.tree.leaves(reference.params)):
    assert a.dtype == jnp.float32  # the variables stay float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol)
  assert trainer.params["Dense_0"]["kernel"].sharding.spec == jax.P(None,
                                                                    "model")
  assert history["loss_scale"] == ref_history["loss_scale"]
