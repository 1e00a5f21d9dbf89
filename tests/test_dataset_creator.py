"""`fit(jdist.DatasetCreator(dataset_fn), steps_per_epoch=...)` under
parameter servers, in the shape of TensorFlow's "Parameter server training"
tutorial (its Model.fit section), threads backend.

Every worker builds its own input pipeline, once per fit; one worker trains
as one device on the same batches.
"""

import collections
import threading

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.examples.models import MLP

from conftest import Interrupt, strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_dataset_fn(x, y, calls):
  def dataset_fn(input_context):
    calls.append((input_context.input_pipeline_id,
                  threading.current_thread() is threading.main_thread()))
    batch_size = input_context.get_per_replica_batch_size(32)
    # Each worker its own shard, shuffled and repeated.
    shard = np.arange(len(x))[input_context.input_pipeline_id::
                              input_context.num_input_pipelines]
    rng = np.random.default_rng(input_context.input_pipeline_id)
    while True:
      order = rng.permutation(shard)
      for i in range(0, len(order) - batch_size + 1, batch_size):
        rows = order[i:i + batch_size]
        yield x[rows], y[rows]
  return dataset_fn


def make_trainer(strategy, optimizer=None):
  with strategy.scope():
    return jdist.Trainer(MLP(hidden=32),
                         optimizer=optimizer or optax.sgd(0.1, momentum=0.9),
                         loss=LOSS, metrics=["accuracy"])


def ps_strategy(num_workers):
  return jdist.ParameterServerStrategy(
      jdist.cluster_resolver.LocalClusterResolver(num_workers=num_workers,
                                                  num_ps=1))


def test_each_worker_builds_its_pipeline_once_and_training_learns(digits_flat):
  x, y = digits_flat
  calls = []
  strategy = ps_strategy(2)
  # Plain SGD, as the tutorial's: asynchronous momentum at a high rate
  # oscillates from run to run.
  trainer = make_trainer(strategy, optax.sgd(0.3))
  try:
    history = trainer.fit(
        jdist.DatasetCreator(make_dataset_fn(x, y, calls)),
        epochs=3, steps_per_epoch=20, verbose=0).history
    # Once on each worker (pipelines 0 and 1, off the main thread) for the
    # whole fit, and once on the coordinator for the batch fit checks.
    assert collections.Counter(calls) == {(0, False): 1, (1, False): 1,
                                          (0, True): 1}
    assert trainer.global_step == 60
    assert int(trainer.state.read().step) == 60  # every step applied
    assert history["loss"][-1] < history["loss"][0] * 0.7
    assert history["accuracy"][-1] > 0.5  # chance: 0.1
  finally:
    strategy.coordinator.shutdown()


def test_one_worker_trains_as_one_device_on_the_same_batches(digits_flat):
  x, y = digits_flat
  x, y = x[:640], y[:640]
  strategy = ps_strategy(1)
  trainer = make_trainer(strategy)
  try:
    history = trainer.fit(jdist.DatasetCreator(make_dataset_fn(x, y, [])),
                          epochs=2, steps_per_epoch=15, verbose=0).history
    params = jax.device_get(trainer.params)
  finally:
    strategy.coordinator.shutdown()
  # The worker's batches in order, read by one device from the same function.
  batches = make_dataset_fn(x, y, [])(jdist.InputContext(1, 0, 1))
  one = make_trainer(strategy_on(1))
  reference = one.fit(batches, epochs=2, steps_per_epoch=15, verbose=0).history
  for key in reference:
    np.testing.assert_allclose(history[key], reference[key], rtol=1e-5,
                               err_msg=key)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_under_mirrored_each_replica_takes_a_per_replica_batch(digits_flat):
  """As TensorFlow's fit of a DatasetCreator under MirroredStrategy: the
  batches are per-replica (`get_per_replica_batch_size`), each step takes
  one per replica. Two replicas on batches of 16 train as one device on the
  same pairs of batches joined."""
  x, y = digits_flat
  x, y = x[:640], y[:640]

  def cycle(size):  # repeated: the second epoch continues the first
    while True:
      for i in range(0, len(x), size):
        yield x[i:i + size], y[i:i + size]

  def dataset_fn(ctx):
    return cycle(ctx.get_per_replica_batch_size(32))

  one = make_trainer(strategy_on(1))
  reference = one.fit(cycle(32), epochs=2, steps_per_epoch=12,
                      verbose=0).history
  # Also with gradient accumulation: 2 steps of 2 x 16 rows make one
  # optimizer step of 64, as one device on batches of 64 (an epoch of 12
  # steps is 6 of those).
  one_64 = make_trainer(strategy_on(1))
  reference_64 = one_64.fit(cycle(64), epochs=2, steps_per_epoch=6,
                            verbose=0).history
  for k, (ref, ref_history) in ((1, (one, reference)),
                                (2, (one_64, reference_64))):
    with strategy_on(2).scope():
      trainer = jdist.Trainer(MLP(hidden=32),
                              optimizer=optax.sgd(0.1, momentum=0.9),
                              loss=LOSS, metrics=["accuracy"],
                              gradient_accumulation_steps=k)
    history = trainer.fit(jdist.DatasetCreator(dataset_fn), epochs=2,
                          steps_per_epoch=12, verbose=0).history
    for key in ref_history:
      np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5,
                                 err_msg=key)
    for a, b in zip(jax.tree.leaves(trainer.params),
                    jax.tree.leaves(ref.params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_what_fit_refuses_with_a_dataset_creator(digits_flat):
  x, y = digits_flat
  creator = jdist.DatasetCreator(make_dataset_fn(x, y, []))
  with pytest.raises(ValueError, match="steps_per_epoch must be a multiple "
                     "of 4"):
    jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), loss=LOSS,
                  gradient_accumulation_steps=4).fit(creator,
                                                     steps_per_epoch=6)
  strategy = ps_strategy(1)
  trainer = make_trainer(strategy)
  try:
    with pytest.raises(ValueError, match="needs steps_per_epoch"):
      trainer.fit(creator, verbose=0)
    with pytest.raises(ValueError, match="takes no y, batch_size"):
      trainer.fit(creator, y, batch_size=32, steps_per_epoch=5, verbose=0)
    with pytest.raises(TypeError, match="feeds fit only"):
      trainer.evaluate(creator)
    assert trainer.global_step == 0
  finally:
    strategy.coordinator.shutdown()
  with pytest.raises(TypeError, match="needs a function"):
    jdist.DatasetCreator([1, 2])
  with pytest.raises(ValueError, match="input_options"):
    jdist.DatasetCreator(make_dataset_fn(x, y, []),
                         input_options=jdist.InputOptions())


def test_backup_and_restore_resumes_with_fresh_pipelines(digits_flat,
                                                         tmp_path):
  """An interrupted fit of a DatasetCreator resumes at its step and batch;
  the pipelines cannot be rewound, so dataset_fn runs again (and the resumed
  epoch reads its batches from the start of the data)."""
  x, y = digits_flat
  calls = []
  creator = jdist.DatasetCreator(make_dataset_fn(x[:640], y[:640], calls))

  def run(callbacks):
    trainer = make_trainer(strategy_on(2))
    trainer.fit(creator, epochs=2, steps_per_epoch=10, verbose=0,
                callbacks=callbacks)
    return trainer

  with pytest.raises(KeyboardInterrupt):
    run([jdist.BackupAndRestore(tmp_path, save_freq=4), Interrupt(13)])
  assert len(calls) == 2  # the host's peek and the one pipeline
  backup = jdist.BackupAndRestore(tmp_path, save_freq=4)
  trainer = run([backup])
  assert backup.restored_step == 12 and trainer.global_step == 20
  assert len(calls) == 4
