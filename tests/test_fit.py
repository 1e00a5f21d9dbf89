"""jdist.Trainer: fit, evaluate and predict, the way a Keras user calls them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdist
import jdist.testing
from jdist.examples.models import MLP

from conftest import lowered_programs, strategy_on

LOSS = jdist.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def split(digits_flat):
  x, y = digits_flat
  # 1000 training examples: 15 batches of 64 and one of 40; 297 to validate.
  return (x[:1000], y[:1000]), (x[1500:], y[1500:])


def trainer_on(n, model=None, **kwargs):
  kwargs.setdefault("optimizer", optax.adam(1e-2))
  kwargs.setdefault("loss", LOSS)
  kwargs.setdefault("metrics", ["accuracy"])
  return jdist.Trainer(model or MLP(), strategy=strategy_on(n), **kwargs)


def assert_history_close(a, b, rtol=1e-4):
  assert a.epoch == b.epoch
  assert sorted(a.history) == sorted(b.history)
  for key in a.history:
    np.testing.assert_allclose(a.history[key], b.history[key], rtol=rtol,
                               err_msg=key)


def assert_states_close(t1, t2):
  """Parameters and optimizer state (SGD's momentum: a gradient of the wrong
  scale shows in both, where adam's update would normalise it away)."""
  a, b = (jax.tree.leaves((t.params, t.state.opt_state)) for t in (t1, t2))
  assert len(a) == len(b)
  for u, v in zip(a, b):
    np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)


def test_fit_gives_the_same_history_on_1_and_4_devices(split):
  (x, y), val = split
  runs = {}
  for n in (1, 4):
    trainer = trainer_on(n, optimizer=optax.sgd(0.1, momentum=0.9))
    history = trainer.fit(x, y, batch_size=64, epochs=3, validation_data=val,
                          verbose=0)
    runs[n] = (trainer, history)
  (t1, h1), (t4, h4) = runs[1], runs[4]
  assert sorted(h4.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
  assert h4.epoch == [0, 1, 2] and len(h4.history["loss"]) == 3
  assert h4.history["loss"][-1] < h4.history["loss"][0] / 2  # it learned
  assert_history_close(h1, h4)
  assert_states_close(t1, t4)
  assert t4.global_step == 3 * 16 and int(t4.state.step) == 48
  assert t4.params["Dense_0"]["kernel"].sharding.device_set == set(
      jax.local_devices()[:4])


def test_the_first_fit_compiles_the_models_initialisation_as_one_program():
  # Shapes no other test uses, so no program is in JAX's caches already.
  x = np.random.default_rng(0).normal(size=(24, 5)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  trainer = trainer_on(2, MLP(hidden=13, classes=7), metrics=[])
  with lowered_programs() as first:
    trainer.fit(x, y, batch_size=8, verbose=0)
  # Eagerly, flax's initialisation compiles each of its operations alone
  # (29 programs for this fit, `jit(_truncated_normal)` among them): now one
  # program each for the init, the predictions check, the train step and the
  # logs' reduction, and a few small placements of keys and batches.
  assert first.count("jit(init)") == 1 and len(first) <= 12, first
  with lowered_programs() as second:
    trainer.fit(x, y, batch_size=8, verbose=0)
  assert second == []


def test_evaluate_and_predict_are_exact_on_uneven_data(split):
  (x, y), (vx, vy) = split
  trainer = trainer_on(4)
  trainer.fit(x, y, batch_size=64, epochs=1, verbose=0)
  variables = trainer.export()
  logits = np.asarray(MLP().apply(variables, vx))
  exact_loss = float(np.mean(optax.softmax_cross_entropy_with_integer_labels(
      logits, vy)))
  exact_acc = float(np.mean(np.argmax(logits, -1) == vy))
  for batch_size in (64, 28, 4):  # 297 examples: every last batch is short
    got = trainer.evaluate(vx, vy, batch_size=batch_size)
    assert got["loss"] == pytest.approx(exact_loss, rel=1e-5)
    assert got["accuracy"] == pytest.approx(exact_acc, abs=1e-9)
    pred = trainer.predict(vx, batch_size=batch_size)
    assert pred.shape == (297, 10)  # no padding rows, none dropped
    np.testing.assert_allclose(pred, logits, rtol=1e-5, atol=1e-5)


def test_trainer_made_in_a_scope_runs_on_that_strategy(split):
  (x, y), _ = split
  strategy = strategy_on(2)
  with strategy.scope():
    trainer = jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), loss=LOSS)
  assert trainer.strategy == strategy
  trainer.fit(x[:256], y[:256], batch_size=64, verbose=0)
  assert trainer.params["Dense_1"]["bias"].sharding.device_set == set(
      strategy.devices)
  # A trainer made outside any scope takes the scope open at its first use.
  late = jdist.Trainer(MLP(), optimizer=optax.sgd(0.1), loss=LOSS)
  with strategy.scope():
    late.fit(x[:256], y[:256], batch_size=64, verbose=0)
  assert late.strategy == strategy


def test_batches_from_lists_generators_and_dicts(split):
  """Arrays, a list of (x, y), dict batches, a generator and grain's
  MapDataset, IterDataset and DataLoader agree."""
  (x, y), _ = split
  x, y = x[:320], y[:320]
  as_arrays = trainer_on(2).fit(x, y, batch_size=64, epochs=2, shuffle=False,
                                verbose=0)
  tuples = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 320, 64)]
  as_list = trainer_on(2).fit(tuples, epochs=2, verbose=0)
  dicts = [{"x": a, "y": b} for a, b in tuples]
  as_dicts = trainer_on(2).fit(dicts, epochs=2, verbose=0)

  def generator():
    for _ in range(2):
      yield from iter(tuples)
  as_generator = trainer_on(2).fit(generator(), epochs=2, steps_per_epoch=5,
                                   verbose=0)
  import grain
  records = [{"x": a, "y": b} for a, b in zip(x, y)]
  as_grain = trainer_on(2).fit(grain.MapDataset.source(records).batch(64),
                               epochs=2, verbose=0)  # re-iterable: a pass per epoch
  as_grain_iter = trainer_on(2).fit(
      grain.MapDataset.source(records).to_iter_dataset().batch(64), epochs=2,
      verbose=0)
  loader = grain.DataLoader(
      data_source=records, worker_count=0,
      sampler=grain.samplers.IndexSampler(320, shuffle=False, num_epochs=1),
      operations=[grain.transforms.Batch(64)])
  as_grain_loader = trainer_on(2).fit(loader, epochs=2, verbose=0)
  for h in (as_list, as_dicts, as_generator, as_grain, as_grain_iter,
            as_grain_loader):
    assert_history_close(as_arrays, h, rtol=1e-6)


def test_an_iterator_that_runs_out_stops_training_with_a_warning(split):
  (x, y), _ = split
  batches = iter([(x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)])
  trainer = trainer_on(2)
  with pytest.warns(UserWarning, match="ran out at epoch 2"):
    history = trainer.fit(batches, epochs=3, verbose=0)
  assert history.epoch == [0] and trainer.global_step == 4


def test_validation_iterator_that_runs_out_is_a_clear_error(split):
  (x, y), (vx, vy) = split
  val = iter([(vx[:64], vy[:64])])  # enough for one evaluation only
  trainer = trainer_on(2)
  with pytest.raises(ValueError, match="evaluation data gave no batches"):
    trainer.fit(x[:128], y[:128], batch_size=64, epochs=2, validation_data=val,
                verbose=0)
  assert trainer.history.epoch == [0]


def test_validation_split_and_steps_per_epoch(split):
  (x, y), _ = split
  trainer = trainer_on(2)
  history = trainer.fit(x, y, batch_size=64, epochs=2, steps_per_epoch=3,
                        validation_split=0.2, verbose=0)
  assert trainer.global_step == 6
  want = trainer.evaluate(x[800:], y[800:], batch_size=64)
  assert history.history["val_loss"][-1] == pytest.approx(want["loss"], rel=1e-5)


def test_steps_per_epoch_shorter_than_the_data_continues_it_as_keras(split):
  """Keras's epochs over arrays with a shorter steps_per_epoch: each epoch
  continues where the last stopped, the one that reaches the end of the data
  stops there, the next starts a new pass (7 batches, 3 an epoch: 3, 3, 1, 3,
  3 batches; what keras 3.15's fit gives). Trained on 2 devices, it equals
  those batches in that order as one epoch on one device."""
  (x, y), _ = split
  x, y = x[:448], y[:448]  # 7 batches of 64
  lengths = []

  class Count(jdist.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      lengths.append(0)

    def on_train_batch_end(self, batch, logs=None):
      lengths[-1] += 1

  sgd = dict(optimizer=optax.sgd(0.1, momentum=0.9))
  trainer = trainer_on(2, **sgd)
  with pytest.warns(UserWarning, match="does not divide the data's 7 batches"):
    trainer.fit(x, y, batch_size=64, epochs=5, steps_per_epoch=3,
                shuffle=False, callbacks=[Count()], verbose=0)
  assert lengths == [3, 3, 1, 3, 3] and trainer.global_step == 13
  # A second fit from initial_epoch=1 continues where epoch 1 would: it says
  # so (Keras's fit would start at the data's first batch).
  with pytest.warns(UserWarning, match="starts at batch 3 of the data"):
    trainer_on(2, **sgd).fit(x, y, batch_size=64, epochs=2, initial_epoch=1,
                             steps_per_epoch=3, shuffle=False, verbose=0)
  batches = [(x[64 * i:64 * (i + 1)], y[64 * i:64 * (i + 1)]) for i in range(7)]
  reference = trainer_on(1, **sgd)
  reference.fit([batches[i] for i in [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]],
                epochs=1, verbose=0)
  assert_states_close(trainer, reference)
  # A re-iterable of known length (a list, a grain MapDataset, a tf.data
  # Dataset of known cardinality) is read the same way, and one of unknown
  # length too: its first pass continues until it runs out.

  class Unsized:
    def __iter__(self):
      return iter(batches)

  for data in (batches, Unsized()):
    lengths.clear()
    listed = trainer_on(2, **sgd)
    with pytest.warns(UserWarning, match="the data's 7 batches"):
      listed.fit(data, epochs=5, steps_per_epoch=3, callbacks=[Count()],
                 verbose=0)
    assert lengths == [3, 3, 1, 3, 3]
    assert_states_close(listed, reference)


class NnxNet(nnx.Module):
  def __init__(self, rngs, axis_name=None):
    self.dense = nnx.Linear(64, 32, rngs=rngs)
    self.norm = nnx.BatchNorm(32, axis_name=axis_name, use_fast_variance=False,
                              rngs=rngs)
    self.out = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.dense(x))))


def test_nnx_module_with_synced_batch_norm(split):
  """An nnx module trains the same on 1 and 4 devices and is updated in place."""
  (x, y), (vx, vy) = split
  x, y = x[:768], y[:768]  # whole batches: batch statistics see no padding
  runs = []
  for n in (1, 4):
    strategy = strategy_on(n)
    model = NnxNet(nnx.Rngs(0), axis_name=strategy.axis_name)
    # sgd: adam turns reduction-order noise in tiny gradients into drift of
    # the running statistics (see test_conformance's float64 note).
    trainer = jdist.Trainer(model, optimizer=optax.sgd(0.1), loss=LOSS,
                            metrics=["accuracy"], strategy=strategy)
    history = trainer.fit(x, y, batch_size=64, epochs=2,
                          validation_data=(vx, vy), verbose=0)
    runs.append((model, trainer, history))
  (m1, _, h1), (m4, t4, h4) = runs
  assert_history_close(h1, h4)
  assert h4.history["val_accuracy"][-1] > h4.history["val_accuracy"][0] + 0.2
  # The module object holds the trained state: running statistics included.
  m4.eval()
  np.testing.assert_allclose(np.asarray(m4(vx)), t4.predict(vx, batch_size=64),
                             rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(m4.norm.mean[...]).sum()) > 0


def test_nnx_batch_norm_without_axis_name_matches_one_device(split):
  """Issue 9.5: under the trainer, flax's BatchNorm without axis_name uses the
  global batch's statistics, so 2 devices train as 1 (no VaryingStateError)."""
  (x, y), (vx, vy) = split
  results = []
  for n in (1, 2):
    trainer = jdist.Trainer(NnxNet(nnx.Rngs(0)), optimizer=optax.sgd(0.1),
                            loss=LOSS, strategy=strategy_on(n))
    trainer.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0)
    results.append(trainer.evaluate(vx, vy, batch_size=64))
  assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-4)


def test_apply_function_with_train_flag_and_rng(split):
  """A plain apply function: params given, dropout from the step's key."""
  (x, y), _ = split
  init = MLP().init(jax.random.key(0), x[:1])["params"]
  seen = {}

  def apply_fn(params, inputs, *, train, rng):
    seen["train"] = seen.get("train", set()) | {train}
    logits = MLP().apply({"params": params}, inputs)
    return jdist.dropout(rng, 0.2, logits, deterministic=not train)

  def per_example_loss(labels, logits):  # Keras' order: (y_true, y_pred)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

  def top2(labels, logits):
    top = jnp.argsort(logits, -1)[:, -2:]
    return jnp.any(top == labels[:, None], -1)

  histories, trainers = [], []
  for n in (1, 2):
    trainer = jdist.Trainer(apply_fn, params=init,
                            optimizer=optax.sgd(0.1, momentum=0.9),
                            loss=per_example_loss, metrics={"top2": top2},
                            strategy=strategy_on(n), seed=3)
    histories.append(trainer.fit(x, y, batch_size=64, epochs=2, verbose=0))
    trainers.append(trainer)
  assert seen["train"] == {True, False}
  assert_history_close(*histories)  # dropout masks keyed by example, not device
  assert_states_close(*trainers)
  top2 = histories[0].history["top2"]
  assert top2[-1] > top2[0] + 0.1


def test_progress_bar_and_verbosity(split, capsys):
  (x, y), val = split
  trainer = trainer_on(2)
  trainer.fit(x[:256], y[:256], batch_size=64, epochs=2, validation_data=val)
  err = capsys.readouterr().err
  assert "Epoch 1/2" in err and "Epoch 2/2" in err
  assert "4/4" in err and "step/s" in err
  assert "loss=" in err and "val_accuracy=" in err
  trainer.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=2)
  out = capsys.readouterr()
  assert out.out.startswith("Epoch 1/1 - 4 steps") and "accuracy:" in out.out
  assert out.err == ""
  trainer.fit(x[:256], y[:256], batch_size=64, epochs=1, verbose=0)
  assert capsys.readouterr() == ("", "")


def test_progress_bar_is_tqdm_auto(split, monkeypatch):
  """tqdm.auto: a widget in notebooks, text in a terminal."""
  import tqdm.auto
  made = []

  class Recording(tqdm.auto.tqdm):
    def __init__(self, *args, **kwargs):
      made.append(kwargs)
      super().__init__(*args, **kwargs)

  monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
  (x, y), _ = split
  trainer_on(1).fit(x[:128], y[:128], batch_size=64, epochs=2)
  assert [(m["desc"], m["total"]) for m in made] == [("Epoch 1/2", 2),
                                                     ("Epoch 2/2", 2)]


def test_progress_bar_shows_each_steps_own_logs(split, monkeypatch):
  """The bar reads the logs of the step it has just counted, before the
  next step donates the state they come from: redrawn at every step (as a
  slow step would have it), it shows the loss a batch-end callback gets."""
  import tqdm.auto
  from jdist._src.training import progress
  shown = {}

  class Recording(tqdm.auto.tqdm):
    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
      epoch = int(self.desc.split()[1].split("/")[0])  # "Epoch 2/2"
      shown.setdefault(4 * (epoch - 1) + self.n,
                       ordered_dict["loss"])
      super().set_postfix(ordered_dict, refresh=refresh, **kwargs)

  class Losses(jdist.Callback):
    losses = []

    def on_train_batch_end(self, batch, logs=None):
      self.losses.append(f"{logs['loss']:.4g}")

  monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
  monkeypatch.setattr(progress, "TICK", 0.0)
  monkeypatch.setattr(progress, "REFRESH", 0.0)
  (x, y), _ = split
  trainer_on(2).fit(x[:256], y[:256], batch_size=64, epochs=2)
  trainer_on(2).fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0,
                    callbacks=[Losses()])
  assert len(Losses.losses) == 8 and len(set(Losses.losses)) > 4
  assert [shown[n] for n in range(1, 9)] == Losses.losses


# --- bad input: a clear error before any step runs ---------------------------


class Counter(jdist.Callback):
  def __init__(self):
    super().__init__()
    self.batches = 0

  def on_train_batch_begin(self, batch, logs=None):
    self.batches += 1


def test_data_that_does_not_fit_the_model(split):
  (x, y), (vx, vy) = split
  trainer = trainer_on(2)
  trainer.fit(x[:128], y[:128], batch_size=64, verbose=0)
  before = jax.tree.map(np.asarray, trainer.params)
  counter = Counter()
  with pytest.raises(ValueError, match=r"(?s)model fails on the training data's "
                     r"inputs.*\(64, 63\).*Check that the data has the shape"):
    trainer.fit(x[:, :63], y, batch_size=64, callbacks=[counter], verbose=0)
  with pytest.raises(ValueError, match=r"validation data's inputs"):
    trainer.fit(x, y, batch_size=64, validation_data=(vx[:, :60], vy),
                callbacks=[counter], verbose=0)
  assert counter.batches == 0 and trainer.global_step == 2
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params)):
    np.testing.assert_array_equal(a, b)


def test_loss_returning_the_wrong_shape(split):
  (x, y), _ = split
  def mean_loss(labels, logits):  # a common slip: already averaged
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  trainer = trainer_on(2, loss=mean_loss)
  with pytest.raises(ValueError, match=r"loss returned a scalar.*one value per "
                     r"example, shape \(64,\).*no \.mean\(\)"):
    trainer.fit(x, y, batch_size=64, verbose=0)
  assert trainer.global_step == 0 and int(trainer.state.step) == 0


def test_targets_that_do_not_match_the_predictions(split):
  (x, y), _ = split
  trainer = trainer_on(2, loss="mse", metrics=[])
  with pytest.raises(ValueError, match=r"loss cannot compare.*\(64, 10\).*"
                     r"\(64,\).*do not match"):
    trainer.fit(x, y, batch_size=64, verbose=0)
  with pytest.raises(ValueError, match=r"x has 1000 examples but y has 999"):
    trainer.fit(x, y[:-1], batch_size=64, verbose=0)


def test_configuration_errors():
  with pytest.raises(TypeError, match="optax GradientTransformation"):
    jdist.Trainer(MLP(), optimizer=3, loss=LOSS)
  with pytest.raises(ValueError, match="Unknown loss 'crossentropy'"):
    jdist.Trainer(MLP(), optimizer=optax.adam(1e-3), loss="crossentropy")
  with pytest.raises(ValueError, match="Unknown metric 'f1'"):
    jdist.Trainer(MLP(), optimizer=optax.adam(1e-3), loss=LOSS, metrics=["f1"])
  with pytest.raises(ValueError, match="needs its parameters"):
    jdist.Trainer(lambda p, x: x, optimizer=optax.adam(1e-3), loss=LOSS)
  with pytest.raises(TypeError, match="Cannot train a int"):
    jdist.Trainer(3, optimizer=optax.adam(1e-3), loss=LOSS)


def test_batch_size_that_cannot_split_over_replicas(split):
  (x, y), _ = split
  with pytest.raises(ValueError, match=r"cannot split evenly over 4 replicas"
                     r".* Or pass pad_to_replicas=True to jdist.Trainer"):
    trainer_on(4).fit(x, y, batch_size=30, verbose=0)


def test_pad_to_replicas_trains_3_replicas_as_4(split):
  """`Trainer(pad_to_replicas=True)`: batches of 64 on 3 replicas (3 x 22,
  2 rows masked) train as on 4 (SGD with momentum, with validation), and
  evaluate and predict with batches neither count divides read each example
  once."""
  (x, y), (vx, vy) = split
  got = {}
  for n in (3, 4):
    trainer = trainer_on(n, optimizer=optax.sgd(0.1, momentum=0.9),
                         pad_to_replicas=True)
    history = trainer.fit(x[:256], y[:256], batch_size=64, epochs=2,
                          validation_data=(vx, vy), verbose=0)
    got[n] = (jax.device_get(trainer.state.params), history,
              trainer.evaluate(vx, vy, batch_size=50),
              trainer.predict(vx[:10], batch_size=5))
  problems = jdist.testing.compare_trees(got[3][0], got[4][0], rtol=0,
                                         atol=1e-6, names=("3", "4"))
  assert not problems, "\n".join(problems)
  assert_history_close(got[3][1], got[4][1], rtol=1e-5)
  assert got[3][2] == pytest.approx(got[4][2], rel=1e-5)
  assert got[3][3].shape == (10, 10)
  np.testing.assert_allclose(got[3][3], got[4][3], rtol=1e-5, atol=1e-6)


def test_train_state_round_trips_through_jit(split):
  (x, y), _ = split
  trainer = trainer_on(1)
  trainer.build(x[:1])
  before = trainer.state
  state = jax.jit(lambda s: s.replace(step=s.step + 1))(before)
  assert isinstance(state, jdist.TrainState) and int(state.step) == 1
  # Every other field comes back with its own values, in its own place.
  for name in ("params", "opt_state", "model_state", "rng"):
    got, want = getattr(state, name), getattr(before, name)
    assert jax.tree.structure(got) == jax.tree.structure(want), name
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b, err_msg=name)


class CountedMLP(nnx.Module):
  """An MLP that counts how often Python runs it (each trace runs it once)."""

  runs = 0

  def __init__(self, rngs):
    self.hidden = nnx.Linear(64, 32, rngs=rngs)
    self.out = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    CountedMLP.runs += 1
    return self.out(jax.nn.relu(self.hidden(x)))


def test_a_second_fit_on_data_of_the_same_shape_traces_nothing(split):
  """The data's check against the model (a trace of the model, loss and
  metrics) cost more than a short fit's steps; Keras does not repeat it
  either. New shapes are still checked."""
  (x, y), _ = split
  trainer = trainer_on(2, CountedMLP(nnx.Rngs(0)),
                       optimizer=optax.sgd(0.1, 0.9))
  CountedMLP.runs = 0
  trainer.fit(x[:256], y[:256], batch_size=64, verbose=0)
  assert CountedMLP.runs > 0
  CountedMLP.runs = 0
  history = trainer.fit(x[256:512], y[256:512], batch_size=64, verbose=0)
  assert CountedMLP.runs == 0 and trainer.global_step == 8
  assert np.isfinite(history.history["loss"][0])
  with pytest.raises(ValueError, match=r"model fails on the training data's "):
    trainer.fit(x[:256, :63], y[:256], batch_size=64, verbose=0)


def test_shuffled_arrays_are_read_in_the_order_of_the_seed_and_epoch(split):
  """Epoch e reads default_rng([seed, e]).permutation(n): the same batches
  whether the next epoch's permutation is drawn ahead in the worker thread
  or, the worker kept busy, by the loop itself."""
  import threading
  from jdist._src.training import shuffle_order
  (x, y), _ = split
  x, y = x[:320], y[:320]
  order = [np.random.default_rng([7, e]).permutation(320) for e in (0, 1)]
  by_hand = trainer_on(1, seed=7).fit(
      iter([(x[o[i:i + 64]], y[o[i:i + 64]])
            for o in order for i in range(0, 320, 64)]),
      epochs=2, steps_per_epoch=5, verbose=0)
  busy = threading.Event()

  class Release(jdist.Callback):  # the worker kept busy until training ends
    def on_train_end(self, logs=None):
      busy.set()

  shuffle_order.worker().submit(busy.wait, 30)  # nothing drawn ahead
  try:
    by_loop = trainer_on(1, seed=7).fit(x, y, batch_size=64, epochs=2,
                                        callbacks=[Release()], verbose=0)
  finally:
    busy.set()
  ahead = trainer_on(1, seed=7).fit(x, y, batch_size=64, epochs=2, verbose=0)
  for history in (by_loop, ahead):
    assert history.history == by_hand.history
  # fit ends its worker thread: none of jdist's stays behind it.
  assert not [t for t in threading.enumerate()
              if t.name.startswith("jdist-shuffle")]


def test_callbacks_none_is_no_callbacks_as_in_keras(split):
  (x, y), _ = split
  trainer = trainer_on(2)
  history = trainer.fit(x[:128], y[:128], batch_size=64, callbacks=None,
                        verbose=0)
  assert trainer.global_step == 2 and len(history.history["loss"]) == 1
  assert set(trainer.evaluate(x[:64], y[:64], callbacks=None)) >= {"loss"}
  assert trainer.predict(x[:64], callbacks=None).shape == (64, 10)


class KeepsEveryEpochsParams(jdist.Callback):
  """Keeps the parameters of every epoch, copied as the Trainer says to."""

  def on_train_begin(self, logs=None):
    self.kept, self.read_at_batch = [], None

  def on_train_batch_end(self, batch, logs=None):
    if batch == 0:
      self.read_at_batch = self.model.params  # valid until the next step

  def on_epoch_end(self, epoch, logs=None):
    self.kept.append(jax.tree.map(jnp.copy, self.model.params))


def test_fit_donates_the_state_and_keeps_what_the_user_holds(split):
  """The train step reuses the state's buffers (one copy of the state in
  memory, as Keras 3 does); arrays read before fit stay valid, and a copy
  taken in a callback outlives the steps."""
  (x, y), _ = split
  module = CountedMLP(nnx.Rngs(0))
  trainer = trainer_on(2, module, optimizer=optax.sgd(0.1, 0.9))
  trainer.build(x[:1])
  before = trainer.params
  first = np.asarray(jax.tree.leaves(before)[0]).copy()
  keep = KeepsEveryEpochsParams()
  trainer.fit(x[:256], y[:256], batch_size=64, epochs=2, verbose=0,
              callbacks=[keep])
  # Read before fit: still there, still the initial values.
  np.testing.assert_array_equal(jax.tree.leaves(before)[0], first)
  # The first batch's arrays were donated to the next step.
  assert jax.tree.leaves(keep.read_at_batch)[0].is_deleted()
  # Copies live on: epoch 1's differ from epoch 2's, which are the last.
  one, two = (jax.tree.leaves(p)[0] for p in keep.kept)
  assert not np.allclose(one, two)
  np.testing.assert_array_equal(two, jax.tree.leaves(trainer.params)[0])
  # fit updated the user's nnx module; a second fit leaves those arrays be.
  kernel = module.hidden.kernel[...]
  held = np.asarray(kernel).copy()
  trainer.fit(x[:256], y[:256], batch_size=64, verbose=0)
  np.testing.assert_array_equal(kernel, held)
  assert not np.allclose(module.hidden.kernel[...], held)
