"""TensorFlow's distributed-iterator API: `get_next_as_optional()` and
`element_spec`, on both kinds of distributed datasets."""

import jax
import numpy as np
import pytest

import jdist

from conftest import strategy_on


def examples(n=20):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(n, 3)).astype(np.float32),
          "y": rng.integers(0, 5, n).astype(np.int32)}


def global_batches(data, size):
  n = len(data["y"])
  return [{k: v[i:i + size] for k, v in data.items()} for i in range(0, n, size)]


def test_a_tf_style_loop_ends_on_an_empty_optional():
  """The tutorial's loop: `while optional.has_value()`; 20 rows in 3 steps."""
  strategy = strategy_on(4)
  data = examples()
  it = iter(strategy.experimental_distribute_dataset(global_batches(data, 8)))
  step = strategy.function(lambda b: jdist.get_replica_context().all_reduce(
      "sum", (b["x"].sum(axis=1) * b["y"] * jdist.get_replica_context()
              .example_mask).sum()))
  total, steps = 0.0, 0
  optional = it.get_next_as_optional()
  while optional.has_value():
    total += float(step(optional.get_value()))
    steps += 1
    optional = it.get_next_as_optional()
  assert steps == 3
  np.testing.assert_allclose(total, (data["x"].sum(axis=1) * data["y"]).sum(),
                             rtol=1e-5)
  assert not it.get_next_as_optional().has_value()  # and stays empty
  with pytest.raises(ValueError, match="holds no value.*has_value"):
    optional.get_value()
  assert optional.element_spec == it.element_spec


def test_element_spec_is_what_each_replica_step_receives():
  strategy = strategy_on(4)
  seen = []

  @strategy.function
  def step(batch):
    seen.append(jax.tree.map(lambda x: (x.shape, x.dtype), batch))
    return jdist.compute_average_loss(batch["x"][:, 0])

  dataset = strategy.experimental_distribute_dataset(
      global_batches(examples(), 8))
  want = {"x": jax.ShapeDtypeStruct((2, 3), np.float32),
          "y": jax.ShapeDtypeStruct((2,), np.int32)}
  assert dataset.element_spec == want  # before any pass
  for batch in dataset:  # the short last batch (4 rows) is padded alike
    step(batch)
  assert seen and all(  # each trace (jdist traces a step twice)
      s == jax.tree.map(lambda s: (s.shape, s.dtype), want) for s in seen)
  assert step.num_compilations == 1
  it = iter(dataset)
  assert it.element_spec == want
  assert len(list(it)) == 3  # asking read ahead, but lost nothing
  assert dataset.group(2).element_spec == want  # each batch of a group


def test_element_spec_of_datasets_from_a_function():
  strategy = strategy_on(4)
  data = examples()

  def dataset_fn(ctx):
    b = ctx.get_per_replica_batch_size(8)
    return global_batches(data, b)

  dataset = strategy.distribute_datasets_from_function(dataset_fn)
  want = {"x": jax.ShapeDtypeStruct((2, 3), np.float32),
          "y": jax.ShapeDtypeStruct((2,), np.int32)}
  assert dataset.element_spec == want
  it = iter(dataset)
  count = 0
  while (optional := it.get_next_as_optional()).has_value():
    count += int(optional.get_value().num_valid)
  assert count == 20


def test_asking_for_the_spec_before_a_pass_loses_no_batch_of_a_generator():
  strategy = strategy_on(2)
  gen = ({"x": np.full((4, 1), i, np.float32)} for i in range(3))
  dataset = strategy.experimental_distribute_dataset(gen)
  assert dataset.element_spec == {"x": jax.ShapeDtypeStruct((2, 1), np.float32)}
  got = [float(strategy.gather(b)["x"][0, 0]) for b in dataset]
  assert got == [0.0, 1.0, 2.0]
  with pytest.raises(ValueError, match="one-shot"):
    iter(dataset)


def test_no_batches_means_no_spec_and_an_empty_optional():
  strategy = strategy_on(2)
  dataset = strategy.experimental_distribute_dataset([])
  assert not iter(dataset).get_next_as_optional().has_value()
  with pytest.raises(ValueError, match="has no batches, so its element_spec"):
    iter(dataset).element_spec
