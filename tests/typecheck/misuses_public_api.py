"""Wrong uses of the public API that mypy must refuse, never run.

Each wrong line ends with `# refused: <mypy error code>`; tests/test_typing.py
expects exactly these errors, on these lines, and no others.
"""

import numpy as np

import jdist
from jdist import Trainr  # refused: attr-defined

strategy = jdist.MirroredStrategy(axis_name=0)  # refused: arg-type
mirrored = jdist.MirorredStrategy()  # refused: attr-defined
replicas: str = strategy.num_replicas_in_sync  # refused: assignment
op = jdist.ReduceOp.SUMM  # refused: attr-defined


def apply(params: dict, x: np.ndarray) -> np.ndarray:
  return x @ params["w"]


trainer = jdist.Trainer(apply, params={"w": np.zeros((4, 1))},
                        optimizer=None, loss="mse")
trainer.fit(np.zeros((8, 4)), np.zeros((8, 1)),
            batch_size="8")  # refused: arg-type
