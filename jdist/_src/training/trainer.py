"""`Trainer`: Keras' fit, evaluate and predict on any jdist strategy.

A thin facade: it wires the `TrainingProgram` (`program.py`), the compiled
steps (`step_functions.py`), the `FitLoop` (`loop.py`) and the data's
`Source`, and answers as Keras' `Model` does.
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
from jdist._src.training.callbacks import CallbackList, check_callbacks
from jdist._src.training.checks import DataChecks
from jdist._src.training.program import (TrainingProgram, TrainState,
                                         check_count)
from jdist._src.training.progress import ProgressBar

class Trainer:
  """Trains a flax model with an optax optimizer on a jdist strategy.

  Keras' `fit`, `evaluate` and `predict`: the per-replica step is built for
  you (loss scaled with `jdist.compute_average_loss`, gradients summed over
  replicas, a padded last batch masked out of losses and metrics). The
  strategy is the one passed in, else the one in scope (docs/fit.md).

  Args:
    model: a flax linen or nnx `Module`, a Keras 3 model (JAX backend), or
      `apply_fn(params, x)` (may take `train=` and `rng=`); a compiled Keras
      model brings its compile's arguments (docs/keras.md).
    optimizer: an optax `GradientTransformation`, or a Keras optimizer
      (object or name).
    loss: as in Keras: a `jdist.losses` or Keras loss, a name, or
      `loss(y_true, y_pred) -> (batch,)`; several outputs take a dict, a
      list or one loss for all.
    metrics: names, `jdist.metrics` or Keras metrics, or per-example
      functions, as a list or a dict (per output with several outputs).
    weighted_metrics: like `metrics`, weighted by the sample weights.
    loss_weights: as Keras's compile: the outputs' losses' weights.
    params: initial parameters: required for an apply function; for a linen
      module, its variables (skips initialisation).
    strategy: the strategy to run on; default: the current one.
    seed: seeds initialisation, shuffling and the training random stream.
    shard_optimizer_state: split the optimizer state over the replicas
      (ZeRO, docs/sharded_optimizer.md): the same updates, less memory.
    steps_per_execution: training batches per compiled call (Keras';
      default 1); per-batch callbacks run once per call (docs/throughput.md).
    dtype_policy: "float32" (default), "mixed_bfloat16", "mixed_float16" or
      a `jdist.DTypePolicy` (docs/accumulation_and_precision.md).
    gradient_accumulation_steps: K, as in Keras 3: K batches make one
      optimizer step; an epoch must hold a multiple of K batches
      (docs/accumulation_and_precision.md).
    micro_batches: M: each replica's batch (a multiple of M) runs as M
      micro-batches in one step: the same training, less memory.
    pad_to_replicas: pad a batch the replicas do not divide with masked
      rows instead of refusing it (docs/elastic.md).
    memory_budget: bytes a device may use ("16GB"): a step planned above it
      is a `jdist.MemoryBudgetError` before any state (docs/planning.md).

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

    A callback that replaces it during `fit` replaces what trains next.
    """
    return self._loop.state

  @state.setter
  def state(self, held: TrainState) -> None:
    self._loop.state = held

  @property
  def stop_training(self) -> bool:
    """Keras' flag: a callback sets it to end `fit` after the current batch."""
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
    """Optimizer steps applied so far (known on the host: waits for none)."""
    return self._loop.global_step

  @property
  def position(self) -> loop.Position:
    """The epoch and batch training is at (after `fit`, where it ended)."""
    return self._loop.position

  @property
  def steps_per_execution(self) -> int:
    """Training batches run per compiled call (Keras' attribute)."""
    return self._steps_per_execution

  @property
  def metrics_names(self) -> list[str]:
    """The names in the logs, as Keras' `model.metrics_names`."""
    if self._totals is not None:  # built for the data (several outputs)
      return ["loss"] + list(self._totals.metrics)
    return self._program.metrics_names

  @property
  def optimizer(self) -> optimizer_lib.OptimizerView:
    """The optimizer as Keras callbacks read it (`.learning_rate`,
    `.iterations`); also the optax transformation the train step applies."""
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
    """The compiled train step `fit` calls (Keras' `model.train_function`).

    A `jdist.DistributedFunction` (a `jdist.MultiStepFunction` with several
    batches per call); it donates the state it is given, as Keras 3's does.
    """
    return self.make_train_function()

  @property
  def test_function(self):
    """The compiled evaluation step (Keras' `model.test_function`)."""
    return self.make_test_function()

  @property
  def predict_function(self):
    """The compiled prediction step (Keras' `model.predict_function`)."""
    return self.make_predict_function()

  def make_train_function(self, force: bool = False):
    """Makes (once, or again with `force`) the compiled train step."""
    return self._step_functions().train(force)

  def make_test_function(self, force: bool = False):
    """Makes (once, or again with `force`) the compiled evaluation step."""
    return self._step_functions().test(force)

  def make_predict_function(self, force: bool = False):
    """Makes (once, or again with `force`) the compiled prediction step."""
    return self._step_functions().predict(force)

  def _step_functions(self) -> step_functions.StepFunctions:
    """The program's steps on the strategy (made once)."""
    if self._functions is None:
      self._functions = step_functions.StepFunctions(
          self._program, self.strategy,
          shard_optimizer_state=self._shard_optimizer_state,
          batches_per_call=self._batches_per_call)
    return self._functions

  # --- building ----------------------------------------------------------

  def build(self, x) -> TrainState:
    """Initialises parameters and optimizer state from a batch of inputs `x`."""
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
    """The value of held state."""
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
    """Checks the data against the model before any step; returns the
    static global batch size (None: the pipelines batch)."""
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
      x: arrays (with `y` and `batch_size`), or an iterable of `(x, y)`,
        `(x, y, sample_weight)` or `{"x", "y"}` global batches (a list, a
        tf.data or grain dataset, a generator), or a
        `jdist.DatasetCreator` (docs/fit.md says how each is read).
      y: targets, when `x` is arrays.
      batch_size: the global batch size for arrays (default 32), a multiple
        of the replicas; None for data that comes batched (as in Keras).
      epochs: epochs to train (counting those before `initial_epoch`).
      steps_per_epoch: batches per epoch (default: all of the data); shorter,
        epochs continue through the data as Keras's do.
      validation_data: `(x_val, y_val[, sample_weight])` arrays or batches,
        evaluated at the end of every epoch (logged as `val_*`).
      validation_split: for arrays, the last fraction held out for
        validation (taken before shuffling, as in Keras).
      validation_steps: batches per validation (default: all).
      validation_batch_size: batch size of validation arrays.
      shuffle: shuffle arrays every epoch (from the seed and the epoch, so a
        resume reproduces the order).
      sample_weight: for arrays, one weight per example (Keras' weighting).
      class_weight: `{class index: weight}`; multiplies the sample weights.
      callbacks: `jdist.Callback` instances.
      verbose: "auto" or 1 (a progress bar), 2 (a line per epoch), 0 (quiet);
        only process 0 prints.
      initial_epoch: the epoch to start at.

    Returns:
      The `History`; also `trainer.history`.
    """
    check_count(epochs, "epochs", minimum=0)
    check_count(initial_epoch, "initial_epoch", minimum=0)
    callbacks = check_callbacks(callbacks)  # before anything compiles
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
    """The `jdist.Plan` of `fit`'s train step on this data (as `fit` takes it).

    Memory per device, FLOPs and collectives of the program `fit`'s first
    step runs; builds nothing. None under parameter servers or for a
    `DatasetCreator` (docs/planning.md).
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

    Every example counts once, whatever the batch size and the replicas. The
    data is what `fit` takes (a dataset that repeats forever needs `steps`).
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

    `x` is what `fit` takes; a batch's targets are ignored, as in Keras.

    Returns:
      A numpy array (or a pytree of them), one row per example.
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

    A linen module's variables (for `module.apply`); an nnx module, updated
    in place (as `fit` does); an apply function's parameters.
    """
    self._require_state("export")
    return self._program.export(self._read(self.state))

  def load_checkpoint(self, directory, *, step: int | None = None) -> int:
    """Loads the weights and optimizer state of a checkpoint; returns its step.

    Reads `ModelCheckpoint` or `BackupAndRestore` checkpoints on any number
    of devices (docs/checkpoints.md). Call `build(x)` first if the trainer
    has not run yet.

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
