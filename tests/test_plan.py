"""`jdist.plan`: a step's memory, FLOPs and layout before it runs, exact
against the arrays it plans for, as a user calls it."""

import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import GPT, gpt_fsdp_strategy, gpt_layout_map

_MODEL = GPT(vocab_size=32, max_len=8, embed_dim=16, num_heads=4,
             num_layers=1, mlp_dim=64)
_BATCH = np.random.default_rng(0).integers(0, 32, (8, 9)).astype(np.int32)


def _init_params():
  return _MODEL.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]


def _train_step(tx):
  """A flax-style step over `{"params", "opt_state"}`: next-token loss, the
  optimizer's update."""
  def step(state, tokens):
    def loss_fn(p):
      logits = _MODEL.apply({"params": p}, tokens[:, :-1])
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(
              logits, tokens[:, 1:]).mean(-1))
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}, loss
  return step


def _layout(case, devices):
  if case == "mirrored+zero":
    return jdist.MirroredStrategy(devices[:4])
  if case == "fsdp":
    return gpt_fsdp_strategy(jdist.DeviceMesh((1, 4), ("data", "fsdp"),
                                              devices[:4]))
  return jdist.ModelParallelStrategy(layout_map=gpt_layout_map(
      jdist.DeviceMesh((2, 2), ("data", "model"), devices[:4])))


def _device_bytes(tree):
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


# ZeRO (ShardedOptimizer) splits mirrored training's optimizer state.
@pytest.mark.parametrize("case", ["mirrored+zero", "fsdp", "tensor"])
def test_plan_bytes_are_the_placed_arrays_and_the_program_is_the_steps(
    devices, case):
  strategy = _layout(case, devices)
  tx = optax.adam(1e-3)
  if case == "mirrored+zero":
    tx = jdist.ShardedOptimizer(tx, strategy)
  params = strategy.init(_init_params)
  opt_state = tx.init(params) if case == "mirrored+zero" else strategy.init(
      tx.init, params)
  state = {"params": params, "opt_state": opt_state}
  step = strategy.function(_train_step(tx), donate_argnums=(0,))
  warns = contextlib.nullcontext()
  if case == "tensor":  # a key that matches nothing, added after init
    strategy.layout_map["decoder/kernel"] = (None, "model")
    warns = pytest.warns(UserWarning, match="decoder/kernel")
  with warns:
    plan = jdist.plan(step, state, _BATCH, whole_above=500)

  # Arguments, by kind, are the placed arrays' blocks on a device, exactly.
  batch = next(iter(strategy.experimental_distribute_dataset([_BATCH])))
  assert plan.argument("parameters") == _device_bytes(params)
  assert plan.argument("optimizer state") == _device_bytes(opt_state)
  if case == "mirrored+zero":  # a quarter of adam's state, whole parameters
    assert 4 * plan.argument("optimizer state") < 2.1 * plan.argument(
        "parameters")
  assert plan.argument("batch") == _device_bytes(batch) > 0
  assert plan.argument("other state") == 0
  assert plan.program_argument_bytes == plan.argument_bytes
  # The peak is the compiled step's: the program its calls run.
  memory = step.lower(state, batch).compile().memory_analysis()
  assert plan.peak_bytes == (
      memory.argument_size_in_bytes + memory.output_size_in_bytes -
      memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  assert plan.alias_bytes == plan.argument_bytes - plan.argument("batch")
  new_state, loss = step(state, batch)
  assert step.num_compilations == 1  # planned, then run: compiled once
  assert plan.output_bytes == _device_bytes(new_state) + _device_bytes(
      loss.values)

  expected_axes = {"mirrored+zero": "replica", "fsdp": "fsdp",
                   "tensor": "model"}[case]
  assert expected_axes in {axes for axes, *_ in plan.collectives}
  assert plan.flops_per_device > 0 and plan.compute_dtype == "float32"
  assert plan.peak_flops_per_device is None  # a CPU: no peak, MFU n/a
  text = str(plan)
  assert "optimizer state" in text and "peak" in text
  assert json.loads(json.dumps(plan.as_dict()))["peak_bytes"] == (
      plan.peak_bytes)
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.temp_bytes = 0
  if case == "tensor":  # the layout notes
    notes = " ".join(plan.notes)
    assert "'decoder/kernel' matches no array" in notes
    assert "params/position_embed/embedding (8, 16)" in notes  # 512 B, whole
    assert "fewer than 128 elements" in notes and "mlp_in/bias" in notes


def test_a_budget_below_the_peak_raises_naming_a_layout_that_fits(devices):
  strategy = jdist.MirroredStrategy(devices[:4])
  tx = optax.adam(1e-3)
  state = jax.eval_shape(lambda: {"params": _init_params(),
                                  "opt_state": tx.init(_init_params())})
  step = strategy.function(_train_step(tx), donate_argnums=(0,))
  roomy = jdist.plan(step, state, _BATCH, memory_budget="1GB")
  assert roomy.fits and roomy.check() is roomy and not roomy.alternatives
  assert jdist.plan(step, state, _BATCH).fits is None  # CPU: no limit known

  budget = roomy.peak_bytes - 1
  tight = jdist.plan(step, state, _BATCH, memory_budget=budget)
  assert tight.fits is False
  with pytest.raises(jdist.MemoryBudgetError) as raised:
    tight.check()
  named = tight.alternatives[-1]
  message = str(raised.value)
  assert named.name in message and "FSDP over 'fsdp'" in message
  assert "optimizer state" in message and "memory_budget" in message
  assert named.plan.fits and named.plan.peak_bytes <= budget
  assert named.plan.state_bytes < tight.state_bytes
  # The named layout, planned on its own, fits the same budget.
  again = jdist.plan(step, state, _BATCH, strategy=named.strategy,
                     memory_budget=budget)
  assert again.fits and again.peak_bytes == named.plan.peak_bytes


def test_the_gpts_flops_from_the_program_and_from_the_model_agree(devices):
  # make bench's GPT, one block: XLA's count of the compiled step (every
  # FLOP of the program: the masked half of causal attention, layer norms,
  # softmax, adam) against the model's count of its matrix products.
  model = GPT(vocab_size=256, max_len=64, embed_dim=128, num_heads=4,
              num_layers=1, mlp_dim=512)
  tx = optax.adam(1e-3)

  def step(state, tokens):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return jdist.compute_average_loss(
          optax.softmax_cross_entropy_with_integer_labels(
              logits, tokens[:, 1:]).mean(-1))
    loss, grads = jax.value_and_grad(loss_fn)(state[0])
    updates, opt_state = tx.update(grads, state[1], state[0])
    return (optax.apply_updates(state[0], updates), opt_state), loss

  def init():
    params = model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))
    return params["params"], tx.init(params["params"])

  batch = jax.ShapeDtypeStruct((4, 65), jnp.int32)
  plan = jdist.plan(step, jax.eval_shape(init), batch,
                    strategy=jdist.OneDeviceStrategy(devices[0]),
                    model_flops=model.train_flops((4, 64)))
  assert plan.flops == pytest.approx(plan.model_flops, rel=0.10)
  assert plan.flops > plan.model_flops  # the program counts more, never less
  # A bare (params, opt_state) tuple: optax's state is optimizer state
  # (adam's two moments and its int32 count).
  assert plan.argument("optimizer state") == 2 * plan.argument(
      "parameters") + 4
  # Throughput: the compiled FLOPs over the time; MFU counts the model's
  # and needs a peak (none on CPU).
  on_cpu = plan.throughput(0.5)
  assert on_cpu.flops_per_second == plan.flops / 0.5 and on_cpu.mfu is None
  assert "MFU n/a" in str(on_cpu)
  a100 = dataclasses.replace(plan, peak_flops_per_device=312e12)
  assert a100.throughput(0.5).mfu == pytest.approx(
      plan.model_flops / 0.5 / 312e12)


# --- the Trainer: trainer.plan, fit's check before the first step, its logs --


def _gpt_trainer(devices, **kwargs):
  return jdist.Trainer(
      _MODEL, optimizer=optax.adam(1e-3),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      strategy=jdist.MirroredStrategy(devices[:2]), **kwargs)


_TOKENS = np.random.default_rng(1).integers(0, 32, (64, 9)).astype(np.int32)
_X, _Y = _TOKENS[:, :-1], _TOKENS[:, 1:]


class _Steps(jdist.Callback):
  """Records every step and every fit that began."""

  def __init__(self):
    super().__init__()
    self.calls = []

  def on_train_begin(self, logs=None):
    self.calls.append("train_begin")

  def on_train_batch_begin(self, batch, logs=None):
    self.calls.append(batch)


def test_trainer_plans_fits_step_and_fit_reports_its_throughput(
    devices, capsys):
  trainer = _gpt_trainer(devices)
  plan = trainer.plan(_X, _Y, batch_size=16)
  assert trainer.state is None  # planned from the state's shapes: built nothing
  assert plan.model_flops == _MODEL.train_flops((16, 8))  # the GPT's count
  assert plan.argument("batch") > 0 and plan.argument("other state") > 0
  assert "over replica: all-reduce" in str(plan)
  trainer.fit(_X, _Y, batch_size=16, epochs=2, verbose=2)
  # The plan compiled the program fit's first step ran: it compiled once.
  assert trainer.train_function.num_compilations == 1
  params = trainer.state.params
  assert plan.argument("parameters") == _device_bytes(params)
  assert plan.argument("optimizer state") == _device_bytes(
      trainer.state.opt_state)
  lines = [l for l in capsys.readouterr().out.splitlines()
           if l.startswith("Epoch")]
  assert len(lines) == 2 and all(
      "FLOP/s per device, MFU n/a" in l for l in lines), lines


def test_fit_over_its_memory_budget_raises_before_anything_runs(devices):
  roomy = _gpt_trainer(devices).plan(_X, _Y, batch_size=16)
  budget = roomy.peak_bytes - 1
  trainer = _gpt_trainer(devices, memory_budget=budget)
  steps = _Steps()
  with pytest.raises(jdist.MemoryBudgetError) as raised:
    trainer.fit(_X, _Y, batch_size=16, epochs=1, callbacks=[steps],
                verbose=0)
  # Before anything ran: no state was built, no callback called, no step.
  assert trainer.state is None and steps.calls == [] and (
      trainer.global_step == 0)
  message = str(raised.value)
  assert ("What fits (compiled and planned): the optimizer state split over "
          "the 2 replicas (ZeRO)") in message
  assert "jdist.Trainer(..., shard_optimizer_state=True)" in message
  # The layout the error names (ZeRO) fits the budget: its fit runs.
  zero = _gpt_trainer(devices, memory_budget=budget,
                      shard_optimizer_state=True)
  assert zero.plan(_X, _Y, batch_size=16).fits
  zero.fit(_X, _Y, batch_size=16, epochs=1, callbacks=[steps], verbose=0)
  assert steps.calls[:2] == ["train_begin", 0] and zero.global_step == 4
