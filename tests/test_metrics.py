"""jdist.metrics: Keras' metrics as values that go in and out of steps,
exact over the real examples of every replica (issue 9.1)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import strategy_on

# Each metric, arguments for one update and the result Keras gives for them.
CASES = [
    (jdist.metrics.Mean(), ([1.0, 2.0, 3.0, 6.0],), 3.0),
    (jdist.metrics.Sum(), ([1.0, 2.0, 3.0, 6.0],), 12.0),
    (jdist.metrics.Accuracy(), ([1, 2, 3, 4], [1, 2, 0, 4]), 0.75),
    (jdist.metrics.SparseCategoricalAccuracy(),
     ([0, 1, 1], [[2.0, 1.0], [0.0, 3.0], [4.0, 1.0]]), 2 / 3),
    (jdist.metrics.CategoricalAccuracy(),
     ([[0, 1], [1, 0]], [[0.2, 0.8], [0.3, 0.7]]), 0.5),
    (jdist.metrics.BinaryAccuracy(threshold=0.3),
     ([1, 0, 1, 0], [0.4, 0.2, 0.1, 0.5]), 0.5),
    (jdist.metrics.MeanSquaredError(), ([[0.0], [1.0]], [[1.0], [3.0]]), 2.5),
    (jdist.metrics.MeanAbsoluteError(), ([[0.0], [1.0]], [[1.0], [3.0]]), 1.5),
    (jdist.metrics.MeanMetricWrapper(lambda t, p: t == 1, name="ones"),
     ([1, 0, 1, 1], [0, 0, 0, 0]), 0.75),
]


@pytest.mark.parametrize("metric,args,want", CASES, ids=lambda c: getattr(
    c, "name", ""))
def test_every_metric_round_trips_through_jit(metric, args, want):
  """A metric updated inside jit, and inside a step of 2 replicas, comes back
  with its sums and its settings (name, threshold)."""
  args = tuple(jnp.asarray(a) for a in args)
  updated = jax.jit(lambda m, a: m.update(*a))(metric, args)
  assert type(updated) is type(metric) and updated.name == metric.name
  assert float(updated.result()) == pytest.approx(want, rel=1e-6)
  strategy = strategy_on(2)
  step = strategy.function(lambda m, a: m.update(*a))
  (batch,) = strategy.experimental_distribute_dataset([args])
  placed = step(strategy.replicate(metric), batch)
  assert type(placed) is type(metric) and placed.name == metric.name
  assert float(placed.result()) == pytest.approx(want, rel=1e-6)
  cleared = jax.jit(lambda m: m.reset())(updated)
  assert float(cleared.totals.value["count"]) == 0
  if isinstance(metric, jdist.metrics.BinaryAccuracy):
    assert updated.threshold == placed.threshold == 0.3


def _tf_tutorial_port(strategy, params, test_x, test_y):
  """The test loop of TF's custom-training tutorial, ported line for line."""
  model = MLP()
  loss_object = jdist.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                           reduction="none")
  test_loss = jdist.metrics.Mean(name="test_loss")
  test_accuracy = jdist.metrics.SparseCategoricalAccuracy(name="test_accuracy")

  @strategy.function
  def test_step(params, test_loss, test_accuracy, inputs):
    images, labels = inputs
    predictions = model.apply({"params": params}, images)
    t_loss = loss_object(labels, predictions)
    return (test_loss.update(t_loss),
            test_accuracy.update(labels, predictions))

  params = strategy.replicate(params)
  data = [(test_x[i:i + 64], test_y[i:i + 64]) for i in range(0, 297, 64)]
  for epoch in range(2):  # reset between epochs, as the tutorial does
    for inputs in strategy.experimental_distribute_dataset(data):
      test_loss, test_accuracy = test_step(params, test_loss, test_accuracy,
                                           inputs)
    result = (float(test_loss.result()), float(test_accuracy.result()))
    test_loss, test_accuracy = test_loss.reset(), test_accuracy.reset()
  assert test_step.num_compilations == 1  # fresh metrics placed before jit
  return result


def test_ported_tutorial_loop_is_exact_with_a_padded_last_batch(digits_flat):
  x, y = digits_flat
  test_x, test_y = x[1500:], y[1500:]  # 297: the last batch of 64 has 41
  params = MLP().init(jax.random.key(0), x[:1])["params"]
  params = jax.tree.map(lambda p: p * 3, params)  # an informative model
  logits = MLP().apply({"params": params}, test_x)
  want_acc = float(np.mean(np.argmax(logits, -1) == test_y))
  want_loss = float(np.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, test_y)))
  one = _tf_tutorial_port(strategy_on(1), params, test_x, test_y)
  four = _tf_tutorial_port(strategy_on(4), params, test_x, test_y)
  assert four[1] == one[1] == pytest.approx(want_acc, abs=1e-7)
  assert four[0] == pytest.approx(one[0], rel=1e-6)
  assert four[0] == pytest.approx(want_loss, rel=1e-5)


def test_weights_masks_and_results_inside_the_step():
  strategy = strategy_on(4)
  values = np.arange(1, 7, dtype=np.float32)  # 6 examples over 4 replicas
  weights = np.array([1, 1, 1, 1, 0, 2], np.float32)
  data = [{"v": values, "w": weights}]

  @strategy.function
  def step(mean, total, batch):
    mean = mean.update(batch["v"], sample_weight=batch["w"])
    total = total.update(batch["v"])
    return mean, total, mean.result()  # inside: every replica's sums

  batch, = strategy.experimental_distribute_dataset(data)  # 8 rows, 2 padding
  mean, total, inside = step(jdist.metrics.Mean(), jdist.metrics.Sum(), batch)
  want = float(np.sum(values * weights) / np.sum(weights))
  assert float(mean.result()) == pytest.approx(want)
  assert float(total.result()) == 21.0  # the two zero rows are not counted
  assert float(inside) == pytest.approx(want)  # mirrored: the same everywhere
  # An explicit mask wins over the step's.
  m = jdist.metrics.Mean().update(jnp.array([1.0, 5.0]), mask=jnp.array([1, 0]))
  assert float(m.result()) == 1.0


def test_keras_in_place_calls_are_refused_with_the_fix():
  acc = jdist.metrics.SparseCategoricalAccuracy()
  with pytest.raises(TypeError, match=r"acc = acc.update|m = m.update"):
    acc.update_state(jnp.array([1]), jnp.array([[0.0, 1.0]]))
  with pytest.raises(TypeError, match=r"m = m.reset\(\)"):
    acc.reset_state()


def test_values_without_one_row_per_example_need_a_mask():
  strategy = strategy_on(2)
  batch, = strategy.experimental_distribute_dataset([np.ones((4, 3))])
  with pytest.raises(ValueError, match=r"3 rows.*batch has 2 examples.*mask="):
    strategy.run(lambda m, b: m.update(b[0]), args=(jdist.metrics.Mean(), batch))


def test_trainer_metrics_are_the_same_classes(digits_flat):
  x, y = digits_flat
  trainer = jdist.Trainer(
      MLP(), optimizer=optax.adam(1e-2), strategy=strategy_on(2),
      loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
      metrics=["accuracy", jdist.metrics.SparseCategoricalAccuracy(name="sca"),
               lambda t, p: (jnp.argmax(p, -1) == t).astype(jnp.float32)])

  class Peek(jdist.Callback):
    def on_train_batch_end(self, batch, logs=None):
      self.totals = self.fit_loop.totals  # the running metrics of the epoch

  peek = Peek()
  history = trainer.fit(x[:300], y[:300], batch_size=64, callbacks=[peek],
                        verbose=0)
  totals = peek.totals
  assert isinstance(totals["accuracy"], jdist.metrics.SparseCategoricalAccuracy)
  assert isinstance(totals["<lambda>"], jdist.metrics.MeanMetricWrapper)
  assert float(totals["sca"].result()) == pytest.approx(history.history["sca"][0])
  logs = trainer.evaluate(x[:300], y[:300], batch_size=64)
  assert logs["accuracy"] == logs["sca"] == logs["<lambda>"]


@pytest.mark.parametrize("saved_on,resumed_on", [(1, 1), (4, 4), (4, 1), (1, 4)])
def test_a_metric_restored_from_its_sums_continues_the_epoch_exactly(
    saved_on, resumed_on):
  rng = np.random.default_rng(0)
  y = rng.integers(0, 3, 45)
  logits = rng.normal(size=(45, 3)).astype(np.float32)
  data = [{"y": y[i:i + 16], "logits": logits[i:i + 16]}
          for i in range(0, 45, 16)]  # the last batch has 13: padded
  Acc = jdist.metrics.SparseCategoricalAccuracy

  def run(n, metrics, batches):
    strategy = strategy_on(n)
    step = strategy.function(lambda m, b: (m[0].update(b["y"], b["logits"]),
                                           m[1].update(b["logits"][:, 0])))
    for batch in strategy.experimental_distribute_dataset(batches):
      metrics = step(metrics, batch)
    assert step.num_compilations == 1  # a restored metric is placed as fresh
    return metrics

  whole = run(1, (Acc(), jdist.metrics.Mean()), data)
  first = run(saved_on, (Acc(), jdist.metrics.Mean()), data[:1])
  saved = [{k: float(v) for k, v in m.sums().items()} for m in first]
  restored = (Acc().with_sums(saved[0]), jdist.metrics.Mean().with_sums(saved[1]))
  resumed = run(resumed_on, restored, data[1:])
  assert float(resumed[0].result()) == float(whole[0].result()) == \
      pytest.approx(np.mean(np.argmax(logits, -1) == y), abs=1e-7)
  assert float(resumed[1].sums()["count"]) == 45  # padding never counted
  assert float(resumed[1].result()) == pytest.approx(
      float(np.mean(logits[:, 0])), rel=1e-6)
  # Restoring works under jit too (sums as traced values).
  again = jax.jit(lambda s: Acc().with_sums(s))(saved[0])
  assert float(again.sums()["count"]) == saved[0]["count"] == 16


def test_with_sums_says_what_it_needs():
  with pytest.raises(ValueError, match=r"'total' and 'count'.*metric.sums\(\)"):
    jdist.metrics.Mean().with_sums({"total": 3.0})


def test_a_metric_that_saw_nothing_reads_zero_as_in_keras():
  """Keras divides with no NaN: a fresh or reset Mean, an Accuracy of no
  example, read 0.0, outside a step and inside one (where a replica's
  metric has seen only padding)."""
  assert float(jdist.metrics.Mean().result()) == 0.0
  m = jdist.metrics.Mean().update(jnp.array([1.0, 3.0]))
  assert float(m.result()) == 2.0 and float(m.reset().result()) == 0.0
  assert float(jdist.metrics.SparseCategoricalAccuracy().result()) == 0.0
  inside = jax.jit(lambda m: m.result())(jdist.metrics.Mean())
  assert float(inside) == 0.0
  assert float(jax.jit(lambda m: m.result())(m)) == 2.0
