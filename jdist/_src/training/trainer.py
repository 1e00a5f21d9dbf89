"""`Trainer`: Keras' fit, evaluate and predict on any jdist strategy."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdist._src import current
from jdist._src.core import placement
from jdist._src.core import state_output as state_output_lib
from jdist._src.core.function import DistributedFunction
from jdist._src.core.multi_step import MultiStepFunction
from jdist._src.errors import CheckpointNotFoundError
from jdist._src.input.options import InputOptions
from jdist._src.ops import precision
from jdist._src.ops.sharded_optimizer import ShardedOptimizer
from jdist._src.training import data as data_lib
from jdist._src.training import dataset_creator
from jdist._src.training import loop
from jdist._src.training import mixed_precision
from jdist._src.training import model as model_lib
from jdist._src.training import objectives
from jdist._src.training import optimizers
from jdist._src.training import shuffle_order
from jdist._src.training import steps as steps_lib
from jdist._src.training.callbacks import CallbackList
from jdist._src.checkpoint.checkpointer import Checkpointer
from jdist._src.training.history import History
from jdist._src.training.loop import FitLoop, Position
from jdist._src.training.optimizer import OptimizerView
from jdist._src.training.progress import ProgressBar
from jdist._src.training.state import TrainState


class Trainer:
  """Trains a flax model with an optax optimizer on a jdist strategy.

  The per-replica step is built for you: the model runs on each replica's
  shard of the global batch, the loss is scaled with
  `jdist.compute_average_loss`, gradients arrive summed over replicas, and
  losses and metrics are exact on a padded last batch. The strategy is the
  one passed in, or the one whose scope is open when the trainer is made
  (or, failing that, when it is first used).

  Args:
    model: a flax linen `Module`, a flax nnx `Module`, or an apply function
      `apply_fn(params, x)` (which may also take `train=` and `rng=`).
    optimizer: an optax `GradientTransformation`. For `LearningRateScheduler`,
      build it with `optax.inject_hyperparams`.
    loss: as in Keras: a `jdist.losses` object (e.g.
      `jdist.losses.SparseCategoricalCrossentropy(from_logits=True)`), a name
      ("sparse_categorical_crossentropy", "categorical_crossentropy",
      "binary_crossentropy": probabilities, as in Keras; "mse", "mae"), or a
      per-example function `loss(y_true, y_pred) -> (batch,)`.
    metrics: names ("accuracy", "mse", ...), `jdist.metrics` objects or
      per-example functions `metric(y_true, y_pred)`, as a list, or a dict
      `{name: metric}`.
    weighted_metrics: like `metrics`, weighted by the data's sample weights.
    params: initial parameters: required for an apply function; for a linen
      module, its variables (skips initialisation).
    strategy: the strategy to run on; default: the current one.
    seed: seeds initialisation, shuffling and the training random stream.
    shard_optimizer_state: keep the optimizer state split over the replicas
      instead of whole on each (ZeRO: `jdist.ShardedOptimizer`); the same
      updates, a fraction of the memory. Under `ModelParallelStrategy` the
      state keeps its parameter's layout within each replica and is split
      over the replicas on top of it.
    steps_per_execution: training batches run per compiled call (Keras'
      argument): the host dispatches once per group of this many steps,
      which speeds up small models (and is what TPUs want). The results are
      those of one step per call. As in Keras, per-batch callbacks are called
      once per execution: `on_train_batch_begin` with the index of its first
      batch, `on_train_batch_end` with its last; checkpoints every
      `save_freq` steps are saved at the end of the execution that reaches
      them. `evaluate` and `predict` run one batch per call.
    dtype_policy: mixed precision, by Keras' names: "float32" (default),
      "mixed_bfloat16" or "mixed_float16" (or a `jdist.DTypePolicy`). The
      mixed policies keep parameters and optimizer state in float32 and run
      the model in bfloat16 / float16 (parameters and inputs cast on the way
      in, predictions back to float32 for the loss). "mixed_float16" wraps
      the optimizer in `jdist.loss_scale_optimizer` (unless it is already);
      fit's logs then carry "loss_scale" and "skipped_steps" (steps whose
      gradients overflowed and were skipped, so far).
    gradient_accumulation_steps: K, as in Keras 3 (an optimizer argument
      there) and Hugging Face's Trainer: `batch_size` is the micro-batch, and
      K consecutive batches make one optimizer step on their K x batch_size
      examples (the mean gradient over all of them, exactly also when the
      last batch is short), so an epoch of N batches makes N / K optimizer
      steps and `global_step` (`optimizer.iterations`) counts those. The K
      batches run one after another in one compiled call, with one gradient
      reduction. Batches are what callbacks count, as in Keras:
      `on_train_batch_end` gets the index of the last batch of each call,
      `save_freq` counts batches; checkpoints fall between groups, so a
      resumed run continues exactly. An epoch must hold a multiple of K
      batches (Keras carries a trailing partial group's gradients into the
      next epoch; jdist refuses it: `ValueError` before the first step when
      the epoch's length is known, at the end of the epoch otherwise).
      `steps_per_execution` above 1 must then be a multiple of K. Under a
      mixed_float16 policy a non-finite gradient in any batch of a group
      skips the group's step. Needs a synchronous strategy.
    micro_batches: M: each replica's share of every batch runs as M
      micro-batches, one after another in the same compiled step, with one
      gradient reduction (`jdist.accumulate_gradients`): the same training
      as M = 1 (exactly also on a padded last batch) with the activations of
      one micro-batch alive at a time; each replica's batch must be a
      multiple of M. Combines with `gradient_accumulation_steps`.
    pad_to_replicas: a batch that the replicas (times M micro-batches) do
      not divide is padded with masked rows to the next multiple, as a short
      last batch is, instead of refused (`jdist.InputOptions`' option of this
      name). Losses and metrics leave the padding out, so training is the
      same on any number of replicas: a job under `jdist launch --nnodes
      MIN:MAX` restarted on fewer processes keeps its `batch_size`.

  Example:
    >>> import jdist, optax, numpy as np
    >>> from jdist.examples.models import MLP
    >>> x = np.random.default_rng(0).normal(size=(100, 8)).astype(np.float32)
    >>> y = (x[:, 0] > 0).astype(np.int32)
    >>> trainer = jdist.Trainer(
    ...     MLP(classes=2), optimizer=optax.adam(1e-2),
    ...     loss=jdist.losses.SparseCategoricalCrossentropy(from_logits=True),
    ...     metrics=["accuracy"])
    >>> history = trainer.fit(x, y, batch_size=20, epochs=2, verbose=0)
    >>> sorted(history.history)
    ['accuracy', 'loss']
  """

  def __init__(self, model, *, optimizer: optax.GradientTransformation, loss,
               metrics=None, weighted_metrics=None, params=None, strategy=None,
               seed: int = 0, shard_optimizer_state: bool = False,
               steps_per_execution: int = 1, dtype_policy="float32",
               gradient_accumulation_steps: int = 1, micro_batches: int = 1,
               pad_to_replicas: bool = False):
    optimizer = optimizers.resolve(optimizer)
    self._input_options = InputOptions(pad_to_replicas=pad_to_replicas)
    self._strategy = strategy or (current.get_strategy()
                                  if current.has_strategy() else None)
    self._policy = precision.policy_of(dtype_policy)
    self._model = model_lib.adapt(model, params)
    # What the steps run: the model under the policy (itself for float32).
    self._compute_model = mixed_precision.adapt(self._model, self._policy)
    self._given_tx = optimizer
    # Fixed here, before any step function is made from it.
    self._tx = mixed_precision.optimizer(optimizer, self._policy)
    self._shard_optimizer_state = bool(shard_optimizer_state)
    self._loss = objectives.resolve_loss(loss)
    self._metric_items = objectives.metric_items(metrics)
    self._weighted_items = objectives.metric_items(weighted_metrics,
                                                   "weighted_metrics")
    clash = ({n for n, _ in self._metric_items} &
             {n for n, _ in self._weighted_items})
    if clash:
      raise ValueError(f"Metric names {sorted(clash)} appear in both metrics "
                       "and weighted_metrics; name them apart (a dict).")
    # Built from the first data's shapes (a metric's form may depend on them).
    self._metrics: dict | None = None
    self._weighted_metrics: dict | None = None
    self._fresh_totals = None  # placed once (see _totals)
    self._checked_first_batch = False
    self._seed = int(seed)
    _check_count(steps_per_execution, "steps_per_execution", minimum=1)
    self._steps_per_execution = int(steps_per_execution)
    _check_count(gradient_accumulation_steps, "gradient_accumulation_steps",
                 minimum=1)
    _check_count(micro_batches, "micro_batches", minimum=1)
    self._accumulation = int(gradient_accumulation_steps)
    self._micro_batches = int(micro_batches)
    self._batches_per_call = _batches_per_call(self._steps_per_execution,
                                               self._accumulation)
    if self._shard_optimizer_state and self._policy.needs_loss_scaling:
      raise ValueError(
          f"shard_optimizer_state=True with dtype_policy="
          f"{self._policy.name!r} is not supported yet: the loss scale "
          "would be hidden inside the sharded optimizer's state. Use "
          "\"mixed_bfloat16\" (no loss scaling), or mirrored optimizer state.")
    self._state: TrainState | None = None
    self._stopped = False  # whether the last fit was stopped by a callback
    self.history: History | None = None
    self._fit_loop: FitLoop | None = None  # the running fit owns the state
    self._initialised_for = None  # input_spec of the build's inputs
    # (data spec, state spec) -> the model's output spec; and the keys whose
    # loss and metrics were traced against it and found to fit.
    self._output_specs: dict = {}
    self._objectives_checked: set = set()
    self._train_function = None
    self._test_function = None
    self._predict_function = None
    self._step_optimizer = None

  # --- properties --------------------------------------------------------

  @property
  def strategy(self):
    """The strategy steps run on."""
    if self._strategy is None:
      self._strategy = current.get_strategy()
    return self._strategy

  @property
  def state(self) -> TrainState | None:
    """The train state (None before `build`), held as the strategy holds it.

    During `fit` it is the running loop's: a callback that replaces it
    (restoring weights, as Keras callbacks do) replaces the loop's.
    """
    return self._state if self._fit_loop is None else self._fit_loop.state

  @state.setter
  def state(self, held: TrainState) -> None:
    if self._fit_loop is None:
      self._state = held
    else:
      self._fit_loop.state = held

  @property
  def stop_training(self) -> bool:
    """Keras' flag: a callback sets it to end `fit` after the current batch.

    During `fit` it is the running loop's (each fit starts with False, as
    in Keras); afterwards, whether the last fit was stopped.
    """
    if self._fit_loop is None:
      return self._stopped
    return self._fit_loop.stop_training

  @stop_training.setter
  def stop_training(self, value: bool) -> None:
    if self._fit_loop is None:
      self._stopped = bool(value)
    else:
      self._fit_loop.stop_training = bool(value)

  @property
  def params(self):
    """The model's current parameters (mirrored arrays)."""
    state = self.state
    return None if state is None else self._read(state).params

  @property
  def global_step(self) -> int:
    """Optimizer steps applied so far: the train state's step (known on the
    host during `fit`)."""
    if self._fit_loop is not None:
      return self._fit_loop.global_step
    if self._state is None:
      return 0
    return int(placement.to_host(self._read(self._state).step))

  @property
  def steps_per_execution(self) -> int:
    """Training batches run per compiled call (Keras' attribute)."""
    return self._steps_per_execution

  @property
  def train_function(self):
    """The compiled train step `fit` calls (Keras' `model.train_function`):
    a `jdist.DistributedFunction`, or with `steps_per_execution` or
    `gradient_accumulation_steps` above 1 a `jdist.MultiStepFunction` (a
    call takes a `BatchGroup`); its `num_compilations` counts its compiles.
    It donates the state it is given (the returned state reuses its
    buffers), as Keras 3's does. Made on first use (`make_train_function`)."""
    return self.make_train_function()

  @property
  def test_function(self):
    """The compiled evaluation step `evaluate` (and fit's validation) calls
    (Keras' `model.test_function`): `(state, totals, batch) -> totals`."""
    return self.make_test_function()

  @property
  def predict_function(self):
    """The compiled prediction step `predict` calls (Keras'
    `model.predict_function`): `(state, batch) -> predictions`."""
    return self.make_predict_function()

  @property
  def metrics_names(self) -> list[str]:
    """The names in the logs, as Keras' `model.metrics_names`: "loss", then
    the metrics and the weighted metrics."""
    return ["loss"] + [n for n, _ in self._metric_items + self._weighted_items]

  @property
  def position(self) -> Position:
    """The epoch and batch training is at (during `fit`)."""
    return Position() if self._fit_loop is None else self._fit_loop.position

  @property
  def learning_rate(self) -> float:
    """The optimizer's learning rate (needs `optax.inject_hyperparams`)."""
    return float(placement.to_host(self._lr_leaf()))

  @learning_rate.setter
  def learning_rate(self, value: float) -> None:
    old = self._lr_leaf()
    held = self.state
    value_now = self._read(held)
    # Written in place of the state the hyperparameter is in; the step
    # count stays (a running loop reads it again from the new state).
    self.state = self._write(held, value_now.replace(
        opt_state=optax.tree_utils.tree_set(
            value_now.opt_state,
            learning_rate=np.asarray(value, dtype=old.dtype))))

  @property
  def optimizer(self) -> OptimizerView:
    """The optimizer, as Keras callbacks read it: `trainer.optimizer.
    learning_rate` (needs `optax.inject_hyperparams`), `.iterations`; it
    also works as the optax transformation the train step applies (loss
    scaled under "mixed_float16", sharded with `shard_optimizer_state`)."""
    return OptimizerView(self, self._optimizer())

  def _lr_leaf(self):
    self._require_state("read or set the learning rate")
    lr = optax.tree_utils.tree_get(self._read(self.state).opt_state,
                                   "learning_rate",
                                   default=None)
    if lr is None:
      raise ValueError(
          "The optimizer's learning rate is not part of its state, so it "
          "cannot be changed during training. Build the optimizer with "
          "optax.inject_hyperparams, e.g. "
          "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3).")
    return lr

  # --- building ----------------------------------------------------------

  def build(self, x) -> TrainState:
    """Initialises parameters and optimizer state from a batch of inputs `x`.

    `fit`, `evaluate` and `predict` call it with their first batch.
    """
    if self._state is None:
      key = jax.random.key(self._seed)
      init_key, rng_key = jax.random.split(key)
      sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)
      self._initialised_for = steps_lib.input_spec(sample)
      try:
        with self.strategy.mesh_scope(strict=False):  # shapes only
          params, _ = jax.eval_shape(self._model.init, init_key, sample)
      except Exception as e:
        raise ValueError(
            f"The model cannot be initialised with inputs of shapes "
            f"{objectives.describe(sample)} (one example of the data's x): "
            f"{type(e).__name__}: {e}") from e
      if not jax.tree.leaves(params):
        raise ValueError(
            "The model has no trainable parameters (its parameter tree is "
            "empty), so training would change nothing. "
            "Check that its layers are created (flax linen: in setup or "
            "@nn.compact __call__; nnx: as attributes in __init__).")
      mixed_precision.check_scaled_once(self._given_tx, self._tx, params)
      # Made by the strategy: under ModelParallelStrategy each array is born
      # in its layout (compiled with output shardings), never whole.
      self._state = self.strategy.init(self._new_state, init_key, rng_key,
                                       sample)
    return self._state

  def _new_state(self, init_key, rng_key, sample) -> TrainState:
    params, model_state = self._model.init(init_key, sample)
    return TrainState(jnp.int32(0), params, self._optimizer().init(params),
                      model_state, jax.random.key_data(rng_key))

  def _read(self, held):
    """The value of held state (read from the servers under parameter servers)."""
    return self.strategy.state_placement.read(held)

  def _write(self, held, value):
    """Writes `value` into held state; returns the held state."""
    return self.strategy.state_placement.write(held, value, self.strategy.mesh)

  def _require_state(self, what: str) -> None:
    if self.state is None:
      raise RuntimeError(f"The trainer has no parameters yet; call fit(), or "
                         f"build(x) with a batch of inputs, to {what}.")

  def _optimizer(self):
    """What the train step calls: the optimizer, or its sharded form (made
    once: it holds the strategy, fixed from the first use on)."""
    if self._step_optimizer is None:
      self._step_optimizer = (ShardedOptimizer(self._tx, self.strategy)
                              if self._shard_optimizer_state else self._tx)
    return self._step_optimizer

  def make_train_function(self, force: bool = False):
    """Makes (once, or again with `force`) and returns the compiled train
    step, as Keras 3's `model.make_train_function()`; see
    `train_function`."""
    if self._train_function is None or force:
      s = self.strategy
      # (state, totals, batch) -> (state, totals): both written back where
      # the strategy holds them (parameter servers). The state is donated,
      # as Keras 3 and flax's examples do: the step's new state reuses the
      # old one's buffers (one copy of the state in memory, not two); fit
      # copies the state once first (`_own_state`). Totals are not donated:
      # logs read them after the next step, and the CPU throttle waits on
      # them.
      train = s.function(steps_lib.make_train_step(
          self._compute_model, self._loss, self._optimizer(),
          self._weighted_names(), micro_batches=self._micro_batches,
          batches_per_step=self._accumulation),
          state_output=(0, 1), donate_argnums=(0,))
      if self._batches_per_call > 1:
        if not isinstance(train, DistributedFunction):
          what = (f"steps_per_execution={self._steps_per_execution}"
                  if self._accumulation == 1 else
                  f"gradient_accumulation_steps={self._accumulation}")
          raise ValueError(
              f"{what} runs several batches in one compiled call, which "
              "needs a synchronous strategy (Mirrored, MultiWorkerMirrored, "
              f"TPU, OneDevice, CentralStorage); under {type(s).__name__} "
              "every step is scheduled on a worker on its own. Leave it at 1 "
              "there (micro_batches= splits each batch inside its step).")
        train = MultiStepFunction(train, batches_per_step=self._accumulation)
      self._train_function = train
    return self._train_function

  def make_test_function(self, force: bool = False):
    """Makes (once, or again with `force`) and returns the compiled
    evaluation step; see `test_function`."""
    if self._test_function is None or force:
      # (state, totals, batch) -> totals: the model's state is only read.
      self._test_function = self.strategy.function(steps_lib.make_eval_step(
          self._compute_model, self._loss, self._weighted_names()),
          state_output=(None, state_output_lib.whole))
    return self._test_function

  def make_predict_function(self, force: bool = False):
    """Makes (once, or again with `force`) and returns the compiled
    prediction step; see `predict_function`."""
    if self._predict_function is None or force:
      self._predict_function = self.strategy.function(
          steps_lib.make_predict_step(self._compute_model), state_output=None)
    return self._predict_function

  def _weighted_names(self) -> frozenset:
    return frozenset(n for n, _ in self._weighted_items)

  def _prepare(self, source: data_lib.Source, what: str, *,
               with_loss: bool = True, micro_batches: int = 1
               ) -> tuple[dict, int | None]:
    """Checks the data against the model before any step (tracing it under
    the strategy's mesh); returns its first batch and the static global
    batch size.

    Args:
      what: the data's name in messages ("training data", ...).
      with_loss: the data has targets to check against the loss.
      micro_batches: the micro-batches each replica's share is split into
        (gradient accumulation, when training).
    """
    with self.strategy.mesh_scope():
      return self._check_data(source, what, with_loss=with_loss,
                              micro_batches=micro_batches)

  def _check_data(self, source: data_lib.Source, what: str, *,
                  with_loss: bool, micro_batches: int
                  ) -> tuple[dict, int | None]:
    """`_prepare` under the strategy's mesh."""
    sample = source.peek()
    self.build(sample["x"])
    # Tracing the model, loss and metrics costs a fixed ~0.1-0.2 s, more than
    # a short fit's steps: data of a shape already checked is not traced again.
    abstract = self.strategy.state_placement.abstract(self.state)
    key = (steps_lib.spec_key(sample), steps_lib.spec_key(abstract))
    if key not in self._output_specs:
      self._output_specs[key] = steps_lib.output_spec(
          self._compute_model, abstract, sample, what, self._initialised_for)
    y_pred = self._output_specs[key]
    static = None  # a DatasetCreator's pipelines batch for themselves
    if not isinstance(source, dataset_creator.CreatorSource):
      static = data_lib.static_batch_size(
          source, sample, self.strategy.num_replicas_in_sync, what,
          micro_batches=micro_batches,
          pad=self._input_options.pad_to_replicas)
    if not with_loss:
      return sample, static
    if "y" not in sample:
      raise ValueError(f"The {what} has no targets y.")
    if self._metrics is None:
      self._metrics = objectives.build_metrics(
          self._metric_items, self._loss, sample["y"], y_pred)
      self._weighted_metrics = objectives.build_metrics(
          self._weighted_items, self._loss, sample["y"], y_pred)
    if key not in self._objectives_checked:
      steps_lib.check_objectives(self._loss, {**self._metrics,
                                              **self._weighted_metrics},
                                 sample, y_pred, what)
      self._objectives_checked.add(key)
    if not self._checked_first_batch:
      self._checked_first_batch = True
      objectives.check_predictions(self._loss, steps_lib.predictions(
          self._compute_model, self._read(self.state), sample["x"]))
    num_classes = y_pred.shape[-1] if y_pred.ndim > 1 else None
    source.check_targets(functools.partial(
        objectives.check_targets, self._loss, num_classes=num_classes))
    return sample, static

  def _totals(self, sums: dict | None = None) -> dict:
    """Fresh running sums of the loss and metrics (restored from `sums`, a
    checkpoint's), placed where the strategy holds them.

    No step donates its totals and arrays are immutable, so on the mesh the
    fresh totals are placed once and serve every epoch, validation and
    evaluation (placing them cost fit a few microseconds per step at every
    epoch). Totals held off the mesh (on parameter servers, which update
    them, or on a central device) are made anew each time.
    """
    if not sums and self._fresh_totals is not None:
      return self._fresh_totals
    totals = steps_lib.make_totals(self._metrics, self._weighted_metrics)
    if sums:
      totals = steps_lib.restore_totals(totals, sums)
    placed = self.strategy.replicate(totals)
    if not sums and type(self.strategy.state_placement) is \
        placement.StatePlacement:  # held on the mesh, as jax arrays
      self._fresh_totals = placed
    return placed

  # --- fit -----------------------------------------------------------------

  def fit(self, x=None, y=None, *, batch_size: int | None = None,
          epochs: int = 1, steps_per_epoch: int | None = None,
          validation_data=None, validation_split: float = 0.0,
          validation_steps: int | None = None,
          validation_batch_size: int | None = None, shuffle: bool = True,
          sample_weight=None, class_weight: dict | None = None,
          callbacks: Sequence = (), verbose="auto",
          initial_epoch: int = 0) -> History:
    """Trains for `epochs` epochs; returns the `History` of per-epoch logs.

    Args:
      x: inputs as arrays (with `y` and `batch_size`), or the data as an
        iterable of `(x, y)` / `(x, y, sample_weight)` / `{"x", "y"}` global
        batches (a list, a tf.data dataset, a grain dataset or iterator, a
        generator). A tf.data dataset is read anew each epoch (so it may
        reshuffle); one that repeats forever needs `steps_per_epoch`. Or
        a `jdist.DatasetCreator(dataset_fn)` (with `steps_per_epoch`, as in
        TensorFlow): every input pipeline builds
        its own data (under parameter servers, every worker).
      y: targets, when `x` is arrays.
      batch_size: the global batch size for arrays (default 32). It must be a
        multiple of the number of replicas; the last batch may be shorter
        (and data shorter than one batch is one short batch). None for
        batches and datasets, which are batched already (as in Keras).
      epochs: epochs to train (counting those before `initial_epoch`).
      steps_per_epoch: batches per epoch (default: all of the data). Shorter
        than the data, epochs continue through it as Keras's do: each
        starts where the last stopped, the one that reaches the end of the
        data stops there (a warning says so) and the next starts a new
        (reshuffled) pass.
      validation_data: `(x_val, y_val)` or `(x_val, y_val, sample_weight)`
        arrays, or an iterable of batches, evaluated at the end of every
        epoch (logged as `val_*`).
      validation_split: for arrays, the last fraction of examples held out
        for validation (taken before shuffling, as in Keras).
      validation_steps: batches per validation (default: all).
      validation_batch_size: batch size of validation arrays.
      shuffle: shuffle arrays every epoch (the order depends only on the seed
        and the epoch, so resuming reproduces it).
      sample_weight: for arrays, one weight per example. As in Keras the loss
        is the sum of weight times loss over the number of examples.
      class_weight: `{class index: weight}`; multiplies the sample weights.
      callbacks: `jdist.Callback` instances.
      verbose: "auto" or 1 (a progress bar), 2 (a line per epoch), 0 (quiet).
        Only process 0 prints.
      initial_epoch: the epoch to start at.

    Returns:
      The `History`; also `trainer.history`.
    """
    _check_count(epochs, "epochs", minimum=0)
    _check_count(initial_epoch, "initial_epoch", minimum=0)
    source = self._training_source(x, y, batch_size=batch_size,
                                   steps_per_epoch=steps_per_epoch,
                                   shuffle=shuffle, sample_weight=sample_weight,
                                   class_weight=class_weight)
    source, val_source = data_lib.validation_source(
        source, validation_data, validation_split=validation_split,
        steps=validation_steps, batch_size=validation_batch_size)
    _check_whole_groups(source, range(initial_epoch, epochs),
                        self._accumulation)
    data_lib.warn_mid_pass_start(source, initial_epoch)
    _, static = self._prepare(source, "training data",
                              micro_batches=self._micro_batches)
    validate = None
    if val_source is not None:
      _, val_static = self._prepare(val_source, "validation data")
      validate = lambda state, cbs: self._evaluate_source(
          val_source, val_static, state, cbs)
    fit_loop = FitLoop(self.make_train_function(), source, self._own_state(),
                       strategy=self.strategy, epochs=epochs,
                       initial_epoch=initial_epoch, validate=validate,
                       make_totals=self._totals,
                       read_logs=self._train_logs_reader, batch_size=static,
                       options=self._input_options,
                       steps_per_execution=self._batches_per_call,
                       batches_per_step=self._accumulation,
                       batches=(source.distributed if isinstance(
                           source, dataset_creator.CreatorSource) else None),
                       skipped=self._skipped_batches())
    self.history = fit_loop.history
    cbs = CallbackList(callbacks, trainer=self,
                       params={"epochs": epochs, "verbose": verbose,
                               "steps": source.steps_per_epoch},
                       fit_loop=fit_loop)
    bar = ProgressBar(verbose, epochs)
    self._fit_loop = fit_loop
    try:
      self._state = fit_loop.run(cbs, bar)
    except BaseException:
      # The steps that ran stay applied, as Keras' variables do.
      self._state = fit_loop.state
      raise
    finally:
      self._stopped = fit_loop.stop_training
      self._fit_loop = None
      shuffle_order.shutdown()  # the worker drawing permutations ahead
      bar.close()
      cbs.close()
    if isinstance(self._model, model_lib.NnxModel):
      self.export()
    return self.history

  def _own_state(self):
    """The state fit trains from: a copy, when the train step donates it.

    Arrays read before fit (`trainer.params`, an nnx module updated by
    `export`) stay valid; the arrays of `trainer.state` read during fit are
    valid until the next step (copy them to keep them longer, as
    `EarlyStopping` does).
    """
    if not self._donates_state():
      return self._state  # held on the parameter servers: nothing donated
    return placement.copy_arrays(self._state)

  def _donates_state(self) -> bool:
    """Whether the train function donates the state it is given (it does
    unless the state is held on parameter servers)."""
    return isinstance(self.make_train_function(),
                      (DistributedFunction, MultiStepFunction))

  def _training_source(self, x, y, *, batch_size, steps_per_epoch, shuffle,
                       sample_weight, class_weight) -> data_lib.Source:
    """fit's data as a `Source`: a `DatasetCreator`'s, built by each input
    pipeline (each parameter-server worker), or data read on this host."""
    if not isinstance(x, dataset_creator.DatasetCreator):
      return data_lib.make_source(x, y, batch_size=batch_size,
                                  steps_per_epoch=steps_per_epoch,
                                  shuffle=shuffle, seed=self._seed,
                                  sample_weight=sample_weight,
                                  class_weight=class_weight)
    given = {"y": y, "batch_size": batch_size, "sample_weight": sample_weight}
    extra = [k for k, v in given.items() if v is not None]
    if extra:
      raise ValueError(
          f"fit(jdist.DatasetCreator(...)) takes no {', '.join(extra)}: "
          "dataset_fn's batches carry their targets and weights, batched as "
          "it batches them.")
    return dataset_creator.CreatorSource(
        x, strategy=self.strategy, steps_per_epoch=steps_per_epoch,
        class_weight=class_weight, batches_per_call=self._batches_per_call)

  def _skipped_batches(self):
    """What tells fit which batches a loss-scaled optimizer skipped; None
    without loss scaling, and under an asynchronous strategy (reading the
    state after every step would wait for the servers each time)."""
    if not mixed_precision.scales_loss(self._tx) or not isinstance(
        self.make_train_function(), DistributedFunction):
      return None
    return mixed_precision.SkippedBatches(
        self._read, batches_per_step=self._accumulation)

  def _read_means(self, totals) -> dict:
    totals = self._read(totals)  # one read from the servers, if held there
    return steps_lib.means(totals, steps_lib.read_sums(self.strategy, totals))

  def _train_logs_reader(self, state):
    """`read(totals) -> logs` for the step that returned `state`: the means,
    and the loss scale's state if any. Called after each step whose logs
    something may read (a batch-end callback, the progress bar): they are
    read later (lazily), after the next step has donated `state`, so it
    keeps a copy of the loss scale's scalars (parameter servers donate
    nothing: their state is read when the logs are)."""
    kept = None
    if mixed_precision.scales_loss(self._tx):
      if self._donates_state():
        copied = placement.copy_arrays(
            mixed_precision.train_logs(self._read(state).opt_state))
        kept = lambda: copied
      else:
        kept = lambda: mixed_precision.train_logs(self._read(state).opt_state)

    def read(totals) -> dict:
      logs = self._read_means(totals)
      if kept is not None:
        logs.update({k: float(v) for k, v in
                     placement.to_host(kept()).items()})
      return logs
    return read

  # --- evaluate and predict ------------------------------------------------

  def evaluate(self, x=None, y=None, *, batch_size: int | None = None,
               steps: int | None = None, sample_weight=None,
               callbacks: Sequence = (), verbose=0) -> dict:
    """Loss and metrics over all of the data, exactly: `{name: value}`.

    Every example counts once, whatever the batch size and the number of
    replicas (a short last batch, or data shorter than one batch, is padded
    and masked). With `sample_weight` the loss is Keras' weighted loss.
    The data is what `fit` takes (arrays with `y` and `batch_size`, or
    batches: a tf.data dataset that repeats forever needs `steps`).
    """
    source = data_lib.make_source(x, y, batch_size=batch_size,
                                  steps_per_epoch=steps,
                                  sample_weight=sample_weight)
    _, static = self._prepare(source, "evaluation data")
    cbs = CallbackList(callbacks, trainer=self, params={"steps": steps,
                                                        "verbose": verbose})
    return self._evaluate_source(source, static, self.state, cbs,
                                 verbose=verbose)

  def _evaluate_source(self, source, static: int | None, state,
                       cbs: CallbackList, verbose=0) -> dict:
    batches = self.strategy.experimental_distribute_dataset(
        source.batches(0), self._input_options, global_batch_size=static)
    return loop.evaluate(self.make_test_function(), state, batches,
                         self._totals(), self._read_means, cbs,
                         ProgressBar(verbose, 1), source.steps_per_epoch)

  def predict(self, x, *, batch_size: int | None = None,
              steps: int | None = None, callbacks: Sequence = (), verbose=0):
    """The model's outputs for every example of `x`, in order, on the host.

    `x` is arrays (with `batch_size`) or batches as `fit` takes them (a
    batch's targets, if any, are ignored, as in Keras).

    Returns:
      A numpy array (or a pytree of them) with one row per example: the
      padding of a short last batch is dropped.
    """
    source = data_lib.make_source(x, None, batch_size=batch_size,
                                  steps_per_epoch=steps, need_y=False)
    _, static = self._prepare(source, "prediction data", with_loss=False)
    cbs = CallbackList(callbacks, trainer=self, params={"steps": steps,
                                                        "verbose": verbose})
    inputs = self.strategy.experimental_distribute_dataset(
        ({"x": b["x"]} for b in source.batches(0)), self._input_options,
        global_batch_size=static)
    return loop.predict(self.make_predict_function(), self.state, inputs,
                        self.strategy, cbs, ProgressBar(verbose, 1),
                        source.steps_per_epoch)

  def export(self) -> Any:
    """The trained model in its own terms.

    A linen module's variables (`{"params": ..., **collections}`, for
    `module.apply`); an nnx module, updated in place (also done by `fit`);
    an apply function's parameters.
    """
    self._require_state("export")
    state = self._read(self.state)
    return self._model.export(state.params, state.model_state)

  def load_checkpoint(self, directory, *, step: int | None = None) -> int:
    """Loads the weights and optimizer state of a checkpoint; returns its step.

    Reads checkpoints written by `ModelCheckpoint` or `BackupAndRestore`, on
    any number of devices or processes. A `save_weights_only` checkpoint
    loads the parameters and model state and keeps the optimizer's. Call
    `build(x)` first if the trainer has not run yet (the checkpoint must
    match the model's shapes).

    Raises:
      jdist.CheckpointNotFoundError: `directory` holds no checkpoint (a
        FileNotFoundError).
      jdist.CheckpointMismatchError: the checkpoint holds another model.
      jdist.CheckpointError: every checkpoint there is corrupt.
    """
    self._require_state("load a checkpoint into")
    ckpt = Checkpointer(directory)
    try:
      weights_only = _weights_only(ckpt, step)
      current_state = self._read(self.state)
      target = (current_state.replace(opt_state=()) if weights_only
                else current_state)
      restored = ckpt.restore(target, self.strategy.mesh, step=step)
    finally:
      ckpt.close()
    if restored is None:
      raise CheckpointNotFoundError(
          f"No checkpoint in {ckpt.directory}. Point load_checkpoint at the "
          "directory a ModelCheckpoint or BackupAndRestore wrote.")
    state, meta = restored
    if weights_only:  # Keras' load_weights: the optimizer and step stay
      self.state = self._write(self.state, current_state.replace(
          params=state.params, model_state=state.model_state))
      return int(meta["step"])
    self.state = self._write(self.state, state)  # its step comes with it
    return int(meta["step"])


def _check_count(value, name: str, *, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be a whole number, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {value}.")


def _batches_per_call(steps_per_execution: int, accumulation: int) -> int:
  """Batches each call of the train function runs: `steps_per_execution`,
  or one accumulation group when that is 1.

  Raises:
    ValueError: `steps_per_execution` would split an accumulation group.
  """
  if steps_per_execution == 1:
    return accumulation
  if steps_per_execution % accumulation:
    raise ValueError(
        f"steps_per_execution={steps_per_execution} is not a multiple of "
        f"gradient_accumulation_steps={accumulation}: a compiled call runs "
        "whole optimizer steps, each of gradient_accumulation_steps "
        f"batches. Use steps_per_execution=1 (one optimizer step per call) "
        f"or a multiple of {accumulation}.")
  return steps_per_execution


def _check_whole_groups(source, epochs: range, k: int) -> None:
  """Refuses, before the first step, an epoch among `epochs` whose known
  length leaves a trailing partial accumulation group."""
  if k == 1 or source.steps_per_epoch is None:
    return
  lengths = data_lib.epoch_lengths(source.steps_per_epoch, source.pass_length,
                                   epochs)
  n = next((n for n in sorted(lengths) if n % k), None)
  if n is None:
    return
  whole = n - n % k
  if n < source.steps_per_epoch:
    what = (f"steps_per_epoch={source.steps_per_epoch} does not divide the "
            f"data's {source.pass_length} batches: as in Keras, epochs "
            f"continue through the data, and the one that reaches its end "
            f"stops there after {n} batches, not a multiple of "
            f"gradient_accumulation_steps={k}")
  else:
    what = (f"An epoch of this data is {n} batches, not a multiple of "
            f"gradient_accumulation_steps={k}")
  raise ValueError(
      f"{what}: its last {n % k} batch(es) would not make a whole optimizer "
      "step. Keras carries their gradients into the next epoch; jdist "
      "applies whole groups only. Pass a batch_size that makes the number "
      f"of batches a multiple of {k}, or data of a multiple of {k} batches "
      f"(steps_per_epoch={whole} for a single epoch; over several, epochs "
      "continue through the data and the one that reaches its end is "
      "shorter), or a steps_per_epoch that is a multiple of "
      f"{k} and divides the data's batches.")


def _weights_only(ckpt: Checkpointer, step: int | None) -> bool:
  """Whether the checkpoint `load_checkpoint` will read holds weights only."""
  steps = [step] if step is not None else ckpt.steps()[-1:]
  if not steps:
    return False
  try:
    return bool(ckpt.read_meta(steps[-1]).get("weights_only"))
  except Exception:  # unreadable: restore reports it, with the fallback
    return False
