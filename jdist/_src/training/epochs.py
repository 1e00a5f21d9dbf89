"""Which batches each epoch of a fit holds, and the rules on them.

As in Keras, an epoch shorter than a pass continues it; epoch `e`'s batches
depend on `e` and the lengths alone, so a resume finds them again. An epoch
must hold whole accumulation groups (docs/accumulation_and_precision.md).
"""

from __future__ import annotations

import warnings


def epoch_span(epoch: int, steps_per_epoch: int | None,
               pass_length: int | None) -> tuple[int, int, int | None]:
  """`(pass, first batch of it, number of batches)` of epoch `epoch`: the
  next epoch continues the pass, an epoch that reaches its end stops there.

  Example:
    >>> from jdist._src.training.epochs import epoch_span
    >>> [epoch_span(e, 3, 7) for e in range(4)]
    [(0, 0, 3), (0, 3, 3), (0, 6, 1), (1, 0, 3)]
  """
  if (steps_per_epoch is None or pass_length is None or
      steps_per_epoch >= pass_length):
    return epoch, 0, steps_per_epoch
  per_pass = -(-pass_length // steps_per_epoch)
  pass_index, j = divmod(epoch, per_pass)
  first = j * steps_per_epoch
  return pass_index, first, min(steps_per_epoch, pass_length - first)


def epoch_lengths(steps_per_epoch: int | None, pass_length: int | None,
                  epochs: range) -> set:
  """The lengths of epochs `epochs`, a short one at a pass's end included."""
  if (steps_per_epoch is None or pass_length is None or
      steps_per_epoch >= pass_length):
    return {steps_per_epoch} if len(epochs) else set()
  per_pass = -(-pass_length // steps_per_epoch)
  return {epoch_span(e, steps_per_epoch, pass_length)[2]
          for e in epochs[:per_pass]}


def warn_short(steps_per_epoch: int, pass_length: int, count: int) -> None:
  warnings.warn(
      f"steps_per_epoch={steps_per_epoch} does not divide the data's "
      f"{pass_length} batches: as in Keras, each epoch continues where the "
      f"last stopped, and the epoch that reaches the end of the data stops "
      f"there, after {count} batch(es); the next starts a new pass. Pass a "
      f"steps_per_epoch that divides {pass_length} for epochs of one length.",
      UserWarning, stacklevel=3)


def warn_mid_pass_start(source, initial_epoch: int, stacklevel: int = 3
                        ) -> None:
  """Warns when `fit(initial_epoch=...)` starts inside a pass (Keras starts
  every `fit` at the data's first batch; jdist at an uninterrupted fit's)."""
  _, first, _ = epoch_span(initial_epoch, source.steps_per_epoch,
                           source.pass_length)
  if initial_epoch and first:
    warnings.warn(
        f"fit(initial_epoch={initial_epoch}) starts at batch {first} of the "
        f"data: with steps_per_epoch={source.steps_per_epoch} over "
        f"{source.pass_length} batches, epoch {initial_epoch + 1} trains on "
        "what it would in one fit from epoch 1 (jdist's epochs are a "
        "function of their number, so a second fit continues the first). "
        "Keras starts every fit call at the data's first batch.",
        UserWarning, stacklevel=stacklevel)




def check_whole_groups(source, epochs: range, k: int,
                       per_call: int = 1) -> None:
  """ValueError, before the first step, for an epoch of known length that
  leaves a partial group of `k` (or `per_call`) batches."""
  if source.whole_calls:
    if source.steps_per_epoch % per_call:
      raise ValueError(
          f"fit(jdist.DatasetCreator(...)) with steps_per_epoch="
          f"{source.steps_per_epoch}: each compiled call takes {per_call} "
          "batches (steps_per_execution, gradient_accumulation_steps), so "
          f"steps_per_epoch must be a multiple of {per_call}.")
    return
  if k == 1 or source.steps_per_epoch is None:
    return
  lengths = epoch_lengths(source.steps_per_epoch, source.pass_length, epochs)
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


def check_group_end(epoch: int, index: int, batches: int, k: int) -> None:
  """ValueError before a call of `batches` from batch `index` that leaves a
  partial group of `k` (an epoch of unknown length ending)."""
  if batches % k == 0:
    return
  raise ValueError(
      f"Epoch {epoch + 1} ended after {index + batches} batches, not a "
      f"multiple of gradient_accumulation_steps={k}: its last {batches % k} "
      "batch(es) cannot make a whole optimizer step and were not trained "
      "on (the steps before stay applied). Keras carries their gradients "
      "into the next epoch; jdist applies whole groups only. Pass "
      f"steps_per_epoch as a multiple of {k}, with data that lasts.")
