"""`jdist.diagnose` names where a loop's time goes, as a user calls it."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist


def linear_step(w, batch):
  def loss_fn(w):
    return jdist.compute_average_loss((batch["x"] @ w - batch["y"]) ** 2)
  loss, grad = jax.value_and_grad(loss_fn)(w)
  return w - 0.1 * grad, loss


def linear_batches(n, size=32):
  rng = np.random.default_rng(0)
  return [{"x": rng.normal(size=(size, 8)).astype(np.float32),
           "y": rng.normal(size=(size,)).astype(np.float32)} for _ in range(n)]


class SlowReader:
  """A dataset whose every batch takes 20 ms to read (decoding, a disk)."""

  def __init__(self, data):
    self.data = data

  def __iter__(self):
    for batch in self.data:
      time.sleep(0.02)
      yield batch


def test_an_input_bound_loop_is_named_input_bound():
  d = jdist.diagnose(linear_step, jnp.zeros(8), SlowReader(linear_batches(4)),
                     num_replicas=2, steps=4)
  assert d.bottleneck == "input"
  assert d.multi.input_wait > 0.5 * d.multi.step > 0.005
  assert d.single.num_replicas == 1 and d.multi.num_replicas == 2
  assert d.global_batch == 32 and d.steps == 4
  text = str(d)
  assert "Bottleneck on 2 devices: input" in text and "prefetch" in d.fix
  assert "input wait" in text and "collectives" in text
  parts = (d.multi.input_wait + d.multi.compute + d.multi.collectives +
           d.multi.dispatch)
  assert parts == pytest.approx(d.multi.step, rel=1e-6)
  with pytest.raises(dataclasses.FrozenInstanceError):
    d.bottleneck = "compute"


def deep_step(w, batch):
  """Little to reduce (a 128x128 matrix), much to compute (40 layers)."""
  def loss_fn(w):
    h = batch
    for _ in range(40):
      h = jnp.tanh(h @ w)
    return jdist.compute_average_loss(jnp.sum(h ** 2, axis=1))
  loss, grad = jax.value_and_grad(loss_fn)(w)
  return w - 0.01 * grad, loss


def test_a_compute_bound_step_is_not_called_input_bound(devices):
  strategy = jdist.MirroredStrategy(devices[:2])
  rng = np.random.default_rng(0)
  data = [rng.normal(size=(256, 128)).astype(np.float32) for _ in range(3)]
  w = jnp.asarray(rng.normal(size=(128, 128)) / 12, jnp.float32)
  # A jdist step brings its own strategy.
  d = jdist.diagnose(strategy.function(deep_step), w, data, steps=3)
  assert d.multi.num_replicas == 2
  assert d.bottleneck == "compute", str(d)
  assert d.multi.compute > d.multi.input_wait
  assert sum(getattr(d.multi, p) for p in ("input_wait", "compute",
             "collectives", "dispatch")) == pytest.approx(d.multi.step)
  assert d.multi.collective_bytes >= 128 * 128 * 4  # at least the gradient
  assert d.single.collectives == 0 < d.multi.collectives


def test_batches_that_change_shape_are_named_recompilation():
  def step(w, batch):
    return w + jdist.compute_average_loss(jnp.sum(batch ** 2, axis=1)), ()
  data = [np.ones((8, k), np.float32) for k in (2, 3, 4)]
  d = jdist.diagnose(step, jnp.zeros(()), data, num_replicas=2, steps=3)
  assert d.bottleneck == "recompilation"
  assert d.multi.recompilations >= 2
  assert "pad to a fixed size" in d.fix


def test_a_callback_to_python_in_the_step_is_counted():
  def step(w, batch):
    jax.debug.callback(lambda x: None, batch)
    return linear_step(w, batch)
  d = jdist.diagnose(step, jnp.zeros(8), linear_batches(2), num_replicas=2,
                     steps=2)
  assert d.multi.host_callbacks >= 1
  assert any("calls back to Python" in note for note in d.notes)


def test_bad_arguments_say_what_to_pass(devices):
  data = linear_batches(2)
  w = jnp.zeros(8)
  with pytest.raises(TypeError, match="one-shot iterator.*Pass a list"):
    jdist.diagnose(linear_step, w, iter(data), num_replicas=2)
  with pytest.raises(TypeError, match="needs a step function"):
    jdist.diagnose("train_step", w, data)
  with pytest.raises(ValueError, match="steps must be a positive int"):
    jdist.diagnose(linear_step, w, data, steps=0)
  with pytest.raises(ValueError, match="strategy or num_replicas, not both"):
    jdist.diagnose(linear_step, w, data, num_replicas=2,
                   strategy=jdist.MirroredStrategy())
  with pytest.raises(ValueError, match="runs on one.*device_count"):
    jdist.diagnose(linear_step, w, data,
                   strategy=jdist.OneDeviceStrategy(devices[0]))
  with pytest.raises(ValueError, match="Only 4 local devices; 8 are needed"):
    jdist.diagnose(linear_step, w, data, num_replicas=8)
  with pytest.raises(ValueError, match="no batches"):
    jdist.diagnose(linear_step, w, [], num_replicas=2)
  with pytest.raises(TypeError, match=r"state, outputs = step\(state, batch\)"
                     r".*returned Array"):
    jdist.diagnose(lambda w, b: w, w, data, num_replicas=2)


def times(n, *, input_wait=0.0, compute=0.0, collectives=0.0, dispatch=0.0,
          recompilations=0, host_callbacks=0):
  """Times as a run on `n` devices could measure them (seconds per step)."""
  step = input_wait + compute + collectives + dispatch
  return jdist.StepTimes(
      num_replicas=n, step=step, input_wait=input_wait, compute=compute,
      collectives=collectives, dispatch=dispatch, compile_seconds=0.5,
      recompilations=recompilations, host_callbacks=host_callbacks,
      collective_bytes=4096 if collectives else 0,
      samples_per_second=64 / step)


# One phrase per rule, found in that rule's fix and in no other's.
FIXES = {"recompilation": "pad to a fixed size", "input": "prefetch",
         "collectives": "accumulate gradients", "dispatch": "steps_per_execution",
         "scales": "Nothing in the loop to fix", "cpu": "CPU devices share",
         "busy": "raise the global batch with the replicas"}
ONE = times(1, compute=4e-3, dispatch=1e-4)

# (the rule that must fire, its bottleneck, times on 4 devices, platform)
RULE_CASES = [
    # Recompiling wins even where another part is the largest.
    ("recompilation", "recompilation",
     times(4, input_wait=3e-3, compute=1e-3, recompilations=2), "gpu"),
    ("input", "input", times(4, input_wait=3e-3, compute=1e-3), "gpu"),
    ("collectives", "collectives", times(4, collectives=3e-3, compute=1e-3),
     "gpu"),
    ("dispatch", "dispatch", times(4, dispatch=3e-3, compute=1e-3), "gpu"),
    # 4 ms on one device, 1.2 ms on each of 4: 3.3x >= 0.75 x 4.
    ("scales", "compute", times(4, compute=1.2e-3, dispatch=1e-4), "cpu"),
    # 4 ms against 3 ms: 1.3x, not 4x; the fix depends on the platform.
    ("cpu", "compute", times(4, compute=3e-3, dispatch=1e-4), "cpu"),
    ("busy", "compute", times(4, compute=3e-3, dispatch=1e-4), "tpu"),
]


@pytest.mark.parametrize("rule,bottleneck,many,platform", RULE_CASES,
                         ids=[c[0] for c in RULE_CASES])
def test_each_advice_rule_fires_on_its_times_and_no_other(
    rule, bottleneck, many, platform):
  d = jdist.Diagnosis(single=ONE, multi=many, global_batch=64, steps=10,
                      platform=platform, host_cores=8)
  assert d.bottleneck == bottleneck
  assert [r for r, phrase in FIXES.items() if phrase in d.fix] == [rule]
  text = str(d)
  assert f"Bottleneck on 4 devices: {bottleneck}" in text
  assert d.cause in text and d.fix in text
  with pytest.raises(dataclasses.FrozenInstanceError):
    d.bottleneck = "input"


def test_the_cause_carries_the_numbers():
  d = jdist.Diagnosis(single=ONE, multi=times(4, dispatch=3e-3, compute=1e-3),
                      global_batch=64, steps=10, platform="gpu", host_cores=8)
  assert d.cause == ("a step computes for 1.00 ms but launching it from the "
                     "host takes 3.00 ms (75% of the step): the model is too "
                     "small for 4 devices.")
  d = jdist.Diagnosis(single=ONE, multi=times(4, compute=3e-3, dispatch=1e-4),
                      global_batch=64, steps=10, platform="cpu", host_cores=8)
  assert "3.00 ms on 16 examples per replica against 4.00 ms for all 64" \
      in d.cause and "1.3x faster, not 4x" in d.cause


def test_each_note_appears_when_it_applies_and_only_then():
  quiet = jdist.Diagnosis(single=ONE, multi=times(4, compute=1.2e-3),
                          global_batch=64, steps=10, platform="gpu",
                          host_cores=8)
  assert quiet.notes == ()
  loud = jdist.Diagnosis(
      single=ONE, multi=times(4, compute=5e-3, host_callbacks=3),
      global_batch=64, steps=10, platform="cpu", host_cores=8,
      measurement_notes=("The step could not run 10 times in one program.",))
  notes = loud.notes
  assert len(notes) == 4 and notes[0] == loud.measurement_notes[0]
  assert "4 devices are slower than one" in notes[1]
  assert "4 CPU devices share this host's 8 cores" in notes[2]
  assert "calls back to Python 3 times" in notes[3]
  assert all(f"  Note:  {note}" in str(loud) for note in notes)


def test_the_table_names_the_dispatch_row_for_what_it_measures():
  d = jdist.Diagnosis(single=ONE, multi=times(4, dispatch=3e-3, compute=1e-3),
                      global_batch=64, steps=10, platform="gpu", host_cores=8)
  rows = str(d).splitlines()
  assert rows[3:7] == [
      "  input wait                0.000   0%    0.000   0%",
      "  compute                   4.000  98%    1.000  25%",
      "  collectives               0.000   0%    0.000   0%",
      "  dispatch                  0.100   2%    3.000  75%"]
