"""Layout notes: large parameters whole on every device of a replica that
spans devices, `LayoutMap` keys that match nothing (Keras leaves them
silent), and shards under `MIN_SHARD_ELEMENTS` per device."""

from __future__ import annotations

import math

from jdist._src.planning.memory import PARAMETERS, Leaf, format_bytes

# Fewer elements per device than this in a split array is a bad split.
MIN_SHARD_ELEMENTS = 128
# Parameters listed by name in one note, at most.
_SHOWN = 6


def notes(strategy, leaves: list[Leaf], *, whole_above: int) -> tuple:
  """The layout notes for the state `leaves` under `strategy`."""
  found = []
  layout_map = getattr(strategy, "layout_map", None)
  if strategy.mesh.devices.size > strategy.num_replicas_in_sync:
    found += _whole(leaves, whole_above)
  if layout_map is not None and leaves:
    example = next((l.path for l in leaves if l.kind == PARAMETERS),
                   leaves[0].path)
    found += [f"LayoutMap key {key!r} matches no array of the state, so it "
              "splits nothing. Keys match a whole path or its tail after a "
              f"'/' (re.fullmatch); the state's paths look like {example!r}."
              for key in layout_map.unmatched([l.path for l in leaves])]
  found += _small_shards(strategy, leaves, layout_map)
  return tuple(found)


def _whole(leaves: list[Leaf], whole_above: int) -> list[str]:
  big = sorted((l for l in leaves if l.kind == PARAMETERS and not l.split
                and l.device_bytes >= whole_above),
               key=lambda l: -l.device_bytes)
  if not big:
    return []
  shown = ", ".join(
      f"{l.path} {l.shape} {l.dtype} ({format_bytes(l.device_bytes)})"
      for l in big[:_SHOWN])
  more = f" and {len(big) - _SHOWN} more" if len(big) > _SHOWN else ""
  total = format_bytes(sum(l.device_bytes for l in big))
  return [f"{len(big)} parameter(s) of {format_bytes(whole_above)} or more "
          f"are whole on every device ({total} per device): {shown}{more}. "
          "Split them with a LayoutMap key, or over an FSDP axis "
          "(ModelParallelStrategy(fsdp_axis=...))."]


def _small_shards(strategy, leaves: list[Leaf], layout_map) -> list[str]:
  by_rule: dict = {}
  fsdp = getattr(strategy, "fsdp_axis", None)
  for leaf in leaves:
    if leaf.kind != PARAMETERS or not leaf.split or (
        math.prod(leaf.device_shape) >= MIN_SHARD_ELEMENTS):
      continue
    key = layout_map.key_of(leaf.path) if layout_map is not None else None
    if key is not None:
      rule = f"LayoutMap key {key!r} {tuple(layout_map[key] or ())}"
    elif fsdp is not None and any(fsdp == a or (isinstance(a, tuple) and
                                                fsdp in a) for a in leaf.spec):
      rule = f"fsdp_axis={fsdp!r}"
    else:
      rule = "flax's partition metadata"
    by_rule.setdefault(rule, []).append(leaf)
  if not by_rule:
    return []
  rules = "; ".join(
      f"{rule}: " + ", ".join(f"{l.path} {l.shape} -> {l.device_shape}"
                              for l in found[:_SHOWN]) +
      (f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else "")
      for rule, found in by_rule.items())
  return [f"Layouts that split parameters into shards of fewer than "
          f"{MIN_SHARD_ELEMENTS} elements per device (gathering or reducing "
          "such small pieces costs more than the memory it saves; keep them "
          f"whole): {rules}."]
