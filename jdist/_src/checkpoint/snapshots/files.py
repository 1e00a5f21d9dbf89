"""A snapshot file: writing its buffers, checking its values, reading it.

A file is `MAGIC`, the header's length (8 bytes, little endian), the JSON
header (with the data's CRC-32, checked before a byte is used), then the
part's and the replica's blocks. It is renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jdist._src.checkpoint.snapshots import layout as layout_lib
from jdist._src.checkpoint.snapshots.naming import MAGIC


def say(message: str) -> None:
  """A line on process 0's error output (every process knows the same)."""
  if jax.process_index() == 0:
    print(f"jdist: {message}", file=sys.stderr, flush=True)


def write_all(path: str, buffers: list, spare: tuple | None = None) -> tuple:
  """Writes `buffers` in one `pwritev` to a new file `path`, or over `spare`
  (`(fd, size)` of an open file); returns `(fd, size)`, the file left open."""
  fd, size = spare or (os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                                0o600), 0)
  try:
    total = sum(map(len, buffers))
    written = os.pwritev(fd, buffers, 0)
    if written < total:  # (rare) the rest, from where it stopped
      rest = memoryview(b"".join(buffers))[written:]
      while rest:
        rest = rest[os.pwrite(fd, rest, total - len(rest)):]
    if total < size:
      os.ftruncate(fd, total)
  except BaseException:
    os.close(fd)
    raise
  return fd, total


def _unpacked(packed) -> tuple:
  """`(data, finite)` of a buffer `packing.py` made: its bytes and its last
  byte; `(empty, True)` for None."""
  if packed is None:
    return np.zeros(0, np.uint8), True
  raw = packed if type(packed) is np.ndarray else _host_bytes(packed)
  return raw[:-1], bool(raw[-1])


def _host_bytes(x) -> np.ndarray:
  """The bytes of `x` (this process's block of it) on the host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = x.addressable_data(0)
  return np.asarray(x)


def checked(step: int, layout: "layout_lib.Layout", packed,
            host: list) -> list | None:
  """The arrays of a part to write, or None (with a line) for NaN or inf."""
  data, finite = _unpacked(packed)
  if finite and not host:  # the usual case
    return [data]
  bad = None if finite else layout.nonfinite(data)
  if not finite and bad is None:
    bad = 0
  if bad is None:
    bad = next((layout.on_device + k for k, h in enumerate(host)
                if np.issubdtype(h.dtype, np.inexact) and
                not layout_lib.finite(np.ascontiguousarray(h), h.dtype, 0,
                                          h.nbytes)),
               None)
  if bad is not None:
    say(f"not writing the in-memory snapshot of step {step}: "
        f"{layout.names[bad]} has NaN or infinite values; the one before "
        "it stays the newest.")
    return None
  return [data, *(np.ascontiguousarray(h).reshape(-1).view(np.uint8)
                  for h in host)]  # (bfloat16 too)


def replica(step: int, layout: "layout_lib.Layout",
            received) -> np.ndarray | None:
  """The bytes of the replica to write, or None (with a line) for NaN or inf."""
  data, finite = _unpacked(received)
  if not finite:
    bad = layout.nonfinite(data)
    say(f"not writing the in-memory snapshot of step {step}: "
        f"{layout.names[bad or 0]} has NaN or infinite values (in the part "
        "of the process before this one); the one before it stays the "
        "newest.")
    return None
  return data[:layout.nbytes]




def close(fd: int | None) -> None:
  if fd is not None:
    os.close(fd)


def dtype(name: str) -> np.dtype:
  return np.dtype(jnp.dtype(name))  # also bfloat16 and the other ml_dtypes



def fill(raw: bytes, described: dict, full: dict, covered: dict) -> str | None:
  """Copies a process's file's blocks into `full`; what is wrong, or None."""
  if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 8:
    return "is not a snapshot part"
  (n,) = struct.unpack("<Q", raw[len(MAGIC):len(MAGIC) + 8])
  start = len(MAGIC) + 8 + n
  try:
    header = json.loads(raw[len(MAGIC) + 8:start])
  except ValueError:
    return "has an unreadable header"
  data = memoryview(raw)[start:]
  if zlib.crc32(data) != header.get("crc32"):
    return "fails its checksum"
  entries = [*header["leaves"], *header.get("replica", {}).get("leaves", [])]
  wanted = {k: [list(s), str(dtype(d))] for k, (s, d) in described.items()}
  if any(wanted.get(e["name"]) != [e["shape"], e["dtype"]] for e in entries
         ) or {e["name"] for e in header["leaves"]} != set(wanted):
    return "holds another state (other leaves, shapes or dtypes)"
  offset = 0
  for e in entries:
    kind = dtype(e["dtype"])
    for shard in e["shards"]:
      where = tuple(slice(a, b) for a, b in shard["bounds"])
      shape = [b - a for a, b in shard["bounds"]]
      block = np.frombuffer(data, kind, count=int(np.prod(shape)),
                            offset=offset).reshape(shape)
      full[e["name"]][where] = block
      covered[e["name"]][where] = True
      offset += shard["nbytes"]
  return None


def header_shape(path: str, name: str) -> list | None:
  """The shape of leaf `name` in the header of the file at `path`, or None."""
  try:
    with open(path, "rb") as f:
      start = f.read(len(MAGIC) + 8)
      header = json.loads(f.read(struct.unpack("<Q", start[len(MAGIC):])[0]))
    return next((e["shape"] for e in header["leaves"] if e["name"] == name),
                None)
  except (OSError, ValueError, KeyError, TypeError, struct.error):
    return None


def buffers(group, rank: int, header: bytes, arrays: list) -> list:
  """The buffers of process `rank`'s file of snapshot `group`: `MAGIC`, the
  header's length, the header's start (step, CRC-32 of `arrays`, attempt,
  rank), the rest of the header, then `arrays`."""
  crc = 0
  for raw in arrays:
    crc = zlib.crc32(raw, crc)
  head = b'{"step": %d, "crc32": %d, "attempt": %d, "rank": %d, ' % (
      group[0], crc, group[1], rank)
  return [MAGIC + struct.pack("<Q", len(head) + len(header)) + head, header,
          *arrays]
