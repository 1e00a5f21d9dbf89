"""What the Trainer checks of its data before any step runs.

The model, loss and metrics are traced on the first batch and the targets
checked against the loss (docs/fit.md), so a mismatch is an error naming the
data before anything compiles. Tracing is not free: each shape once.
"""

from __future__ import annotations

import functools
from typing import Callable

from jdist._src.training import objectives
from jdist._src.training import outputs
from jdist._src.training import steps
from jdist._src.training.program import TrainingProgram


class DataChecks:
  """The checks of one Trainer's data, each done once per shape.

  Args:
    program: the `TrainingProgram` the data is checked against.

  Attributes:
    initialised_for: the `steps.input_spec` the model was initialised from.
  """

  def __init__(self, program: TrainingProgram):
    self._program = program
    self.initialised_for = None
    # (data spec, state spec) -> the model's output spec; and the keys whose
    # loss and metrics were traced against it and found to fit.
    self._output_specs: dict = {}
    self._objectives_checked: set = set()
    self._checked_first_batch = False

  def initialised_with(self, sample) -> None:
    """Notes the inputs the model is initialised from (one example)."""
    self.initialised_for = steps.input_spec(sample)

  def outputs(self, sample: dict, abstract_state, what: str):
    """The model's output shapes for `sample` (traced once per shape);
    TypeError, ValueError if the model does not take the data's inputs."""
    key = _key(sample, abstract_state)
    if key not in self._output_specs:
      self._output_specs[key] = steps.output_spec(
          self._program.model, abstract_state, sample, what,
          self.initialised_for)
    return self._output_specs[key]

  def shapes(self, sample: dict, abstract_state, metrics: dict, what: str):
    """Checks the loss and `metrics` against the targets' and predictions'
    shapes (once per shape); returns the predictions' shapes.

    Raises:
      TypeError, ValueError: the model, the loss or a metric does not fit.
    """
    y_pred = self.outputs(sample, abstract_state, what)
    key = _key(sample, abstract_state)
    if key not in self._objectives_checked:
      steps.check_objectives(self._program.loss, metrics, sample, y_pred,
                             what)
      self._objectives_checked.add(key)
    return y_pred

  def objectives(self, source, sample: dict, read_state: Callable,
                 abstract_state, metrics: dict, what: str) -> None:
    """Checks the loss and `metrics` against the shapes, the first batch's
    predictions, and every target of `source` (batches as they are read).

    Args:
      read_state: gives the train state's value (read only when needed).

    Raises:
      ValueError: the loss or a metric does not fit the targets or the
        predictions.
    """
    program = self._program
    y_pred = self.shapes(sample, abstract_state, metrics, what)
    checked = outputs.parts(program.loss, y_pred)
    if not self._checked_first_batch:
      self._checked_first_batch = True
      predictions = steps.predictions(program.model, read_state(),
                                      sample["x"])
      for loss, _, pred in checked:
        objectives.check_predictions(loss, pred(predictions))
    checks = [functools.partial(
        objectives.check_targets, loss,
        num_classes=pred(y_pred).shape[-1] if pred(y_pred).ndim > 1 else None)
        for loss, _, pred in checked]

    def check_targets(y, where):
      for check, (_, true, _) in zip(checks, checked):
        check(true(y), where)
    source.check_targets(check_targets)


def _key(sample: dict, abstract_state) -> tuple:
  return steps.spec_key(sample), steps.spec_key(abstract_state)
