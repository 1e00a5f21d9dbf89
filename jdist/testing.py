"""Public test helpers: equivalence with a single device, fake devices.

Example:
  >>> import jdist.testing
  >>> callable(jdist.testing.assert_equivalent)
  True
"""

from jdist._src.equivalence import Trajectory
from jdist._src.equivalence import assert_equivalent
from jdist._src.equivalence import compare_trees
from jdist._src.equivalence import fake_cpu_devices
from jdist._src.equivalence import run_training

__all__ = [
    "Trajectory",
    "assert_equivalent",
    "compare_trees",
    "fake_cpu_devices",
    "run_training",
]
