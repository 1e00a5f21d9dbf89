"""Where `fit`, `evaluate` and `predict` get their data: one `Source`
(`source.py`) for whatever was passed.
"""

from __future__ import annotations

import jax
import numpy as np

from jdist._src.training import batches as batches_lib
from jdist._src.training import iterable_source
from jdist._src.training.array_source import ArraySource
from jdist._src.training.dataset_creator import CreatorSource, DatasetCreator
from jdist._src.training.source import Source


def make_source(x, y=None, *, batch_size=None, steps_per_epoch=None,
                shuffle=False, seed=0, need_y=True, sample_weight=None,
                class_weight=None, strategy=None) -> Source:
  """The source for what was passed as `x` (and `y`); `strategy` is fit's
  (None for `evaluate` and `predict`, which refuse a `DatasetCreator`).
  TypeError, ValueError say what to pass instead of unreadable data."""
  if x is None:
    raise ValueError("No data: pass arrays (x=, y=) or an iterable of batches.")
  if steps_per_epoch is not None and (
      isinstance(steps_per_epoch, bool) or int(steps_per_epoch) <= 0):
    raise ValueError(f"steps_per_epoch (or steps) must be a positive number "
                     f"of batches, got {steps_per_epoch!r}.")
  if isinstance(x, DatasetCreator):
    return _creator_source(x, y, batch_size=batch_size,
                           steps_per_epoch=steps_per_epoch,
                           sample_weight=sample_weight,
                           class_weight=class_weight, strategy=strategy)
  if y is not None or isinstance(x, (np.ndarray, jax.Array, dict)):
    source = ArraySource(x, y, batch_size=batch_size, shuffle=shuffle,
                         seed=seed, need_y=need_y, sample_weight=sample_weight,
                         class_weight=class_weight)
    if steps_per_epoch is not None:
      source.steps_per_epoch = min(source.steps_per_epoch, int(steps_per_epoch))
    return source
  return _batches_source(x, batch_size=batch_size,
                         steps_per_epoch=steps_per_epoch, need_y=need_y,
                         sample_weight=sample_weight, class_weight=class_weight)


def _creator_source(creator, y, *, batch_size, steps_per_epoch, sample_weight,
                    class_weight, strategy) -> CreatorSource:
  """A `DatasetCreator`'s source, for fit under `strategy`."""
  if strategy is None:
    raise TypeError(
        "A jdist.DatasetCreator feeds fit only: evaluate and predict take "
        "arrays or a dataset of batches.")
  given = {"y": y, "batch_size": batch_size, "sample_weight": sample_weight}
  extra = [k for k, v in given.items() if v is not None]
  if extra:
    raise ValueError(
        f"fit(jdist.DatasetCreator(...)) takes no {', '.join(extra)}: "
        "dataset_fn's batches carry their targets and weights, batched as "
        "it batches them.")
  return CreatorSource(creator, num_replicas=strategy.num_replicas_in_sync,
                       steps_per_epoch=steps_per_epoch,
                       class_weight=class_weight)


def _batches_source(x, *, batch_size, steps_per_epoch, need_y, sample_weight,
                    class_weight) -> Source:
  """Data already in batches (Keras takes no `batch_size`, `sample_weight`)."""
  if batch_size is not None and iterable_source.is_tf_dataset(x):
    raise ValueError(
        f"batch_size={batch_size} was given with a tf.data.Dataset, which "
        "makes its own batches: leave batch_size=None (as Keras requires) and "
        "batch the dataset with the global batch size, dataset.batch(N), N a "
        "multiple of the number of replicas.")
  if batch_size is not None:
    raise ValueError(
        "batch_size= applies to arrays; the data is already in batches. Batch "
        "it with the global batch size (a multiple of the number of replicas).")
  if sample_weight is not None:
    raise ValueError(
        "sample_weight= applies to arrays; batches carry their own weights: "
        "(x, y, sample_weight) or {'x', 'y', 'sample_weight'}.")
  batches_lib.check_class_weight(class_weight)
  if iterable_source.is_tf_dataset(x):
    return iterable_source.tf_dataset_source(
        x, steps_per_epoch=steps_per_epoch, need_y=need_y,
        class_weight=class_weight)
  try:
    it = iter(x)
  except TypeError:
    raise TypeError(
        f"Cannot read data from {type(x).__name__} {x!r}: pass arrays "
        "(x=, y=), or an iterable of (x, y) batches (a list, a tf.data or "
        "grain dataset, a generator).") from None
  if it is x:
    return iterable_source.IteratorSource(
        x, steps_per_epoch=steps_per_epoch, need_y=need_y,
        class_weight=class_weight)
  return iterable_source.IterableSource(
      x, steps_per_epoch=steps_per_epoch, need_y=need_y,
      class_weight=class_weight)


def validation_source(source, validation_data, *, validation_split: float,
                      steps: int | None, batch_size: int | None):
  """`(training source, validation source or None)` from fit's arguments."""
  val = None
  if validation_split:
    if not isinstance(source, ArraySource):
      raise ValueError("validation_split needs arrays; pass validation_data "
                       "for other kinds of data.")
    source, val = source.split(validation_split, batch_size)
  if validation_data is not None:
    vsw = None
    if isinstance(validation_data, tuple):
      if not 1 <= len(validation_data) <= 3:
        raise ValueError(
            f"validation_data has {len(validation_data)} parts; give (x, y), "
            "(x, y, sample_weight) or a dataset of batches.")
      vx, vy, vsw = (validation_data + (None, None))[:3]
    else:
      vx, vy = validation_data, None
    if vy is not None:
      batch_size = batch_size or getattr(source, "batch_size", None)
    else:
      batch_size = None
    val = make_source(vx, vy, batch_size=batch_size, steps_per_epoch=steps,
                      sample_weight=vsw)
  return source, val
