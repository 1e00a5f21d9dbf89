"""`Trainer`: Keras' fit, evaluate and predict on any jdist strategy.

A thin facade. The `TrainingProgram` (`program.py`) holds what training
computes, as pure functions; the strategy compiles its steps
(`step_functions.py`); the `FitLoop` (`loop.py`) owns the train state and
runs the batches that the data's `Source` (`source.py`) gives. The Trainer
wires them together, checks the data before any step (`checks.py`), and
answers as Keras' `Model` does (`history`, `stop_training`, `optimizer`,
`metrics_names`, `train_function`, ...).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from jdist._src import current
from jdist._src.input.options import InputOptions
from jdist._src.training import checkpoint_loading
from jdist._src.training import data as data_lib
from jdist._src.training import loop
from jdist._src.training import optimizer as optimizer_lib
from jdist._src.training import step_functions
from jdist._src.training import totals as totals_lib
from jdist._src.training.callbacks import CallbackList
from jdist._src.training.checks import DataChecks
from jdist._src.training.program import (TrainingProgram, TrainState,
                                         check_count)
from jdist._src.training.progress import ProgressBar

class Trainer:
  """Trains a flax model with an optax optimizer on a jdist strategy.

  The per-replica step is built for you: the model runs on each replica's
  shard of the global batch, the loss is scaled with
  `jdist.compute_average_loss`, gradients arrive summed over replicas, and
  losses and metrics are exact on a padded last batch. The strategy is the
  one passed in, or the one whose scope is open when the trainer is made
  (or, failing that, when it is first used).

  Args:
    model: a flax linen `Module`, a flax nnx `Module`, a Keras 3 model (JAX
      backend), or an apply function `apply_fn(params, x)` (which may also
      take `train=` and `rng=`). A compiled Keras model brings its compile's
      arguments (one given here with another value is an error).
    optimizer: an optax `GradientTransformation`, or a Keras optimizer
      (object or name). For `LearningRateScheduler`, build an optax one with
      `optax.inject_hyperparams`.
    loss: as in Keras: a `jdist.losses` object (e.g.
      `jdist.losses.SparseCategoricalCrossentropy(from_logits=True)`), a
      Keras loss, a name ("sparse_categorical_crossentropy",
      "categorical_crossentropy", "binary_crossentropy": probabilities, as in
      Keras; "mse", "mae"), or a per-example function `loss(y_true, y_pred)
      -> (batch,)`. With several outputs, as in Keras: `{output name: loss}`,
      a list in the outputs' order, or one loss for all (logs add
      `<output>_loss`).
    metrics: names ("accuracy", "mse", ...), `jdist.metrics` or Keras metric
      objects, or per-example functions `metric(y_true, y_pred)`, as a list,
      or a dict `{name: metric}`. With several outputs, as in Keras: `{output
      name: metrics}` or a list per output (logged as `<output>_<metric>`).
    weighted_metrics: like `metrics`, weighted by the data's sample weights
      (one named as a metric is logged as `weighted_<name>`, as in Keras).
    loss_weights: as Keras's compile: the outputs' losses are summed times
      these weights (a dict or list like `loss`, or one number).
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
      argument; default 1): the host dispatches once per group of them, which
      speeds up small models (and is what TPUs want). The results are those of
      one step per call. As in Keras, per-batch callbacks are called once per
      execution: `on_train_batch_begin` with the index of its first batch,
      `on_train_batch_end` with its last; checkpoints every `save_freq` steps
      are saved at the end of the execution that reaches them. `evaluate` and
      `predict` run one batch per call.
    dtype_policy: mixed precision, by Keras' names: "float32" (default),
      "mixed_bfloat16" or "mixed_float16" (or a `jdist.DTypePolicy`). A
      Keras model computes under its own layers' policy (Keras's
      `keras.config.set_dtype_policy` when it was built), which is then
      the default, and any other is an error. The
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
    pad_to_replicas: a batch that the replicas (times M micro-batches, and
      under FSDP the devices that split each replica's batch) do not divide
      is padded with masked rows to the next multiple, as a short last batch
      is, instead of refused (`jdist.InputOptions`' option of this name).
      Losses and metrics leave the padding out, so training is the same on
      any number of replicas: a job under `jdist launch --nnodes MIN:MAX`
      restarted on fewer processes keeps its `batch_size`.
    memory_budget: bytes a device may use (an int, or "16GB"), in place of
      its own `bytes_limit` (CPUs report none): `fit` plans its step first
      (`plan`) and raises `jdist.MemoryBudgetError` before building the
      state when the step's peak per device exceeds the limit.

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

  def __init__(self, model, *, optimizer=None, loss=None, metrics=None,
               weighted_metrics=None, loss_weights=None, params=None,
               strategy=None, seed: int = 0,
               shard_optimizer_state: bool = False,
               steps_per_execution: int | None = None, dtype_policy=None,
               gradient_accumulation_steps: int = 1, micro_batches: int = 1,
               pad_to_replicas: bool = False, memory_budget=None):
    self._program, steps_per_execution = TrainingProgram.with_compile(
        model, dict(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                    metrics=metrics, weighted_metrics=weighted_metrics,
                    steps_per_execution=steps_per_execution),
        params=params, dtype_policy=dtype_policy, micro_batches=micro_batches,
        batches_per_step=gradient_accumulation_steps)
    self._steps_per_execution = steps_per_execution
    self._batches_per_call = step_functions.batches_per_call(
        self._program, steps_per_execution,
        shard_optimizer_state=bool(shard_optimizer_state))
    self._shard_optimizer_state = bool(shard_optimizer_state)
    self._input_options = InputOptions(pad_to_replicas=pad_to_replicas)
    self._seed = int(seed)
    self._strategy = strategy or (current.get_strategy()
                                  if current.has_strategy() else None)
    self._loop = loop.FitLoop(self._strategy)  # owns the state, always
    self._functions = None  # the steps compiled by the strategy
    self._checks = DataChecks(self._program)
    self._memory_budget = step_functions.parse_budget(memory_budget)
    self._count_flops = getattr(model, "train_flops", None)
    self._plans = {}  # the train step's plan, by what it depends on
    # Built from the first data's shapes (a metric's form may depend on them).
    self._totals: totals_lib.Totals | None = None

  # --- Keras' attributes ---------------------------------------------------

  @property
  def strategy(self):
    """The strategy steps run on."""
    if self._strategy is None:
      self._strategy = self._loop.strategy = current.get_strategy()
    return self._strategy

  @property
  def state(self) -> TrainState | None:
    """The train state (None before `build`), held as the strategy holds it.

    It is the fit loop's: a callback that replaces it during `fit`
    (restoring weights, as Keras callbacks do) replaces what trains next.
    """
    return self._loop.state

  @state.setter
  def state(self, held: TrainState) -> None:
    self._loop.state = held

  @property
  def stop_training(self) -> bool:
    """Keras' flag: a callback sets it to end `fit` after the current batch.

    Each fit starts with False, as in Keras; afterwards, it says whether the
    last fit was stopped.
    """
    return self._loop.stop_training

  @stop_training.setter
  def stop_training(self, value: bool) -> None:
    self._loop.stop_training = bool(value)

  @property
  def history(self):
    """The last fit's `History` (Keras' `model.history`); None before."""
    return self._loop.history

  @property
  def params(self):
    """The model's current parameters (mirrored arrays)."""
    state = self.state
    return None if state is None else self._read(state).params

  @property
  def global_step(self) -> int:
    """Optimizer steps applied so far: the train state's step (known on the
    host, so reading it waits for no step)."""
    return self._loop.global_step

  @property
  def position(self) -> loop.Position:
    """The epoch and batch training is at (during `fit`; after it, where it
    ended)."""
    return self._loop.position

  @property
  def steps_per_execution(self) -> int:
    """Training batches run per compiled call (Keras' attribute)."""
    return self._steps_per_execution

  @property
  def metrics_names(self) -> list[str]:
    """The names in the logs, as Keras' `model.metrics_names`: "loss", then
    the metrics and the weighted metrics."""
    if self._totals is not None:  # built for the data (several outputs)
      return ["loss"] + list(self._totals.metrics)
    return self._program.metrics_names

  @property
  def optimizer(self) -> optimizer_lib.OptimizerView:
    """The optimizer, as Keras callbacks read it: `trainer.optimizer.
    learning_rate` (needs `optax.inject_hyperparams`), `.iterations`; it
    also works as the optax transformation the train step applies (loss
    scaled under "mixed_float16", sharded with `shard_optimizer_state`)."""
    return optimizer_lib.OptimizerView(
        self, self._step_functions().program.optimizer)

  @property
  def learning_rate(self) -> float:
    """The optimizer's learning rate (needs `optax.inject_hyperparams`)."""
    self._require_state("read or set the learning rate")
    return optimizer_lib.learning_rate(self._read(self.state).opt_state)

  @learning_rate.setter
  def learning_rate(self, value: float) -> None:
    self._require_state("read or set the learning rate")
    held = self.state
    now = self._read(held)
    # Written in place of the state the hyperparameter is in; the step
    # count stays (the loop reads it again from the new state).
    self.state = self._write(held, now.replace(
        opt_state=optimizer_lib.with_learning_rate(now.opt_state, value)))

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

  def make_train_function(self, force: bool = False):
    """Makes (once, or again with `force`) and returns the compiled train
    step, as Keras 3's `model.make_train_function()`; see
    `train_function`."""
    return self._step_functions().train(force)

  def make_test_function(self, force: bool = False):
    """Makes (once, or again with `force`) and returns the compiled
    evaluation step; see `test_function`."""
    return self._step_functions().test(force)

  def make_predict_function(self, force: bool = False):
    """Makes (once, or again with `force`) and returns the compiled
    prediction step; see `predict_function`."""
    return self._step_functions().predict(force)

  def _step_functions(self) -> step_functions.StepFunctions:
    """The program's steps on the strategy (made once: a sharded optimizer
    holds the strategy, fixed from the first use on)."""
    if self._functions is None:
      self._functions = step_functions.StepFunctions(
          self._program, self.strategy,
          shard_optimizer_state=self._shard_optimizer_state,
          batches_per_call=self._batches_per_call)
    return self._functions

  # --- building ----------------------------------------------------------

  def build(self, x) -> TrainState:
    """Initialises parameters and optimizer state from a batch of inputs `x`.

    `fit`, `evaluate` and `predict` call it with their first batch.
    """
    if self.state is None:
      init_key, rng_key = jax.random.split(jax.random.key(self._seed))
      sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)
      self._checks.initialised_with(sample)
      program = self._step_functions().program
      with self.strategy.mesh_scope(strict=False):  # shapes only
        program.check_init(init_key, sample)
      # Made by the strategy: under ModelParallelStrategy each array is born
      # in its layout (compiled with output shardings), never whole.
      self.state = self.strategy.init(program.init, init_key, rng_key, sample)
    return self.state

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

  def _prepare(self, source, what: str, *, with_loss: bool = True,
               micro_batches: int = 1) -> int | None:
    """Checks the data against the model before any step (`checks.py`),
    tracing it under the strategy's mesh; returns the static global batch
    size (None: the pipelines batch).

    Args:
      what: the data's name in messages ("training data", ...).
      with_loss: the data has targets to check against the loss.
      micro_batches: the micro-batches each replica's share is split into
        (gradient accumulation, when training).
    """
    with self.strategy.mesh_scope():
      return self._checked(source, what, with_loss=with_loss,
                           micro_batches=micro_batches)

  def _checked(self, source, what: str, *, with_loss: bool,
               micro_batches: int) -> int | None:
    """`_prepare` under the strategy's mesh."""
    sample = source.peek()
    self.build(sample["x"])
    strategy = self.strategy
    abstract = strategy.state_placement.abstract(self.state)
    y_pred = self._checks.outputs(sample, abstract, what)
    static = source.static_batch_size(
        strategy, what, micro_batches=micro_batches,
        pad=self._input_options.pad_to_replicas)
    if not with_loss:
      return static
    if "y" not in sample:
      raise ValueError(f"The {what} has no targets y.")
    if self._totals is None:
      self._totals = totals_lib.Totals(
          strategy, self._program.metrics_for(sample["y"], y_pred),
          scales_loss=self._program.scales_loss)
    self._checks.objectives(source, sample, lambda: self._read(self.state),
                            abstract, self._totals.metrics, what)
    return static

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
    check_count(epochs, "epochs", minimum=0)
    check_count(initial_epoch, "initial_epoch", minimum=0)
    source = data_lib.make_source(
        x, y, batch_size=batch_size, steps_per_epoch=steps_per_epoch,
        shuffle=shuffle, seed=self._seed, sample_weight=sample_weight,
        class_weight=class_weight, strategy=self.strategy)
    source, val_source = data_lib.validation_source(
        source, validation_data, validation_split=validation_split,
        steps=validation_steps, batch_size=validation_batch_size)
    # Under a known memory limit, the step is planned and checked before
    # the state is built (jdist.MemoryBudgetError); else after (the logs'
    # FLOPs): the plan compiles what the first step runs, once.
    planned = self._plan(source, detail=False, limited=True)
    if planned is not None:
      planned.check()
    static = self._prepare(source, "training data",
                           micro_batches=self._program.micro_batches)
    planned = planned or self._plan(source, detail=False)
    validate = None
    if val_source is not None:
      val_static = self._prepare(val_source, "validation data")
      validate = lambda state, cbs: self._evaluate_source(
          val_source, val_static, state, cbs)
    plan = loop.FitPlan(
        self.make_train_function(), source, epochs,
        make_totals=self._totals.new,
        read_logs=self._totals.logs_reader, initial_epoch=initial_epoch,
        validate=validate, batch_size=static, options=self._input_options,
        steps_per_execution=self._batches_per_call,
        batches_per_step=self._program.batches_per_step,
        skipped=self._totals.skipped_batches(self._program.batches_per_step))
    cbs = CallbackList(callbacks, trainer=self,
                       params={"epochs": epochs, "verbose": verbose,
                               "steps": source.steps_per_epoch},
                       fit_loop=self._loop)
    bar = ProgressBar(verbose, epochs, plan=planned,
                      batches_per_call=self._batches_per_call)
    try:
      # A mesh the user set (the strategy's) set aside: jdist's programs
      # over the state (steps, checkpoints) run as they do without one.
      with self.strategy.outside_user_mesh():
        self._loop.run(plan, cbs, bar)
    finally:
      bar.close()
      cbs.close()
    if self._program.model.writes_back:
      self.export()
    return self.history

  def plan(self, x=None, y=None, *, batch_size: int | None = None,
           sample_weight=None, class_weight: dict | None = None):
    """The `jdist.Plan` of `fit`'s train step on this data (as `fit` takes
    it), from the program `fit`'s first step runs: memory per device by
    kind, FLOPs (and the model's own count, from a `train_flops(x)` method),
    collectives, layout notes, and over the memory limit the alternatives
    planned. Builds nothing; None under parameter servers or for a
    `DatasetCreator` (see docs/planning.md).
    """
    return self._plan(data_lib.make_source(
        x, y, batch_size=batch_size, seed=self._seed,
        sample_weight=sample_weight, class_weight=class_weight,
        strategy=self.strategy), detail=True)

  def _plan(self, source, *, detail: bool, limited: bool = False):
    """The train step's plan on `source` (`step_functions.py`)."""
    planned, self._totals = step_functions.TrainPlanner(
        self._step_functions(), self._checks, self._seed, self._input_options,
        self._batches_per_call, self._shard_optimizer_state,
        self._memory_budget, self._count_flops, detail, self._plans).plan(
            source, self.state, self._totals, limited=limited)
    return planned

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
    static = self._prepare(source, "evaluation data")
    cbs = CallbackList(callbacks, trainer=self, params={"steps": steps,
                                                        "verbose": verbose})
    with self.strategy.outside_user_mesh():  # as fit's loop
      return self._evaluate_source(source, static, self.state, cbs,
                                   verbose=verbose)

  def _evaluate_source(self, source, static: int | None, state,
                       cbs: CallbackList, verbose=0) -> dict:
    batches = source.distributed(self.strategy, 0, options=self._input_options,
                                 batch_size=static)
    return loop.evaluate(self.make_test_function(), state, batches,
                         self._totals.new(), self._totals.means, cbs,
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
    static = self._prepare(source, "prediction data", with_loss=False)
    cbs = CallbackList(callbacks, trainer=self, params={"steps": steps,
                                                        "verbose": verbose})
    inputs = source.distributed(self.strategy, 0, options=self._input_options,
                                batch_size=static, inputs_only=True)
    with self.strategy.outside_user_mesh():  # as fit's loop
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
    return self._program.export(self._read(self.state))

  def load_checkpoint(self, directory, *, step: int | None = None) -> int:
    """Loads the weights and optimizer state of a checkpoint; returns its step.

    Reads checkpoints written by `ModelCheckpoint` or `BackupAndRestore`, on
    any number of devices or processes. A `save_weights_only` checkpoint
    loads the parameters and model state and keeps the optimizer's. Call
    `build(x)` first if the trainer has not run yet (the checkpoint must
    match the model's shapes). A model that holds its variables (a Keras
    model, an nnx module) holds the loaded values afterwards.

    Raises:
      jdist.CheckpointNotFoundError: `directory` holds no checkpoint (a
        FileNotFoundError).
      jdist.CheckpointMismatchError: the checkpoint holds another model.
      jdist.CheckpointError: every checkpoint there is corrupt.
    """
    self._require_state("load a checkpoint into")
    self.state, loaded = checkpoint_loading.load(
        directory, self.state, self.strategy, step=step)
    if self._program.model.writes_back:
      self.export()  # the model object holds them, as after Keras's load_weights
    return loaded
