"""One process of the input-agreement tests: `python input_worker.py MODE OUT`.

Two processes with two fake CPU devices each (started by
test_input_agreement.py with jdist's environment variables). Each iterates
global batches of the same 1,000 numbered examples, shuffled, and records
what the replicas of all processes saw; results go to OUT/<mode>-<process>.npz.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jdist  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
strategy = jdist.MultiWorkerMirroredStrategy()

import jax  # noqa: E402
import numpy as np  # noqa: E402

ME = jax.process_index()
EXAMPLES, BATCH = 1000, 64  # 16 global batches, the last one of 40


class Shuffled:
  """Examples 0..999 in batches of 64, reshuffled on each pass (tf.data's
  `shuffle(..., seed=seed, reshuffle_each_iteration=True)`); seed None is
  an unseeded shuffle, different in every process."""

  def __init__(self, seed):
    self.seed, self.passes = seed, 0

  def __iter__(self):
    rng = np.random.default_rng(None if self.seed is None
                                else [self.seed, self.passes])
    self.passes += 1
    order = rng.permutation(EXAMPLES)
    for i in range(0, EXAMPLES, BATCH):
      ids = order[i:i + BATCH]
      yield {"id": ids.astype(np.float32), "y": ids % 10}


@strategy.function
def seen(batch):
  """The sum and the sum of squares of the ids in the global batch."""
  ctx = jdist.get_replica_context()
  ids = batch["id"] * ctx.example_mask
  return ctx.all_reduce("sum", jax.numpy.stack([ids.sum(), (ids ** 2).sum()]))


def host(x):
  return np.asarray(x.addressable_data(0))


def same_order():
  """Two epochs over a seeded shuffle: every process reads the same batches;
  the second epoch ends on an empty `get_next_as_optional()`."""
  dataset = strategy.experimental_distribute_dataset(Shuffled(seed=5))
  epochs = [[host(seen(batch)) for batch in dataset]]
  it, sums = iter(dataset), []
  while (optional := it.get_next_as_optional()).has_value():
    sums.append(host(seen(optional.get_value())))
  epochs.append(sums)
  spec = dataset.element_spec
  np.savez(os.path.join(OUT, f"same_order-{ME}.npz"), sums=np.array(epochs),
           spec=np.array([str(spec["id"].shape), str(spec["y"].dtype)]))
  print("same order: ran to the end", flush=True)


class OneLabelDiffers(Shuffled):
  """Process 1 reads one other label in global batch 11 (the second window
  of the agreement): the processes agree up to batch 10."""

  def __iter__(self):
    for i, batch in enumerate(super().__iter__()):
      if ME == 1 and i == 11:
        batch["y"] = batch["y"].copy()
        batch["y"][3] += 1
      yield batch


def different_order():
  steps = 0
  try:
    for batch in strategy.experimental_distribute_dataset(OneLabelDiffers(5)):
      seen(batch)
      steps += 1
  except jdist.DistributionError as e:
    print(f"caught after {steps} steps: {e}", flush=True)
  # The user's unseeded shuffle: both processes stop at the first batch.
  for batch in strategy.experimental_distribute_dataset(Shuffled(seed=None)):
    seen(batch)
  print("different order: ran to the end", flush=True)


{"same_order": same_order, "different_order": different_order}[MODE]()
