"""Keras' metrics for custom training loops, exact under any strategy.

Update a metric inside a step (`m = m.update(y_true, y_pred)`; the padding
of a short last batch is left out), return it, and read `m.result()`
outside: the mean over every real example of every replica and process.
`m.sums()` reads the running `{"total", "count"}` (what a checkpoint keeps)
and `m.with_sums(sums)` continues from them, on any number of devices.

Example:
  >>> import jdist, jax.numpy as jnp, numpy as np
  >>> strategy = jdist.MirroredStrategy()
  >>> acc = jdist.metrics.SparseCategoricalAccuracy()
  >>> step = strategy.function(lambda acc, b: acc.update(b["y"], b["logits"]))
  >>> data = [{"y": np.array([1, 0, 1]), "logits": np.array([[0., 1], [1, 0], [1, 0]])}]
  >>> for batch in strategy.experimental_distribute_dataset(data):
  ...   acc = step(acc, batch)
  >>> round(float(acc.result()), 4)
  0.6667
"""

from jdist._src.ops.metrics import Accuracy
from jdist._src.ops.metrics import BinaryAccuracy
from jdist._src.ops.metrics import CategoricalAccuracy
from jdist._src.ops.metrics import Mean
from jdist._src.ops.metrics import MeanAbsoluteError
from jdist._src.ops.metrics import MeanMetricWrapper
from jdist._src.ops.metrics import MeanSquaredError
from jdist._src.ops.metrics import Metric
from jdist._src.ops.metrics import SparseCategoricalAccuracy
from jdist._src.ops.metrics import Sum

__all__ = [
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "Sum",
]
