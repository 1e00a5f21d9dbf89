"""What a compiled step says about itself, before it runs: XLA's analyses,
its collectives and its compute dtype (read before XLA's passes)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import jax

from jdist._src.diagnose import hlo
from jdist._src.planning import memory as memory_lib

# A matrix product or a convolution in StableHLO, and its operands' types.
_PRODUCT = re.compile(
    r"stablehlo\.(?:dot_general|dot|convolution)\b.*?:\s*\(tensor<([^>]*)>,"
    r"\s*tensor<([^>]*)>")
_ELEMENT = {"f64": "float64", "f32": "float32", "bf16": "bfloat16",
            "f16": "float16", "i8": "int8", "ui8": "uint8", "i4": "int4"}


@dataclasses.dataclass(frozen=True)
class ProgramFacts:
  """One device's view of a compiled step: XLA's bytes, FLOPs, collectives
  and compute dtype."""

  argument_bytes: int
  output_bytes: int
  output_array_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: float
  collectives: tuple
  compute_dtype: str | None

  @property
  def peak_bytes(self) -> int:
    """Arguments, outputs that reuse no argument's buffer, and temporaries
    (XLA:CPU's `peak_memory_in_bytes` leaves temporaries out)."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes +
            self.temp_bytes)


def read(lowered, compiled, mesh, *, detail: bool = True) -> ProgramFacts:
  """The facts of `compiled` (from `lowered`), whose collectives run over
  `mesh`; without `detail`, no collectives and no compute dtype."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # one dict per program on older JAX
    cost = cost[0] if cost else {}
  return ProgramFacts(
      argument_bytes=int(memory.argument_size_in_bytes),
      output_bytes=int(memory.output_size_in_bytes),
      output_array_bytes=sum(
          memory_lib.device_bytes(jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=sharding))
          for x, sharding in zip(jax.tree.leaves(compiled.out_info),
                                 jax.tree.leaves(compiled.output_shardings))),
      alias_bytes=int(memory.alias_size_in_bytes),
      temp_bytes=int(memory.temp_size_in_bytes),
      flops=float((cost or {}).get("flops", 0.0)),
      collectives=(collectives_by_axes(compiled.as_text(), mesh) if detail
                   else ()),
      compute_dtype=compute_dtype(lowered.as_text()) if detail else None)


def collectives_by_axes(text: str, mesh) -> tuple:
  """`((axes, kind, count, bytes), ...)` of a program's collectives over
  `mesh`, largest first (groups of one device left out)."""
  if mesh.devices.size < 2:
    return ()
  names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
  found = collections.defaultdict(lambda: [0, 0])
  for c in hlo.collectives(text):
    axes = hlo.mesh_axes(c.groups, names, shape)
    if axes == ():
      continue
    row = found["?" if axes is None else "+".join(axes), c.kind]
    row[0] += 1
    row[1] += c.bytes
  return tuple(sorted(((axes, kind, count, size) for (axes, kind), (count, size)
                       in found.items()), key=lambda r: (-r[3], r[0], r[1])))


def compute_dtype(text: str) -> str | None:
  """The dtype most of a lowered program's matrix products and convolutions
  take, weighed by their operands' elements.

  Example:
    >>> from jdist._src.planning.program import compute_dtype
    >>> compute_dtype("%5 = stablehlo.dot_general %3, %4, contracting_dims ="
    ...               " [1] x [0] : (tensor<2x192xbf16>, tensor<192x3xbf16>)"
    ...               " -> tensor<2x3xf32>")
    'bfloat16'
  """
  weights = collections.Counter()
  for lhs, rhs in _PRODUCT.findall(text):
    *dims, element = lhs.split("x")
    size = math.prod(int(d) for d in dims if d.isdigit())
    size += math.prod(int(d) for d in rhs.split("x")[:-1] if d.isdigit())
    weights[_dtype_name(element)] += size
  return weights.most_common(1)[0][0] if weights else None


def _dtype_name(element: str) -> str:
  if element.startswith("f8"):
    return "float8"
  return _ELEMENT.get(element, element)
