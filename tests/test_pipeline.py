"""Pipeline parallelism: `jdist.pipeline` under
`ModelParallelStrategy(pipeline_axis=...)` trains as one device does, with
tensor parallelism, FSDP, data parallelism, circular schedules and remat,
in custom loops and in `fit`, with checkpoints moved between stage counts;
bad setups fail before the first step."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
import jdist.testing
from jdist.examples.models import GPT, gpt_layout_map

from conftest import xla_flags

_TOL = 1e-5
_LAYERS, _WIDTH, _CLASSES = 4, 16, 4


def _layer(w, h):
  return jnp.tanh(h @ w["kernel"] + w["bias"])


def _params():
  rng = np.random.default_rng(0)
  normal = lambda *shape: (rng.normal(size=shape) * 0.4).astype(np.float32)
  return {"embed": normal(8, _WIDTH), "head": normal(_WIDTH, _CLASSES),
          "layers": {"kernel": normal(_LAYERS, _WIDTH, _WIDTH),
                     "bias": normal(_LAYERS, _WIDTH)}}


def _apply(params, x):
  h = jdist.pipeline(_layer, params["layers"], x @ params["embed"])
  return h @ params["head"]


def _step(params, batch):
  x, y = batch

  def loss_fn(p):
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        _apply(p, x), y)
    return jdist.compute_average_loss(per_example)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree.map(lambda p, g: p - 0.2 * g, params, grads), loss


def _batches(n=3, rows=8):
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(rows, 8)).astype(np.float32),
           rng.integers(0, _CLASSES, rows).astype(np.int32))
          for _ in range(n)]


def _strategy(devices, shape, names=("data", "stage", "model"), **options):
  mesh = jdist.DeviceMesh(shape, names, devices[:np.prod(shape)])
  layout_map = jdist.LayoutMap(mesh)
  inner = "model" if "model" in names else None
  layout_map["layers/kernel"] = ("stage", None, inner)
  layout_map["layers/bias"] = ("stage", inner)
  return jdist.ModelParallelStrategy(
      layout_map=layout_map, pipeline_axis="stage",
      fsdp_axis="fsdp" if "fsdp" in names else None, **options)


@pytest.mark.parametrize("case", [
    "gpipe_with_tensor_parallel", "circular_with_data_parallel",
    "remat_with_fsdp"])
def test_pipelined_steps_equal_one_device(devices, case):
  strategy = {
      "gpipe_with_tensor_parallel": lambda: _strategy(
          devices, (1, 2, 2), num_microbatches=4),
      "circular_with_data_parallel": lambda: _strategy(
          devices, (2, 2, 1), num_microbatches=2, num_repeats=2),
      "remat_with_fsdp": lambda: _strategy(
          devices, (1, 2, 2), ("data", "stage", "fsdp"), num_microbatches=2,
          pipeline_remat=True),
  }[case]()
  jdist.testing.assert_equivalent(_step, _params(), _batches(),
                                  strategy=strategy, rtol=1e-5, atol=1e-6)


def test_diagnose_counts_the_collectives_over_the_stages(devices):
  d = jdist.diagnose(_step, _params(), _batches(),
                     strategy=_strategy(devices, (1, 2, 2),
                                        num_microbatches=2), steps=1)
  by_axes = {axes: (count, size) for axes, count, size in
             d.multi.collectives_by_axes}
  # The activations passed on and summed over the stages, and tensor
  # parallelism's sums over "model": every collective has its axis.
  assert set(by_axes) == {"stage", "model"}, by_axes
  assert "  over stage" in str(d)


def test_the_plan_reads_the_pipelines_layout(devices):
  strategy = _strategy(devices, (1, 2, 2), num_microbatches=2)
  params = strategy.init(_params)
  step = strategy.function(_step)
  plan = jdist.plan(step, params, _batches(1)[0])
  # The stacked layers split over stage x model: each device holds a quarter
  # of them, and the plan counts exactly the placed blocks.
  held = sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(params))
  assert plan.argument("parameters") == held
  assert held < sum(x.nbytes for x in jax.tree.leaves(_params())) / 2
  batch = next(iter(strategy.experimental_distribute_dataset(_batches(1))))
  memory = step.lower(params, batch).compile().memory_analysis()
  assert plan.peak_bytes == (
      memory.argument_size_in_bytes + memory.output_size_in_bytes -
      memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  # The stages' hand-offs and sums are read from the compiled program.
  text = str(plan)
  assert "pipeline_axis='stage', num_microbatches=2" in text, text
  assert "over stage: collective-permute" in text, text


def test_bad_pipelines_fail_before_the_first_step(devices):
  mesh = jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])
  with pytest.raises(ValueError, match="pipeline_axis names the mesh axis "
                     "'stage', but the mesh's axes are \\('data', 'model'\\)"):
    jdist.ModelParallelStrategy(device_mesh=mesh, pipeline_axis="stage")
  with pytest.raises(ValueError, match="give the mesh axis of its stages"):
    jdist.ModelParallelStrategy(device_mesh=mesh, num_microbatches=4)
  with pytest.raises(ValueError, match="also the batch or FSDP axis"):
    jdist.ModelParallelStrategy(device_mesh=mesh, pipeline_axis="data")
  with pytest.raises(ValueError, match="needs at least as many microbatches"):
    _strategy(devices, (1, 4, 1), num_microbatches=2, num_repeats=2)
  with pytest.warns(UserWarning, match=r"idles 3 of the loop's 5 iterations "
                    r"\(60% of the step is bubble\)"):
    _strategy(devices, (1, 4, 1), num_microbatches=2)

  params = _params()
  strategy = _strategy(devices, (2, 2, 1), num_microbatches=2, num_repeats=4)
  step = strategy.function(_step)
  with pytest.raises(jdist.DistributionError, match=r"4 stacked layers, which"
                     r" do not split over 2 stages x 4 repeats"):
    step(strategy.init(lambda: params), next(iter(
        strategy.experimental_distribute_dataset(_batches(1)))))
  strategy = _strategy(devices, (2, 2, 1), num_microbatches=4)
  step = strategy.function(_step)
  with pytest.raises(jdist.DistributionError, match=r"batch of 2 rows, which "
                     r"does not split into num_microbatches=4 .* multiple of "
                     r"replicas x num_microbatches = 2 x 4 = 8"):
    step(strategy.init(lambda: params), next(iter(
        strategy.experimental_distribute_dataset(_batches(1, rows=4)))))
  with pytest.raises(jdist.DistributionError, match="shaped as it takes them"):
    jdist.pipeline(lambda w, h: h[:, :2], params["layers"], jnp.ones((2, 16)))


# --- the example GPT in fit: checkpoints across stage counts ----------------

_GPT = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=2,
           num_layers=4, mlp_dim=32, stacked=True)


def _tokens():
  tokens = np.random.default_rng(0).integers(0, 32, (32, 9)).astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def _trainer(strategy, **options):
  return jdist.Trainer(
      _GPT, optimizer=optax.sgd(0.1, momentum=0.9),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy"], strategy=strategy, **options)


def _gpt_strategy(devices, shape, **options):
  mesh = jdist.DeviceMesh(shape, ("data", "stage", "model"),
                          devices[:np.prod(shape)])
  return jdist.ModelParallelStrategy(
      layout_map=gpt_layout_map(mesh, stage_axis="stage"),
      pipeline_axis="stage", **options)


def _assert_same_params(params, reference):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(reference)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=_TOL,
                               err_msg=jax.tree_util.keystr(path))


def test_fit_saves_on_2_stages_and_resumes_on_4_then_loads_anywhere(
    devices, tmp_path):
  x, y = _tokens()
  kwargs = dict(batch_size=8, verbose=0)
  reference = _trainer(jdist.OneDeviceStrategy(devices[0]))
  expected = reference.fit(x, y, epochs=2, validation_data=(x, y),
                           **kwargs).history

  two = _trainer(_gpt_strategy(devices, (2, 2, 1), num_microbatches=2))
  first = two.fit(x, y, epochs=1, validation_data=(x, y), callbacks=[
      jdist.ModelCheckpoint(tmp_path)], **kwargs).history
  for key, value in first.items():
    np.testing.assert_allclose(value, expected[key][:1], atol=_TOL,
                               err_msg=key)
  query = two.params["blocks"]["attn"]["query"]["kernel"]
  assert query.addressable_shards[0].data.shape[0] == _GPT.num_layers // 2

  # On 4 stages: the checkpoint reshards, the fit goes on exactly.
  four = _trainer(_gpt_strategy(devices, (1, 4, 1), num_microbatches=4))
  four.build(x)
  assert four.load_checkpoint(tmp_path) == 4
  second = four.fit(x, y, epochs=2, initial_epoch=1, **kwargs).history
  np.testing.assert_allclose(second["loss"], expected["loss"][1:], atol=_TOL)
  _assert_same_params(four.params, reference.params)
  assert four.train_function.num_compilations == 1

  # No pipeline, and one device: the same call runs the blocks in turn (the
  # one device's trainer is the reference, built already).
  loader = _trainer(jdist.MirroredStrategy(devices[:4]))
  loader.build(x)
  for trainer in (loader, reference):
    assert trainer.load_checkpoint(tmp_path) == 4
    _assert_same_params(trainer.params, two.params)


# --- 8 devices: the meshes, in a process of their own -----------------

_EIGHT_DEVICES = textwrap.dedent("""
    import json, sys
    import jax, numpy as np, optax
    import jdist
    from jdist.examples.models import GPT, gpt_layout_map

    model = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=2,
                num_layers=8, mlp_dim=32, stacked=True)
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state, tokens):
      def loss_fn(p):
        logits = model.apply({"params": p}, tokens[:, :-1])
        per = optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens[:, 1:]).mean(-1)
        return jdist.compute_average_loss(per)
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 32, (8, 9)).astype(np.int32)
               for _ in range(int(sys.argv[1]))]

    def train(strategy):
      params = strategy.init(lambda: model.init(
          jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
      opt_state = strategy.init(tx.init, params)
      step_fn = strategy.function(step)
      for tokens in strategy.experimental_distribute_dataset(batches):
        params, opt_state, loss = step_fn(params, opt_state, tokens)
      return params, float(strategy.reduce("sum", loss))

    reference, ref_loss = train(jdist.OneDeviceStrategy())
    out = {}
    for shape, m, v in [((2, 2, 2), 2, 1), ((1, 4, 2), 4, 2),
                        ((1, 8, 1), 8, 1)]:
      mesh = jdist.DeviceMesh(shape, ("data", "stage", "model"))
      strategy = jdist.ModelParallelStrategy(
          layout_map=gpt_layout_map(mesh, stage_axis="stage"),
          pipeline_axis="stage", num_microbatches=m, num_repeats=v)
      params, loss = train(strategy)
      query = params["blocks"]["attn"]["query"]["kernel"]
      out[str(shape)] = {
          "params": max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                        for a, b in zip(jax.tree.leaves(params),
                                        jax.tree.leaves(reference))),
          "loss": abs(loss - ref_loss),
          "block": list(query.addressable_shards[0].data.shape)}
    print(json.dumps(out))
""")


@pytest.mark.multiprocess
def test_the_gpt_trains_on_8_devices_as_on_one(tmp_path):
  script = tmp_path / "eight.py"
  script.write_text(_EIGHT_DEVICES)
  env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu")
  # Two steps: the second applies the momentum the first left. Each step of
  # 8 devices' collectives on a 2-core machine costs seconds of waiting.
  proc = subprocess.run([sys.executable, str(script), "2"], env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  for shape, result in out.items():
    assert result["params"] < _TOL and result["loss"] < _TOL, (shape, result)
  # Each stage holds its blocks: 8 / 2, 8 / 4 and 8 / 8 of them; heads
  # split over "model" where it has 2 devices.
  assert out["(2, 2, 2)"]["block"] == [4, 16, 1, 8]
  assert out["(1, 4, 2)"]["block"] == [2, 16, 1, 8]
  assert out["(1, 8, 1)"]["block"] == [1, 16, 2, 8]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fit_with_accumulation_zero_and_mixed_precision(devices, policy):
  # Two batches per optimizer step, the momentum split over the replicas
  # (ZeRO), under fit: as one device accumulating alike; in bfloat16, as
  # close as bfloat16's rounding of a sum in another order allows.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 8)).astype(np.float32)
  y = rng.integers(0, _CLASSES, 32).astype(np.int32)

  def fit(strategy, **options):
    trainer = jdist.Trainer(
        _apply, params=_params(), optimizer=optax.sgd(0.1, momentum=0.9),
        loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
        strategy=strategy, gradient_accumulation_steps=2,
        dtype_policy=policy, **options)
    history = trainer.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    return trainer, history["loss"]

  reference, expected = fit(jdist.OneDeviceStrategy(devices[0]))
  trainer, losses = fit(_strategy(devices, (2, 2, 1), num_microbatches=2),
                        shard_optimizer_state=True)
  assert isinstance(trainer.state.opt_state, jdist.Sharded)
  tol = _TOL if policy == "float32" else 5e-3
  np.testing.assert_allclose(losses, expected, atol=tol)
  for a, b in zip(jax.tree.leaves(trainer.params),
                  jax.tree.leaves(reference.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol)
