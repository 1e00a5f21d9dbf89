"""What a compiled step's HLO text says: its collectives' sizes, its callbacks.

An HLO element type names its width in bits (`f32`, `bf16`, `s8`, `u64`,
`c128`, `f8e4m3fn`), so a shape's bytes follow from its name; `pred` is one
byte, and a type without a width (`token`) carries no data.
"""

from __future__ import annotations

import math
import re

_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[a-z]+?(\d+)[a-z0-9]*)\[([\d,]*)\]")
_CALLBACK = re.compile(r'custom_call_target="[^"]*callback[^"]*"')


def _bytes(result_shape: str) -> int:
  """Bytes of an HLO result shape (an array or a tuple of arrays)."""
  total = 0
  for _, bits, dims in _ARRAY.findall(result_shape):
    elements = math.prod(int(d) for d in dims.split(",") if d)
    total += math.ceil(int(bits or 8) * elements / 8)
  return total


def collective_sizes(hlo: str) -> list[int]:
  """Bytes of each collective of a compiled program (per device).

  Example:
    >>> from jdist._src.diagnose.hlo import collective_sizes
    >>> collective_sizes("%ar = bf16[4,8]{1,0} all-reduce(%x), to_apply=%add")
    [64]
  """
  return [_bytes(m.group(1)) for m in map(_COLLECTIVE.search, hlo.splitlines())
          if m]


def host_callbacks(hlo: str) -> int:
  """How many calls back to Python a compiled program makes."""
  return len(_CALLBACK.findall(hlo))
