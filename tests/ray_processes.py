"""The processes of the Ray cluster a test is connected to, found by title.

Tests that kill or stop a Ray actor's process find it the way an operator
would, by its process title (`ray::<actor class>`). Other Ray clusters may
run on the same machine (another test session), so only the children of
this cluster's raylets count: a raylet names its cluster's GCS address on
its command line.
"""

import os
import time

import pytest
import ray


def _cmdline(pid: str) -> list:
  with open(f"/proc/{pid}/cmdline", "rb") as f:
    return f.read().split(b"\0")


def _parent(pid: str) -> int:
  with open(f"/proc/{pid}/stat") as f:
    return int(f.read().rsplit(")", 1)[1].split()[1])


def raylet_pids() -> set:
  """The raylets (one per node) of the cluster this process is connected to."""
  flag = f"--gcs-address={ray.get_runtime_context().gcs_address}".encode()
  found = set()
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        args = _cmdline(entry)
      except OSError:
        continue
      if args[0].endswith(b"raylet") and flag in args:
        found.add(int(entry))
  return found


def actor_pids(name: str) -> list:
  """This cluster's processes titled `ray::<name>` (Ray names actor
  processes so), sorted."""
  raylets = raylet_pids()
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        title = _cmdline(entry)[0].decode(errors="replace").strip()
        parent = _parent(entry)
      except (OSError, ValueError, IndexError):
        continue
      if parent in raylets and (title == f"ray::{name}" or
                                title.startswith(f"ray::{name}.")):
        pids.append(int(entry))
  return sorted(pids)


def wait_gone(pids, timeout: float = 15.0) -> list:
  """Waits until none of `pids` exists; those still there at `timeout`."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")]
    if not alive:
      return []
    time.sleep(0.1)
  return alive


COORDINATORS = []  # each test's, shut down after it even when it fails


@pytest.fixture(autouse=True)
def shut_down_coordinators():
  """Shuts down the coordinators a test put in `COORDINATORS` (a module
  that imports this fixture uses it for each of its tests)."""
  yield
  while COORDINATORS:
    COORDINATORS.pop().shutdown()
