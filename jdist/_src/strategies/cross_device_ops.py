"""TensorFlow's `cross_device_ops` choices, accepted with what they mean here."""

from __future__ import annotations

from typing import Any


class CrossDeviceOps:
  """Base class of the accepted `cross_device_ops` values (TF's names); all
  mean XLA's all-reduce, and any other value is refused.

  Example:
    >>> import jdist
    >>> strategy = jdist.MirroredStrategy(
    ...     cross_device_ops=jdist.HierarchicalCopyAllReduce())
    >>> strategy.cross_device_ops
    HierarchicalCopyAllReduce()
  """

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"

  def __eq__(self, other) -> bool:
    return type(self) is type(other)

  def __hash__(self) -> int:
    return hash(type(self))


class NcclAllReduce(CrossDeviceOps):
  """TF's NCCL all-reduce; here XLA's all-reduce (NCCL on GPU).

  Args:
    num_packs: accepted for TF's signature; XLA packs the gradients itself.
  """

  def __init__(self, num_packs: int = 1):
    del num_packs


class HierarchicalCopyAllReduce(CrossDeviceOps):
  """TF's hierarchical copy (DGX-1 topologies); here XLA's all-reduce.

  Args:
    num_packs: accepted for TF's signature; XLA packs the gradients itself.
  """

  def __init__(self, num_packs: int = 1):
    del num_packs


class ReductionToOneDevice(CrossDeviceOps):
  """TF's reduce-on-one-device-then-broadcast; here XLA's all-reduce.

  Args:
    reduce_to_device, accumulation_fn: accepted for TF's signature.
  """

  def __init__(self, reduce_to_device=None, accumulation_fn=None):
    del reduce_to_device, accumulation_fn


_TF_NAMES = {"NcclAllReduce": NcclAllReduce,
             "HierarchicalCopyAllReduce": HierarchicalCopyAllReduce,
             "ReductionToOneDevice": ReductionToOneDevice}


def from_argument(value: Any) -> CrossDeviceOps | None:
  """`cross_device_ops` as jdist keeps it: None, or one of the classes above
  (TF's own instances map to theirs); a TypeError for any other value."""
  if value is None or isinstance(value, CrossDeviceOps):
    return value
  cls = type(value)
  if cls.__module__.startswith("tensorflow") and cls.__name__ in _TF_NAMES:
    return _TF_NAMES[cls.__name__]()
  raise TypeError(
      f"cross_device_ops={value!r} is not one of TensorFlow's cross-device "
      "ops. Pass jdist.NcclAllReduce(), jdist.HierarchicalCopyAllReduce() or "
      "jdist.ReductionToOneDevice() (or TF's own), or leave it out: in jdist "
      "the all-reduce is XLA's, chosen by the compiler, and all three mean "
      "it.")
