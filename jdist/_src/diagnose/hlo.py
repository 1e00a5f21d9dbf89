"""What a compiled step's HLO text says: its collectives' sizes, its callbacks.

An HLO element type names its width in bits (`f32`, `bf16`, `s8`, `u64`,
`c128`, `f8e4m3fn`), so a shape's bytes follow from its name; `pred` is one
byte, and a type without a width (`token`) carries no data.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+?(\d+)[a-z0-9]*)\[([\d,]*)\]")
_CALLBACK = re.compile(r'custom_call_target="[^"]*callback[^"]*"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


class Collective(NamedTuple):
  """One collective of a compiled program.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
      "collective-permute".
    bytes: its result's bytes per device (a reduce-scatter's result is one
      device's block; an all-gather's, the gathered whole).
    op_name: the JAX operation it comes from (`jit(step)/jvp(GPT)/...`; a
      backward pass's operations are under `transpose(...)`), or "".
  """

  kind: str
  bytes: int
  op_name: str


def _bytes(result_shape: str) -> int:
  """Bytes of an HLO result shape (an array or a tuple of arrays)."""
  total = 0
  for _, bits, dims in _ARRAY.findall(result_shape):
    elements = math.prod(int(d) for d in dims.split(",") if d)
    total += math.ceil(int(bits or 8) * elements / 8)
  return total


def collectives(hlo: str) -> list[Collective]:
  """Every collective of a compiled program, in the program's order.

  Example:
    >>> from jdist._src.diagnose.hlo import collectives
    >>> collectives('%ag = f32[8,4]{1,0} all-gather(%w), dimensions={0}, '
    ...             'metadata={op_name="jit(f)/jvp(dense)/dot_general"}')
    [Collective(kind='all-gather', bytes=128, op_name='jit(f)/jvp(dense)/dot_general')]
  """
  found = []
  for line in hlo.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      name = _OP_NAME.search(line)
      found.append(Collective(m.group(2), _bytes(m.group(1)),
                              name.group(1) if name else ""))
  return found


def collective_sizes(hlo: str) -> list[int]:
  """Bytes of each collective of a compiled program (per device).

  Example:
    >>> from jdist._src.diagnose.hlo import collective_sizes
    >>> collective_sizes("%ar = bf16[4,8]{1,0} all-reduce(%x), to_apply=%add")
    [64]
  """
  return [c.bytes for c in collectives(hlo)]


def host_callbacks(hlo: str) -> int:
  """How many calls back to Python a compiled program makes."""
  return len(_CALLBACK.findall(hlo))
