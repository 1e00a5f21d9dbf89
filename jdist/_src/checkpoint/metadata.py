"""A checkpoint's metadata: its format, its seal, and what it says about
the arrays beside it.

Formats 1 to 3 still load: 3 checked its arrays by float sums, 2 named
sharded optimizer state with one more level, 1 had no SHA-256.

Example:
  >>> from jdist._src.checkpoint import metadata
  >>> sealed = metadata.seal({"format": metadata.FORMAT, "epoch": 2})
  >>> metadata.unseal(sealed)[1] is None
  True
  >>> metadata.unseal(dict(sealed, epoch=3))[1]
  'its metadata fails its checksum'
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.checkpoint import content_hash
from jdist._src.core import placement

FORMAT = "jdist.Trainer/4"
SUMMED_FORMAT = "jdist.Trainer/3"
NESTED_FORMAT = "jdist.Trainer/2"
UNCHECKED_FORMAT = "jdist.Trainer/1"
FORMATS = (FORMAT, SUMMED_FORMAT, NESTED_FORMAT, UNCHECKED_FORMAT)


def describe(names, leaves) -> dict:
  return {n: [list(np.shape(x)), str(x.dtype)] for n, x in zip(names, leaves)}


@jax.jit
def _sums(leaves):
  return jnp.stack([jnp.sum(jnp.asarray(x).astype(jnp.float32)) for x in leaves])


def _summed(got: list, meta: dict) -> bool:
  """Whether arrays of a format 1-3 checkpoint match its float sums."""
  sums = [float(v) for v in placement.to_host(_sums(got))] if got else []
  return np.allclose(sums, meta.get("checksums", []), rtol=1e-5, atol=1e-6,
                     equal_nan=True)


def changed(names: list, got: list, meta: dict) -> list[str]:
  """The leaves of `got` whose content is not what was saved (by content
  hash; for older formats, all of them when the float sums differ)."""
  if meta["format"] != FORMAT:
    return [] if _summed(got, meta) else names
  saved = meta.get("digests", {})
  digests, _ = content_hash.digests(got)
  return [n for n, d in zip(names, digests) if saved.get(n) != d]


def _digest(meta: dict) -> str:
  text = json.dumps(meta, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()


def seal(meta: dict) -> dict:
  """`meta` as JSON will read it back, with the checksum of its content."""
  meta = json.loads(json.dumps(meta))
  return dict(meta, meta_checksum=_digest(meta))


def unseal(meta: dict) -> tuple[dict, str | None]:
  """`(meta, problem)`: the metadata without its checksum, or what is wrong."""
  meta = dict(meta)
  checksum = meta.pop("meta_checksum", None)
  if checksum is None:
    if meta.get("format") in (FORMAT, SUMMED_FORMAT, NESTED_FORMAT):
      return meta, "its metadata has lost its checksum"
    return meta, None  # an older checkpoint, or not one of jdist's
  if checksum != _digest(meta):
    return meta, "its metadata fails its checksum"
  return meta, None


def policy_change(saved: dict, names: list[str]) -> list[str]:
  """The line saying loss scaling was turned on or off since the save."""
  scaled = lambda ns: any("/loss_scale/" in f"/{n}/" for n in ns)
  if scaled(saved) == scaled(names):
    return []
  if scaled(saved):
    why = ("the checkpoint was saved with dtype_policy=\"mixed_float16\" (its "
           "optimizer state has a loss scale), this Trainer scales no loss")
  else:
    why = ("the checkpoint was saved without loss scaling, this Trainer's "
           "dtype_policy=\"mixed_float16\" adds a loss scale")
  return [f"  ({why}: make the Trainer with the dtype_policy of the run that "
          "saved it)"]


def mismatch(saved: dict, expected: dict) -> list[str]:
  lines = []
  # Parameters first: they say most plainly which model each side holds.
  order = lambda n: (not n.startswith("params/"), n)
  for name in sorted(set(saved) | set(expected), key=order):
    if name not in expected:
      lines.append(f"  {name}: in the checkpoint, not in this model")
    elif name not in saved:
      lines.append(f"  {name}: in this model, not in the checkpoint")
    elif list(saved[name][0]) != list(expected[name][0]) or \
        saved[name][1] != expected[name][1]:
      lines.append(f"  {name}: checkpoint {tuple(saved[name][0])} "
                   f"{saved[name][1]}, model {tuple(expected[name][0])} "
                   f"{expected[name][1]}")
  return lines
