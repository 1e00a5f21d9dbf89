"""Keeping the input pipelines of several processes in step.

Every process must run every step, or the others wait forever. Once per
window of steps read ahead the processes exchange step counts and valid
examples: all run the longest input (an ended one feeds masked padding).
"""

from __future__ import annotations

import collections
import functools
import json
import zlib
from typing import Callable

import jax
import numpy as np

from jdist._src.errors import DistributionError
from jdist._src.input.host import HostStep

WINDOW = 8
# Elements of each leaf that a batch's fingerprint reads: every row, and as
# many of each row's elements (spread evenly over it) as fit.
FINGERPRINT_ELEMENTS = 4096


def fingerprint(leaves: list) -> str:
  """A short hash of a global batch: the same batch gives the same on every
  process, other rows or another order almost surely another (CRC-32).

  Example:
    >>> import numpy as np
    >>> from jdist._src.input.agreement import fingerprint
    >>> x = np.arange(12.0).reshape(4, 3)
    >>> fingerprint([x]) == fingerprint([x.copy()]), fingerprint([x]) == fingerprint([x[::-1]])
    (True, False)
  """
  # CRC-32: a batch that differs by accident (another order, other rows)
  # gives another value but for a chance of 2**-32, at a fifth of the cost
  # of a cryptographic hash (which guards against no adversary here).
  crc = 0
  for x in leaves:
    crc = zlib.crc32(f"{x.dtype.str}{x.shape}".encode(), crc)
    if x.ndim >= 2 and x.shape[0]:
      x = x[(slice(None),) + _row_sample(
          x.shape[1:], max(1, FINGERPRINT_ELEMENTS // x.shape[0]))]
    crc = zlib.crc32(np.ascontiguousarray(x), crc)
  return f"{crc:08x}"


@functools.lru_cache(maxsize=64)
def _row_sample(row_shape: tuple, at_most: int) -> tuple:
  """The index (per axis) of up to `at_most` elements spread over a row."""
  size = int(np.prod(row_shape))
  flat = np.unique(np.linspace(0, size - 1, min(size, at_most)).astype(np.intp))
  return np.unravel_index(flat, row_shape)


def _spec(rows) -> str:
  return str(jax.tree.map(lambda x: f"{x.dtype}{list(x.shape[1:])}", rows))


class StepAgreement:
  """This process's host steps (`read()`, None at the end), extended so that
  all processes run as many; `key` names the iterator alike on every process,
  and `per_process` inputs are padded and their counts added up."""

  def __init__(self, read: Callable, *, runtime, key: str, per_process: bool,
               timeout: float | None, window: int | None = None):
    self._read = read
    self._runtime = runtime
    self._key = key
    self._per_process = per_process
    self._timeout = timeout
    self._window = WINDOW if window is None else window
    self._round = 0
    self._agreed = 0  # steps agreed on in earlier windows
    self._buffer = collections.deque()
    self._template = None
    self._finished = False

  def next(self):
    """The next agreed step, or None when every process's input has ended."""
    if not self._buffer and not self._finished:
      self._agree()
    return self._buffer.popleft() if self._buffer else None

  def _agree(self) -> None:
    local = []
    while len(local) < self._window:
      item = self._read()
      if item is None:
        break
      local.append(item)
    if local:
      self._template = local[0]
    mine = {"n": len(local), "counts": [int(step.count or 0) for step in local],
            "spec": None if self._template is None else _spec(self._template.rows),
            "fingerprints": [step.fingerprint for step in local]}
    self._round += 1
    prefix = f"jdist/input/{self._key}/{self._round}/"
    infos = {p: json.loads(v) for p, v in self._runtime.exchange(
        prefix, json.dumps(mine), timeout=self._timeout,
        what=self._what()).items()}
    if self._round > 2:  # everyone has read round r-2 before publishing r-1
      self._runtime.delete(f"jdist/input/{self._key}/{self._round - 2}/"
                           f"{self._runtime.process_id}")
    self._check(infos)
    steps = max(i["n"] for i in infos.values())
    if steps < self._window:
      self._finished = True
    for j in range(steps):
      item = local[j] if j < len(local) else self._empty(infos, steps)
      if self._per_process:
        total = sum(i["counts"][j] for i in infos.values() if j < i["n"])
        item = item._replace(count=total)
      self._buffer.append(item)
    self._agreed += steps

  def _names(self) -> tuple[str, str]:
    """The dataset and which iterator of it this is, from the key."""
    dataset, _, iterator = self._key.rpartition("/")
    return (dataset, iterator) if dataset else (iterator, "1")

  def _what(self) -> str:
    """What the rendezvous is for, in messages."""
    dataset, iterator = self._names()
    return (f"the input agreement of dataset {dataset} (iterator {iterator}, "
            f"window {self._round})")

  def _check(self, infos: dict) -> None:
    specs = {p: i["spec"] for p, i in infos.items() if i["spec"] is not None}
    if len(set(specs.values())) > 1:
      detail = "; ".join(f"process {p}: {s}" for p, s in sorted(specs.items()))
      raise DistributionError(
          "The processes' batches differ in structure, per-example shape or "
          f"dtype ({detail}). Every process must batch the same features with "
          "the same per-replica batch size.")
    if not self._per_process:
      self._check_same_batches(infos)
    if not self._per_process and len({i["n"] for i in infos.values()}) > 1:
      detail = ", ".join(f"process {p}: {i['n']}" for p, i in sorted(infos.items()))
      raise DistributionError(
          "experimental_distribute_dataset needs the same global batches on "
          "every process, but the processes' datasets have different lengths "
          f"(batches in this window of {self._window}: {detail}). Give every "
          "process the same dataset, or use distribute_datasets_from_function "
          "for per-process data.")

  def _check_same_batches(self, infos: dict) -> None:
    """Raises at the first global batch the processes read differently."""
    for j in range(min(i["n"] for i in infos.values())):
      readers = collections.defaultdict(list)
      for p, info in sorted(infos.items()):
        readers[info["fingerprints"][j]].append(p)
      if len(readers) > 1:
        dataset, iterator = self._names()
        detail = "; ".join(f"{_processes(ps)}: {fp}"
                           for fp, ps in readers.items())
        raise DistributionError(
            f"The processes read different global batches: batch "
            f"{self._agreed + j} (counting from 0) of pass {iterator} over "
            f"dataset {dataset} differs between processes (fingerprints of "
            f"its rows: {detail}). experimental_distribute_dataset needs "
            "every process to read the same global batches in the same "
            "order (each keeps its own rows of them); otherwise some "
            "examples are trained on twice and others never. An unseeded "
            "shuffle does this: give the shuffle the same seed on every "
            "process (tf.data's shuffle(..., seed=S), "
            "np.random.default_rng(S)), or give each process its own data "
            "with distribute_datasets_from_function.")

  def _empty(self, infos: dict, steps: int):
    if self._template is None:
      have = ", ".join(f"process {p}: {i['n']}" for p, i in sorted(infos.items()))
      raise DistributionError(
          f"This process's input has no batches while another's has {steps} "
          f"({have}); jdist pads a process whose data ends early from the shape "
          "of its own earlier batches. Give every process at least one batch "
          "(shard the data so that no process gets none).")
    return HostStep(jax.tree.map(np.zeros_like, self._template.rows),
                    np.zeros_like(self._template.valid), 0)


def _processes(ids: list) -> str:
  """"process 1" or "processes 0, 2"."""
  return (f"process {ids[0]}" if len(ids) == 1
          else "processes " + ", ".join(map(str, ids)))
